"""No orphan: a child started through pipeline.infra.child_processes dies with the run, also when the run is
SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import process_alive

PARENT = """
import subprocess, sys, time
from pipeline.infra.child_processes import child_options
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **child_options())
print(child.pid, flush=True)
time.sleep(120)
"""


_alive = process_alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_does_not_outlive_a_killed_run(sig):
    from pipeline.config.schema import PROJECT_ROOT

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


# a command that starts a worker of its own (as guidellm spawns one per stream), prints the worker's pid, and then
# either waits (the run is killed meanwhile) or exits at once, leaving the worker behind
SPAWNER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(worker.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""

SUPERVISING_PARENT = """
import subprocess, sys, time
from pipeline.infra.child_processes import supervised, supervised_options
cmd = supervised([sys.executable, "-c", {spawner!r}, sys.argv[1]])
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **supervised_options())
print(proc.stdout.readline().strip(), flush=True)
print(proc.wait() if sys.argv[1] == "0" else time.sleep(120), flush=True)
"""


def _supervising_parent(wait: str) -> tuple[subprocess.Popen, int]:
    """A run that starts SPAWNER supervised (``wait``: its seconds to live) and reports the spawned worker's pid."""
    from pipeline.config.schema import PROJECT_ROOT

    parent = subprocess.Popen([sys.executable, "-c", SUPERVISING_PARENT.format(spawner=SPAWNER), wait],
                              stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT,
                              env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    return parent, int(parent.stdout.readline())


def _gone_soon(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.time() + within_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_supervised_command_and_the_workers_it_started_die_with_a_killed_run(sig):
    """The parent-death signal reaches only the direct child; run through the group supervisor, a command's own
    workers die with the run too."""
    parent, worker = _supervising_parent("120")
    try:
        assert _alive(worker)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert _gone_soon(worker), "a worker of the supervised command outlived its run"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as on Linux")
def test_workers_a_supervised_command_left_behind_die_when_it_ends():
    parent, worker = _supervising_parent("0")
    try:
        assert parent.stdout.readline().strip() == "0"     # the command's own exit status comes through
        parent.wait(timeout=30)
        assert _gone_soon(worker), "a worker outlived the supervised command that started it"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
