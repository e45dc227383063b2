"""The dtype transformers computes in when a variant does not set one.

The original's logits are the zero point of every drift figure, so a variant is never computed in less precision
than its checkpoint holds for the sake of speed. On a GPU: the checkpoint's half dtype (bfloat16 for a float32
checkpoint, as deployed). On a CPU the checkpoint's own dtype, except that (1) a half-precision checkpoint is
upcast to float32, which is lossless, where float32 is measured faster here at both a prompt-shaped and a
decode-shaped forward (a CPU without native bf16 kernels) and its weights fit; (2) float32 weights that would not
fit the memory available run in bfloat16, and the run says so. Speed is measured once per CPU, torch version and
thread count on a small model-shaped forward (a few seconds, cached), never assumed, each half dtype for itself: on
one AVX-512 EPYC bfloat16 ran a 512-token prompt of the demo model's shape 4.5x faster than float32 with torch
2.13, where an earlier measurement of the real demo model had it 5x slower; float16, which that CPU has no native
matrix kernels for, read the prompt 3.1x slower than float32 and decoded 2.8x faster (this module's forward, two
threads), so a float16 GPTQ or AWQ checkpoint keeps its dtype there.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

CANDIDATES = ("float32", "bfloat16", "float16")
# the forward timed: a small Llama-shaped model (the operations of a real forward, not only its matrix products),
# a prompt of _PROMPT tokens at once (compute-bound) and single-token decode steps (memory-bound)
_SHAPE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 16,
          "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 2048}
_PROMPT = 128
_SECONDS_PER_SHAPE = 0.5
# of the memory available, the share a model's weights may take in the chosen dtype
_WEIGHTS_SHARE = 0.8
_VERSION = 3       # 3: float16 measured too (a float16 checkpoint was judged by bfloat16's rates)


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "quantdrift" / "compute-dtype"      # beside the llama.cpp tools: per machine


def measure_rates(threads: int) -> dict[str, dict[str, float]]:
    """{dtype: {"prompt": tokens/s, "decode": tokens/s}} of a small Llama-shaped forward on this CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_SHAPE)).eval()
    prompt = torch.randint(0, _SHAPE["vocab_size"], (1, _PROMPT))
    rates: dict[str, dict[str, float]] = {}
    for name in CANDIDATES:
        model = model.to(getattr(torch, name))
        with torch.inference_mode():
            model(prompt)                                 # first call: kernel selection, untimed
            n, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < _SECONDS_PER_SHAPE:
                model(prompt)
                n += 1
            prompt_rate = _PROMPT * n / elapsed
            cache = model(prompt, use_cache=True).past_key_values
            token = prompt[:, -1:]
            n, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < _SECONDS_PER_SHAPE:
                cache = model(token, past_key_values=cache, use_cache=True).past_key_values
                n += 1
        rates[name] = {"prompt": prompt_rate, "decode": n / elapsed}
    return rates


def cpu_rates(threads: int) -> dict[str, dict[str, float]]:
    """The measured rates for this CPU, torch version and thread count, measured once and kept."""
    import torch

    from pipeline.infra.files import write_json
    from pipeline.infra.stage_cache import hardware

    hw = hardware()
    key = f"{hw.get('cpu_key') or 'cpu'}-torch{torch.__version__}-t{threads}-v{_VERSION}"
    path = _cache_dir() / f"{key}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())["rates"]
        except (OSError, ValueError, KeyError):
            pass                                     # a damaged record is measured again
    rates = measure_rates(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"rates": rates, "cpu": hw.get("cpu"), "torch": torch.__version__, "threads": threads})
    return rates


def choose_cpu(rates: dict[str, dict[str, float]], own: str | None, weights_fp32_bytes: int | None,
               available_bytes: int | None) -> tuple[str, str]:
    """(dtype, why) on a CPU for a checkpoint of dtype ``own``, from measured rates and whether float32 fits: a
    half checkpoint against its own dtype's rates, a float32 one against bfloat16's (its fallback)."""
    half = own if own in ("bfloat16", "float16") else "bfloat16"
    fp32, other = rates["float32"], rates[half]
    measured = (f"float32 / {half} forward speed measured here: prompt {fp32['prompt'] / other['prompt']:.2f}x, "
                f"decode {fp32['decode'] / other['decode']:.2f}x")
    fits = not (weights_fp32_bytes and available_bytes and weights_fp32_bytes > _WEIGHTS_SHARE * available_bytes)
    if own in ("bfloat16", "float16"):
        if fits and fp32["prompt"] > other["prompt"] and fp32["decode"] > other["decode"]:
            return "float32", f"the {own} checkpoint upcast to float32 (lossless; faster here: {measured})"
        return own, f"the checkpoint's own dtype ({measured})"
    if not fits:
        return "bfloat16", (f"float32 weights ({weights_fp32_bytes / 2**30:.1f} GiB) exceed {_WEIGHTS_SHARE:.0%} of "
                            f"the {available_bytes / 2**30:.1f} GiB available: bfloat16, with its rounding in every "
                            f"figure of this runtime ({measured})")
    return "float32", f"the checkpoint's own dtype ({measured})"


def checkpoint_dtype(artifact: Path) -> str | None:
    """The dtype the checkpoint's config.json declares (``dtype``, or the older ``torch_dtype``)."""
    try:
        config = json.loads((Path(artifact) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if value in ("float32", "bfloat16", "float16") else None


def fp32_weights_bytes(artifact: Path, own: str) -> int | None:
    """The checkpoint's safetensors weights as float32 (its stored bytes, doubled for a half-precision one)."""
    artifact = Path(artifact)
    stored = sum(f.stat().st_size for f in artifact.glob("*.safetensors")) if artifact.is_dir() else 0
    return stored * (1 if own == "float32" else 2) or None


def resolve(device: str, artifact: Path, threads: int, available_bytes: int | None = None) -> tuple[str, str]:
    """(dtype name, why) for a variant that sets no dtype."""
    own = checkpoint_dtype(artifact)
    if device != "cpu":
        if own in ("bfloat16", "float16"):
            return own, f"the checkpoint's own dtype on {device}"
        return "bfloat16", f"bfloat16 on {device} (the checkpoint declares {own or 'no dtype'})"
    own = own or "float32"
    return choose_cpu(cpu_rates(threads), own, fp32_weights_bytes(artifact, own), available_bytes)
