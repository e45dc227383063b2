"""No orphan: a child started through pipeline.children dies with the run, also when the run is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = """
import subprocess, sys, time
from pipeline.children import child_options
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **child_options())
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:          # a zombie waiting for its reaper is gone too
        return fh.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_does_not_outlive_a_killed_run(sig):
    from pipeline.config import PROJECT_ROOT

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT,
                              env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert not _alive(child), "the child outlived its run"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
