"""The resident memory of this process (a leaf module: the probe child and the quantizer child both record it)."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's resident high-water mark. VmHWM belongs to the current address space; ru_maxrss would
    carry the parent's peak across fork+exec on Linux and credit a small variant with the parent's model."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
