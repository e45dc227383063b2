"""How many CPUs this process may really use: the affinity mask, capped by a cgroup CPU quota.

``os.cpu_count()`` counts the host's CPUs; a container or a SLURM job usually gets fewer (an affinity mask, or a
cgroup quota such as ``--cpus=2`` on a 64-core host). Threads sized by the host count oversubscribe the quota and
every speed figure then measures the throttling.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota in CPUs (quota / period) from cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; None when
    there is none (``max`` / -1) or it cannot be read."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        if text:
            return None
    except (OSError, ValueError, IndexError):
        pass
    for d in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """min(the CPUs in this process's affinity mask, the cgroup quota rounded up), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_quota(root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)
