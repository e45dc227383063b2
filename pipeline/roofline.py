"""Memory bandwidth of the host (or GPU), measured once per run, for the roofline column: decode is memory-bound,
so decode tokens/s x bytes read per token / bandwidth says how close a runtime gets to the physical limit."""

from __future__ import annotations

import time
from pathlib import Path


def measure_bandwidth(device: str = "cpu", mib: int = 512, repeats: int = 7) -> dict:
    """Best-of-``repeats`` copy of a ``mib`` MiB buffer: bytes read + bytes written per second.

    CPU: numpy copy (one thread, like one decode stream's memory traffic pattern; llama.cpp's threads share the
    same memory controllers). CUDA: device-to-device copy with torch."""
    n = mib * 2**20
    if device.startswith("cuda"):
        import torch

        a = torch.empty(n, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        method = f"torch device-to-device copy of {mib} MiB on {torch.cuda.get_device_name(device)}"
    else:
        import numpy as np

        a = np.ones(n // 8)
        b = np.empty_like(a)
        np.copyto(b, a)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t)
        method = f"numpy copy of {mib} MiB (read + write), best of {repeats}"
    return {"bytes_per_s": 2 * n / best, "device": device, "method": method}


def resolve_device(requested: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; a cuda request without one is a clear error (exit 2)."""
    if requested == "cpu":
        return requested
    from pipeline.runtimes.hf import resolve_device as hf_resolve

    return hf_resolve(requested)


def run_bandwidth(cfg, device: str) -> dict:
    """Cached per run directory and machine (force=true measures again)."""
    from pipeline.store import hardware, read_json, run_stage, write_json

    out_dir: Path = cfg.model_dir / "runs" / cfg.run.name / "_bandwidth"

    def build(tmp: Path) -> dict:
        write_json(tmp / "bandwidth.json", measure_bandwidth(device))
        return {}

    run_stage("bandwidth", out_dir, {"device": device, "hardware": hardware()}, build, force=cfg.force)
    return read_json(out_dir / "bandwidth.json")


def load_bandwidth(cfg) -> dict | None:
    from pipeline.store import read_json

    path = cfg.model_dir / "runs" / cfg.run.name / "_bandwidth" / "bandwidth.json"
    return read_json(path) if path.is_file() else None
