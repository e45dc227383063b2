"""Memory bandwidth of the host (or GPU), measured once per run, for the roofline column: decode is memory-bound,
so decode tokens/s x bytes read per token / bandwidth says how close a runtime gets to the physical limit. Beside it
on a CPU, its compute rate (a prompt-shaped matrix product): prefill is compute-bound, and the two move apart from
one machine state to the next on a shared machine, so the planner rescales a run's prompt work by the one and its
decoding by the other."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.infra.cpus import usable_cpus


def _copy_threads(a, b, threads: int) -> float:
    """Seconds for ``threads`` threads to each copy their slice of ``a`` into ``b`` (numpy releases the GIL for a
    large copy, so the slices stream concurrently, as llama.cpp's threads read their rows of the weights)."""
    import threading

    import numpy as np

    bounds = np.linspace(0, a.size, threads + 1).astype(int)
    barrier = threading.Barrier(threads + 1)

    def work(lo: int, hi: int) -> None:
        barrier.wait()
        np.copyto(b[lo:hi], a[lo:hi])

    pool = [threading.Thread(target=work, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


_MAX_BUFFER = 768 * 2**20


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size from sysfs (index*/size, e.g. "32768K"); None where it is not exposed."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def measure_bandwidth(device: str = "cpu", mib: int = 512, repeats: int = 7, threads: int | None = None,
                      max_cpu_noise: float = 0.10) -> dict:
    """Best-of-``repeats`` copy of a ``mib`` MiB buffer: bytes read + bytes written per second.

    CPU: a numpy copy split over ``threads`` threads (the runtimes' own thread count: one thread's copy cannot reach
    what several cores' memory traffic does, and a decode at 2 threads then read 160 % of a one-thread figure),
    over a buffer of 8x the last-level cache, kept within ``mib`` and 768 MiB. Noise: the CPU time other processes used during the
    measurement, as a share of the machine (the speed probe's check); above ``max_cpu_noise`` it is measured once
    more and the quieter measurement is kept, flagged when still noisy. CUDA: a device-to-device copy with torch."""
    import os

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
        return {"bytes_per_s": 2 * n / best, "device": device, "method": method}

    import numpy as np

    from pipeline.instruments.probe import OtherCpu

    threads = threads or usable_cpus()
    llc = last_level_cache_bytes()
    if llc and n < 8 * llc:
        # 8x the last-level cache, but no more than _MAX_BUFFER: a VM's sysfs names its host's whole L3, of which
        # its cores get a share (docs/plan.md, "The planner's constants and their sources")
        n = max(n, min(8 * llc, _MAX_BUFFER))
    a = np.ones(n // 8)
    b = np.empty_like(a)
    np.copyto(b, a)                       # touch every page once

    def once() -> tuple[float, float | None]:
        with OtherCpu() as other:
            best = min(_copy_threads(a, b, threads) for _ in range(repeats))
        return best, other.share

    best, noise = quieter(once, max_cpu_noise)
    return {"bytes_per_s": 2 * a.nbytes / best, "device": device, "threads": threads,
            "buffer_bytes": int(a.nbytes), "last_level_cache_bytes": llc, "cpu_noise": noise,
            "noisy": bool(noise is not None and noise > max_cpu_noise),
            "method": f"numpy copy of {a.nbytes / 2**20:.0f} MiB split over {threads} threads (read + write), "
                      f"best of {repeats}"}


def quieter(once, max_cpu_noise: float) -> tuple[float, float | None]:
    """``once()`` -> (best seconds, the CPU share other processes took meanwhile); above ``max_cpu_noise`` it is
    measured once more and the quieter of the two kept."""
    best, noise = once()
    if noise is not None and noise > max_cpu_noise:
        again, again_noise = once()
        if again_noise is not None and again_noise < noise:
            best, noise = again, again_noise
    return best, noise


def measure_compute(threads: int | None = None, repeats: int = 7, rows: int = 512, width: int = 2048,
                    max_cpu_noise: float = 0.10) -> dict:
    """Best-of-``repeats`` float32 matrix product of a prompt batch through one layer (``rows`` x ``width`` by
    ``width`` x ``width``: 4.3 GFLOP, tens of milliseconds) on ``threads`` BLAS threads, in FLOP/s, with the CPU
    time other processes took meanwhile (``OtherCpu``), measured once more when that is above ``max_cpu_noise``
    (``quieter``, as the bandwidth). A reading of the cores' arithmetic (their clock, the share a neighbour leaves
    them), as the bandwidth is of the memory; the two move apart between machine states (docs/plan.md, "How the
    prediction is made")."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from pipeline.instruments.probe import OtherCpu

    threads = threads or usable_cpus()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, width), dtype=np.float32)
    b = rng.standard_normal((width, width), dtype=np.float32)
    c = np.empty((rows, width), dtype=np.float32)

    def once() -> tuple[float, float | None]:
        best = float("inf")
        with OtherCpu() as other:
            for _ in range(repeats):
                t = time.perf_counter()
                np.matmul(a, b, out=c)
                best = min(best, time.perf_counter() - t)
        return best, other.share

    with threadpool_limits(limits=threads, user_api="blas"):
        np.matmul(a, b, out=c)                          # the BLAS threads started, the buffers touched
        best, noise = quieter(once, max_cpu_noise)
    return {"flops_per_s": 2 * rows * width * width / best, "threads": threads, "cpu_noise": noise,
            "noisy": bool(noise is not None and noise > max_cpu_noise),
            "method": f"numpy float32 matrix product {rows} x {width} by {width} x {width} on {threads} BLAS "
                      f"thread(s), best of {repeats}"}


def resolve_device(requested: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; a cuda request without one is a clear error (exit 2)."""
    if requested == "cpu":
        return requested
    from pipeline.runtimes.hf import resolve_device as hf_resolve

    return hf_resolve(requested)


def run_bandwidth(cfg, device: str) -> dict:
    """Cached per run directory, machine and thread count (force=true measures again)."""
    from pipeline.infra.stage_cache import hardware, run_stage
    from pipeline.infra.files import read_json, write_json

    out_dir: Path = cfg.model_dir / "runs" / cfg.run.name / "_bandwidth"

    def build(tmp: Path) -> dict:
        reading = measure_bandwidth(device, threads=cfg.runtime.n_threads)
        if device == "cpu":            # the planner's compute reading (a GPU's is not taken: it plans by bandwidth)
            reading["compute"] = measure_compute(cfg.runtime.n_threads)
        write_json(tmp / "bandwidth.json", reading)
        return {}

    run_stage("bandwidth", out_dir, {"device": device, "hardware": hardware(), "threads": cfg.runtime.n_threads,
                                     "method": 3}, build, force=cfg.force)
    return read_json(out_dir / "bandwidth.json")


def load_bandwidth(cfg) -> dict | None:
    from pipeline.infra.files import read_json

    path = cfg.model_dir / "runs" / cfg.run.name / "_bandwidth" / "bandwidth.json"
    if not path.is_file():
        return None
    found = read_json(path)
    if found.get("device") == "cpu" and found.get("threads") != cfg.runtime.n_threads:
        return None      # a single-thread copy of an older version, or another thread count: measured again
    return found
