"""``transformers serve --continuous-batching`` (the project's own transformers, with its ``serving`` extras) for
one HF-format variant: the original checkpoint and GPTQModel's GPTQ/AWQ folders, loaded as the hf runtime loads
them (fp32 on a CPU, bf16 on CUDA) and served with transformers' continuous batching over a paged KV cache.

What it cannot serve, and says so (the variant is reported skipped with the reason):
- an integer KV cache (``original+kv_int8``): continuous batching keeps its own paged cache in the model's dtype;
- llm-compressor's compressed-tensors checkpoints: transformers 5.24 cannot hold their packed asymmetric zero
  points (llm-compressor#1618; its loader re-initialises them), and ``transformers serve`` has no option to
  dequantize at load as the hf runtime does. vLLM serves that format on a GPU.

A request asks for exactly N tokens with ``max_completion_tokens`` and a per-request generation config whose
end-of-sequence id is -1 (the server rejects llama.cpp's ``ignore_eos`` with 422). The server shares complete KV
blocks between requests with the same prefix (its default, with no flag to turn it off); the load generator gives
every request of a trial its own prompt, so no request is served from another's cache.

The paged cache is sized to the trial, as llama-server's slots are: left to itself, transformers takes most of the
host's free memory for it (10.9 GB resident for the 135M embedded model here), which says nothing about the format.
``cb_blocks`` gives 2 x slots x pages-per-slot + slots pages of 256 tokens: the scheduler keeps 15 % of the pages free
and holds finished requests' pages for prefix sharing, so a tighter cache throttles admission (measured at 4
concurrent 512-token requests: 16 or 20 pages gave 12.6-13.5 output tok/s and TTFT p50 up to 4.6 s; 28 pages
15.4 tok/s, as the default cache's 15.4 and 15.8 in two trials, at 1.9 GB resident)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from pipeline.servers.base import ServedEngine


PAGE_TOKENS = 256      # transformers' ContinuousBatchingConfig.page_size default: tokens per cache page


def cb_blocks(slots: int, ctx_per_slot: int) -> int:
    """Cache pages for ``slots`` concurrent sequences of ``ctx_per_slot`` tokens (see the module docstring)."""
    return 2 * slots * math.ceil(ctx_per_slot / PAGE_TOKENS) + slots


def serve_exe() -> Path:
    """The ``transformers`` console script beside this interpreter."""
    return Path(sys.executable).parent / "transformers"


class TransformersServe(ServedEngine):
    name = "transformers serve"

    def __init__(self, model_dir: Path, *, threads: int, slots: int, ctx_per_slot: int, device: str = "cpu",
                 dtype: str = "float32", log_path: Path, startup_timeout_s: float = 300.0, version: str = ""):
        super().__init__(model_dir, log_path=log_path, startup_timeout_s=startup_timeout_s, settings={
            "engine": self.name, "version": version, "threads": threads, "device": device, "dtype": dtype,
            "slots": slots, "ctx_per_slot": ctx_per_slot, "cb_num_blocks": cb_blocks(slots, ctx_per_slot),
            "page_tokens": PAGE_TOKENS, "continuous_batching": True, "prefix_sharing": True,
            "folder": Path(model_dir).name,
        })

    def command(self, port: int) -> list[str]:
        s = self.settings
        return [str(serve_exe()), "serve", str(self.served), "--continuous-batching", "--device", s["device"],
                "--dtype", s["dtype"], "--cb-num-blocks", str(s["cb_num_blocks"]), "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "info"]

    def env(self) -> dict:
        n = str(self.settings["threads"])
        return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    @classmethod
    def request_body(cls, output_tokens: int) -> dict:
        return {"max_completion_tokens": output_tokens,
                "generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}

    @classmethod
    def check(cls, variant) -> None:
        from pipeline.infra.errors import Skip
        from pipeline.runtimes import runtime_class

        if runtime_class(variant.runtime).kv_cache_applied(variant.runtime_options):
            raise Skip(f"no serving engine for {variant.name!r}: transformers serve's continuous batching keeps "
                       "its paged KV cache in the model's dtype (no integer KV cache), and vLLM needs CUDA")

    @classmethod
    def plan(cls, cfg, variant, artifact, head_dim: int) -> dict:
        from pipeline.infra.errors import Skip
        from pipeline.runtimes import runtime_class
        from pipeline.runtimes.hf import resolve_device
        from pipeline.infra.files import dir_bytes

        rt = runtime_class(variant.runtime)
        folder = Path(artifact.path)
        config = folder / "config.json"
        if not config.is_file():
            raise Skip(f"no serving engine for {variant.name!r}: {folder} holds no transformers checkpoint "
                       "(config.json)")
        qc = json.loads(config.read_text()).get("quantization_config") or {}
        if qc.get("quant_method") == "compressed-tensors":
            raise Skip(f"no serving engine for {variant.name!r} on this device: transformers 5.24 cannot load "
                       "compressed-tensors' packed zero points (llm-compressor#1618) and transformers serve has no "
                       "option to dequantize at load; vLLM serves this format on CUDA")
        if not serve_exe().is_file():
            raise Skip(f"no serving engine for {variant.name!r}: {serve_exe()} is missing (make setup installs "
                       "transformers with its serving extras)")
        device = resolve_device(cfg.runtime.device)
        dtype = (variant.runtime_options or {}).get("dtype") or ("float32" if device == "cpu" else "bfloat16")
        settings = {"threads": cfg.runtime.n_threads, "device": device, "dtype": dtype}
        return {"served": folder, "weight_bytes": dir_bytes(folder), "settings": settings,
                "kv_element_bytes": rt.cache_element_bytes({"dtype": dtype}, head_dim)}

    @classmethod
    def version(cls, cfg) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"transformers serve {version('transformers')} (continuous batching, paged attention)"
        except PackageNotFoundError:
            return "transformers serve"

    @classmethod
    def launch(cls, plan: dict, *, slots: int, ctx_per_slot: int, gpu: bool, log_path: Path) -> "TransformersServe":
        s = plan["settings"]
        return cls(plan["served"], threads=s["threads"], slots=slots, ctx_per_slot=ctx_per_slot, device=s["device"],
                   dtype=s["dtype"], log_path=log_path, version=plan.get("version", ""))

    @classmethod
    def describe(cls, settings: dict) -> str:
        return (f"{settings['threads']} threads, {settings['device']}, {settings['dtype']}, continuous batching, "
                f"{cb_blocks(settings['slots'], settings['ctx_per_slot'])} cache pages of {PAGE_TOKENS} tokens for "
                f"{settings['slots']} x {settings['ctx_per_slot']}")
