"""The peak host memory of one stage: this process's and its children's, recorded in every stage manifest.

Stages run one after another in one process (the local launcher runs a sweep's jobs in it), so the process's
lifetime high-water mark says nothing about a stage. Each stage therefore starts by handing freed memory back to
the system (``gc.collect`` and glibc's ``malloc_trim``: without it the next stage starts on top of what the
previous one freed but the allocator kept) and resetting the high-water mark (VmHWM, /proc/self/clear_refs); its
children (the converter, llama-quantize, the quantizer and probe workers) are sampled every 0.2 s (a child's
peak between two samples can be missed; the kernel's mark for waited-for children cannot stand in: it carries the
parent's pages across fork + exec). Stages nest (a quantization builds the F16 conversion it needs): an inner
stage's reset would erase the outer's peak, so what the outer had reached is folded into it first."""

from __future__ import annotations

import ctypes
import functools
import gc
import threading
from contextlib import suppress

from pathlib import Path

_ACTIVE: list["StagePeak"] = []


def status_mb(field: str, pid: int | str = "self") -> float | None:
    """A memory field of /proc/PID/status (``VmHWM``: resident high-water mark, ``VmRSS``: resident now) in MB;
    None where the process has gone or there is no procfs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark (VmHWM) to its resident size now, so that a later
    ``peak_rss_mb`` is the peak of what ran in between (one speed trial), not of the process's whole life (its
    model load included). Linux 4.0+: writing 5 to /proc/self/clear_refs. False where the kernel refuses it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has no such call (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Collect garbage and return the allocator's free pages to the system; False where it cannot be asked to."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _children_rss_mb() -> float:
    """The resident memory of this process's children now. A child between fork and exec still runs this
    process's command line on its pages (vfork shares them outright): it is this process, counted once, not twice."""
    import psutil

    me = psutil.Process()
    total = 0.0
    with suppress(psutil.Error):
        mine = me.cmdline()
        for child in me.children(recursive=True):
            with suppress(psutil.Error):
                if child.cmdline() != mine:
                    total += child.memory_info().rss / 2**20
    return total


class StagePeak:
    """``with StagePeak() as p: ...`` then ``p.record()``: the block's peak resident memory, in MB."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._own_folded = 0.0          # this process's peak reached before a nested stage reset the mark
        self._tree_mb = 0.0             # this process + its running children, sampled
        self._children_mb = 0.0         # the running children alone, sampled
        self._record: dict = {}

    def _sample(self) -> None:
        while not self._stop.is_set():
            own = status_mb("VmRSS") or 0.0
            children = _children_rss_mb()
            self._children_mb = max(self._children_mb, children)
            self._tree_mb = max(self._tree_mb, own + children)
            self._stop.wait(self.interval_s)

    def _fold(self, own_mb: float) -> None:
        self._own_folded = max(self._own_folded, own_mb)

    def __enter__(self) -> "StagePeak":
        self.trimmed = release_freed_memory()
        self.start_rss_mb = status_mb("VmRSS")
        for outer in _ACTIVE:
            outer._fold(status_mb("VmHWM") or 0.0)
        self.reset = reset_peak_rss()
        _ACTIVE.append(self)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        _ACTIVE.remove(self)
        own = max(status_mb("VmHWM") or 0.0, self._own_folded)
        # children sampled only: the kernel's high-water mark of waited-for children (RUSAGE_CHILDREN) carries the
        # parent's resident pages across fork + exec, so a child of a large process would read as large as its parent
        self._record = {
            "peak_host_mb": round(max(own, self._tree_mb), 1),    # a sample of the tree holds its children's
            "peak_own_rss_mb": round(own, 1),
            "peak_children_rss_mb": round(self._children_mb, 1) if self._children_mb else None,
            "start_rss_mb": round(self.start_rss_mb, 1) if self.start_rss_mb is not None else None,
            "peak_method": ("VmHWM reset at the stage's start" if self.reset else
                            "VmHWM since the process started (the kernel refused a reset)")
            + "; children sampled every %.1f s" % self.interval_s
            + ("; freed memory returned first (malloc_trim)" if self.trimmed else ""),
        }
        for outer in _ACTIVE:
            outer._fold(own)

    def record(self) -> dict:
        return dict(self._record)
