"""Child processes that never outlive the pipeline. A quantizer, a converter, a speed probe or one of llama.cpp's
tools started by a run is stopped when the run stops, also when it is killed (SIGTERM from a scheduler, SIGKILL,
a closed terminal), where no ``finally`` runs: Linux's parent-death signal is set in the child before it executes.
Elsewhere (no prctl) the ``finally`` clauses of the callers are the only guard."""

from __future__ import annotations

import functools
import signal
import sys

PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=1)
def _prctl():
    """libc's prctl, resolved in the parent: after fork the child only calls it (no loader lock, no allocation)."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def child_options() -> dict:
    """Keyword arguments for subprocess.run/Popen that give the child SIGKILL when this process ends."""
    if not sys.platform.startswith("linux"):
        return {}
    prctl = _prctl()
    return {"preexec_fn": lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)}
