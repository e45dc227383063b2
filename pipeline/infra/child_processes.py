"""Child processes that never outlive the pipeline. A quantizer, a converter, a speed probe or one of llama.cpp's
tools started by a run is stopped when the run stops, also when it is killed (SIGTERM from a scheduler, SIGKILL,
a closed terminal), where no ``finally`` runs: Linux's parent-death signal is set in the child before it executes.
Elsewhere (no prctl) the ``finally`` clauses of the callers are the only guard.

A child that starts processes of its own (guidellm spawns a worker per stream) is run ``supervised``: through
``python -m pipeline.infra.child_processes CMD...``, which starts CMD in a process group of its own and kills that whole
group when CMD ends, when it is told to stop, and when the run dies (its parent-death signal is SIGTERM, which it
handles). The parent-death signal alone reaches only the direct child: guidellm's workers outlived a run stopped with
SIGTERM, polling their queues, until this."""

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


def child_options(sig: int = signal.SIGKILL) -> dict:
    """Keyword arguments for subprocess.run/Popen that give the child ``sig`` (SIGKILL; a ``supervised`` command
    gets SIGTERM, which it handles) when this process ends."""
    if not sys.platform.startswith("linux"):
        return {}
    prctl = _prctl()
    return {"preexec_fn": lambda: prctl(PR_SET_PDEATHSIG, sig)}


def supervised(cmd: list[str]) -> list[str]:
    """``cmd`` run by the group supervisor (see the module docstring); start it with ``supervised_options()``."""
    return [sys.executable, "-m", "pipeline.infra.child_processes", *cmd]


def supervised_options() -> dict:
    return child_options(signal.SIGTERM)


def stop_supervised(proc, timeout_s: float = 15.0) -> None:
    """Stop a supervised command and everything it started (SIGTERM to the supervisor, which kills the group;
    SIGKILL to the supervisor if it does not answer)."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_group(pgid: int) -> None:
    import os

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(argv: list[str]) -> int:
    import os
    import subprocess

    child: list = []

    def stop(signum, frame):
        if child:
            _kill_group(child[0].pid)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if os.getppid() == 1:              # the run died before the handler was in place: start nothing
        return 1
    child.append(subprocess.Popen(argv, start_new_session=True))
    try:
        return child[0].wait()
    finally:
        _kill_group(child[0].pid)      # stragglers of a command that ended (or was stopped)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m pipeline.infra.child_processes CMD [ARG...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(_supervise(sys.argv[1:]))
