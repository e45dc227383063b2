"""llama.cpp's own ``llama-server`` for one GGUF variant, from `make llama-tools`: the same build of llama.cpp whose
libraries the pipeline's llama.cpp runtime loads (CUDA when TORCH=cuda).

``with LlamaServer(...) as server:`` starts it on 127.0.0.1 on a free port with the variant's settings (threads,
slots, context per slot, flash attention, K/V cache types, every layer on the GPU on CUDA), waits until
``GET /health`` answers ok, and stops it on every exit path: the ``with`` block's end, an exception, and, through
the parent-death signal (pipeline.infra.child_processes), a run killed with SIGKILL. Its log is kept at ``log_path``.
Continuous batching is llama-server's default; it is passed explicitly and recorded."""

from __future__ import annotations

import json
import logging
import subprocess
import time
import urllib.request
from pathlib import Path

from pipeline.infra.child_processes import child_options
from pipeline.servers.base import ServedEngine

log = logging.getLogger(__name__)


def serve_settings(cfg, variant) -> dict:
    """The llama.cpp settings a variant's runtime options translate to (threads, flash attention, batch, K/V cache
    types): llama-server's here, llama-bench's in `make bench`."""
    opts = dict(variant.runtime_options or {})
    flash = cfg.runtime.flash_attn if opts.get("flash_attn") is None else bool(opts["flash_attn"])
    rc = cfg.runtime
    # the device choice only where it is not the default (a stored sweep's key stays as it was)
    where = {**({"device": rc.device} if rc.device.startswith("cuda:") else {}),
             **({"gpus": rc.gpus, "gpu_headroom": rc.gpu_headroom} if rc.gpus != 1 else {})}
    return {"threads": rc.n_threads, "flash_attn": flash, "n_batch": rc.n_batch,
            "cache_type_k": opts.get("cache_type_k", "f16"), "cache_type_v": opts.get("cache_type_v", "f16"), **where}


def device_args(gguf: Path, settings: dict) -> tuple[list[str], dict | None]:
    """llama-server's device arguments on CUDA and the placement they apply (None on one device): runtime.device's
    GPU alone, or with runtime.gpus the same placement as the llama.cpp runtime's."""
    from pipeline.runtimes.placement import device_index, single_device_args

    if settings.get("gpus", 1) == 1:
        return single_device_args(device_index(settings.get("device", "cuda"))), None
    from pipeline.runtimes.llamacpp import gguf_placement

    placement = gguf_placement(Path(gguf), settings["gpus"], settings["gpu_headroom"])
    return placement.cli_args(), placement.row()


class LlamaServer(ServedEngine):
    name = "llama-server"
    serves_repeats_from_cache = False      # cache_prompt=false in every request (request_body)

    def __init__(self, exe: Path, gguf: Path, *, threads: int, slots: int, ctx_per_slot: int, flash_attn: bool,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", gpu: bool = False, n_gpu_layers: int = -1,
                 n_batch: int = 512, log_path: Path, startup_timeout_s: float = 120.0, version: str = "",
                 device: str = "cuda", gpus: int | str = 1, gpu_headroom: float = 0.2):
        self.exe, self.gguf = Path(exe), Path(gguf)
        super().__init__(gguf, log_path=log_path, startup_timeout_s=startup_timeout_s, settings={
            "engine": self.name, "version": version, "threads": threads, "slots": slots,
            "ctx_per_slot": ctx_per_slot, "ctx_total": slots * ctx_per_slot, "flash_attn": flash_attn,
            "cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "continuous_batching": True,
            "gpu": gpu, "n_gpu_layers": (n_gpu_layers if n_gpu_layers >= 0 else "all") if gpu else 0,
            "n_batch": n_batch, "prompt_cache_ram": 0, "file": self.gguf.name,
        })
        self.device_args: list[str] = []
        if gpu:
            self.device_args, placement = device_args(self.gguf, {"gpus": gpus, "gpu_headroom": gpu_headroom,
                                                                  "device": device})
            self.settings["device_args"] = " ".join(self.device_args)
            if placement:
                self.settings["placement"] = placement

    def command(self, port: int) -> list[str]:
        s = self.settings
        # -no-kvu: one KV stream per slot, so every slot holds its own ctx_per_slot (as llama-batched-bench runs);
        # -cram 0: no host-RAM prompt cache across requests (the same prompt repeated across trials would otherwise
        # be served from it and flatter TTFT); the slots' own prefix reuse stays, as in production.
        return [str(self.exe), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(s["threads"]), "-tb", str(s["threads"]), "-np", str(s["slots"]), "-c", str(s["ctx_total"]),
                "-b", str(s["n_batch"]), "-ub", str(s["n_batch"]), "-fa", "on" if s["flash_attn"] else "off",
                "-ctk", s["cache_type_k"], "-ctv", s["cache_type_v"], "-ngl", str(s["n_gpu_layers"]),
                "--cont-batching", "-no-kvu", "-cram", "0", "--no-webui", "--metrics", *self.device_args]

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Until no slot is processing (``GET /slots``); the process's CPU time where that cannot be read."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/slots", timeout=5) as r:
                    slots = json.loads(r.read())
            except Exception:
                return super().wait_idle(max(0.0, deadline - time.monotonic()))
            if not any(s.get("is_processing") for s in slots):
                return True
            time.sleep(0.25)
        log.warning("llama-server (%s) still processing after %.0f s: the next level starts anyway", self.gguf.name,
                    timeout_s)
        return False

    @classmethod
    def request_body(cls, output_tokens: int) -> dict:
        # ignore_eos: every request generates exactly output_tokens; cache_prompt=false: no slot serves a prompt
        # from an earlier request's cache (a repeated prompt would flatter TTFT)
        return {"max_completion_tokens": output_tokens, "ignore_eos": True, "cache_prompt": False}

    @classmethod
    def plan(cls, cfg, variant, artifact, head_dim: int) -> dict:
        from pipeline.infra.llama_tools import tool
        from pipeline.runtimes import runtime_class
        from pipeline.runtimes.llamacpp import gguf_file

        gguf = gguf_file(artifact.path)
        settings = serve_settings(cfg, variant)
        return {"served": gguf, "weight_bytes": gguf.stat().st_size, "settings": settings,
                "exe": tool("llama-server", cfg.bench.llama_tools),
                "kv_element_bytes": runtime_class(variant.runtime).cache_element_bytes(settings, head_dim)}

    @classmethod
    def version(cls, cfg) -> str:
        from pipeline.infra.llama_tools import tool

        return engine_version(tool("llama-server", cfg.bench.llama_tools))

    @classmethod
    def launch(cls, plan: dict, *, slots: int, ctx_per_slot: int, gpu: bool, log_path: Path) -> "LlamaServer":
        s = plan["settings"]
        return cls(plan["exe"], plan["served"], threads=s["threads"], slots=slots, ctx_per_slot=ctx_per_slot,
                   flash_attn=s["flash_attn"], cache_type_k=s["cache_type_k"], cache_type_v=s["cache_type_v"],
                   gpu=gpu, n_batch=s["n_batch"], log_path=log_path, version=plan.get("version", ""),
                   device=s.get("device", "cuda"), gpus=s.get("gpus", 1), gpu_headroom=s.get("gpu_headroom", 0.2))

    @classmethod
    def describe(cls, settings: dict) -> str:
        return (f"{settings['threads']} threads, {settings['slots']} slots, KV {settings['cache_type_k']}/"
                f"{settings['cache_type_v']}")


def server_version(exe: Path) -> str:
    """What ``llama-server --version`` prints (its first line), or "" when it prints nothing usable."""
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30, **child_options())
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.lower().startswith("version")), lines[0] if lines else "")


def engine_version(exe: Path) -> str:
    """The server's own version line with the llama-cpp-python release whose vendored llama.cpp it was built from
    (`make llama-tools`): the vendored tree reports a placeholder version ("0.5.0-dev, build 0")."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = f"llama.cpp vendored in llama-cpp-python {version('llama_cpp_python')}"
    except PackageNotFoundError:
        release = "llama.cpp"
    own = server_version(exe)
    return f"{release} ({own})" if own else release
