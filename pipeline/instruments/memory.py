"""Memory readings: this process's high-water mark, device memory (NVML, torch), a sampling thread (the probe child and the
quantizer child record them; the /proc readings themselves live in pipeline.infra.stage_memory)."""

from __future__ import annotations

import resource
import threading
import time

from pipeline.infra.stage_memory import status_mb


def peak_rss_mb() -> float:
    """This process's resident high-water mark. VmHWM belongs to the current address space; ru_maxrss would
    carry the parent's peak across fork+exec on Linux and credit a small variant with the parent's model."""
    hwm = status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def nvml_process_mb(pid: int) -> dict | None:
    """Device memory NVML reports for process ``pid`` (every CUDA user in it: torch, llama.cpp, the CUDA
    context), summed over the devices it uses, and the largest of those devices' totals; None without NVML (the
    ``nvidia-ml-py`` package and a driver) or when the process holds no device memory."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:        # no driver: NVMLError_LibraryNotFound / DriverNotLoaded
        return None
    try:
        used, total = 0, 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mine = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid]
            if mine:
                used += sum(int(p.usedGpuMemory or 0) for p in mine)
                total = max(total, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
        return {"used_mb": used / 2**20, "device_total_mb": total / 2**20} if used else None
    finally:
        pynvml.nvmlShutdown()


def nvml_device_used_mb(index: int = 0) -> float | None:
    """Device-wide used memory (every process), for a fallback where NVML lists no processes (some sandboxes,
    e.g. gVisor, report none): the probe child takes it before loading and after measuring."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used / 2**20
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


def device_memory(device: str | None, baseline_used_mb: float | None = None) -> dict | None:
    """This process's device memory on a CUDA device, read where the work ran: NVML's per-process figure (llama.cpp,
    servers, the CUDA context: what the device must hold) and torch's caching-allocator peaks (in-process
    transformers work). ``peak_mb``: the larger of NVML's reading and torch's reserved peak. None off CUDA."""
    import os

    if not str(device or "").startswith("cuda"):
        return None
    import sys

    out: dict = {"device": str(device)}
    try:
        # torch's allocator is read only where torch already runs: a llama.cpp process must never load torch's CUDA
        # runtime beside its own (the two in one process crashed at the first CUDA model load)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            idx = torch.device(str(device)).index or 0
            out["torch_allocated_peak_mb"] = torch.cuda.max_memory_allocated(idx) / 2**20
            out["torch_reserved_peak_mb"] = torch.cuda.max_memory_reserved(idx) / 2**20
            out["device_total_mb"] = torch.cuda.get_device_properties(idx).total_memory / 2**20
    except Exception:         # a torch without CUDA
        pass
    nvml = nvml_process_mb(os.getpid())
    if nvml:
        out["nvml_process_mb"] = nvml["used_mb"]
        out["device_total_mb"] = out.get("device_total_mb") or nvml["device_total_mb"]
    if not nvml and baseline_used_mb is not None:
        # no per-process figure: what the device holds now beyond what it held before this process loaded
        # anything (the probe runs alone on the device; a lower bound of its peak, like NVML's own reading)
        from pipeline.runtimes.placement import device_index

        now = nvml_device_used_mb(device_index(device))
        if now is not None and now > baseline_used_mb:
            out["nvml_device_delta_mb"] = now - baseline_used_mb
    readings = [x for x in (out.get("nvml_process_mb"), out.get("nvml_device_delta_mb"),
                            out.get("torch_reserved_peak_mb")) if x]
    out["peak_mb"] = max(readings) if readings else None
    out["source"] = " + ".join(s for s, k in (("NVML per-process", "nvml_process_mb"),
                                                ("NVML device used minus the probe's baseline", "nvml_device_delta_mb"),
                                                ("torch max_memory_reserved", "torch_reserved_peak_mb")) if k in out) \
        or "none (no NVML and no CUDA torch in this process)"
    return out


class MemorySampler:
    """Samples a process's resident memory (and, on CUDA, its device memory from NVML) every ``interval_s`` in a
    thread, so that each level's peak can be read from its own time window."""

    def __init__(self, pid: int, gpu: bool = False, interval_s: float = 0.2):
        self.pid, self.gpu, self.interval_s = pid, gpu, interval_s
        self.samples: list[tuple[float, float | None, float | None]] = []   # (unix time, rss MB, device MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _device_mb(self) -> float | None:
        if not self.gpu:
            return None
        reading = nvml_process_mb(self.pid)
        return reading["used_mb"] if reading else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), status_mb("VmRSS", self.pid), self._device_mb()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peak(self, start: float | None = None, end: float | None = None) -> tuple[float | None, float | None]:
        """(peak RSS MB, peak device MB) over samples in [start, end] (the whole run without bounds)."""
        inside = [s for s in self.samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
        inside = inside or self.samples
        rss = [s[1] for s in inside if s[1] is not None]
        dev = [s[2] for s in inside if s[2] is not None]
        return (max(rss) if rss else None), (max(dev) if dev else None)
