"""Model-written code cannot escape its confinement: each test runs code that tries, in the confinement
``bench:humaneval`` uses, and checks that the attempt failed. Where the confinement cannot be set up, running is
refused with the way out (and the escape tests check that refusal instead)."""

import os
import socket
import uuid
from pathlib import Path

import pytest

from pipeline.suites.lmeval import sandbox

CONFINED = sandbox.confinement()["confined"]
needs_confinement = pytest.mark.skipif(not CONFINED, reason=f"not confinable here: {sandbox.confinement()['how']}")


def _run(code: str, **kw):
    proc = sandbox.run_confined(code, **kw)
    return proc.returncode, proc.stdout.strip(), proc.stderr


def test_without_confinement_model_written_code_is_refused_with_the_way_out(monkeypatch):
    monkeypatch.setattr(sandbox, "confinement", lambda: {"confined": False, "argv": ["unshare", "--net"],
                                                         "processes": None, "how": "NOT confined (bwrap missing)"})
    with pytest.raises(sandbox.Unconfined, match=r"never run unconfined.*bwrap missing.*make sandbox.*"
                                                 r"bench\.allow_unconfined=true"):
        sandbox.check_completions([{"problem": {}, "completion": ""}])
    assert sandbox.refusal(allow_unconfined=True) is None


@needs_confinement
def test_no_network():
    code = ("import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=2); print('ESCAPED')\n"
            "except OSError as e: print('blocked', e)\nprint(sorted(n for _, n in socket.if_nameindex()))")
    rc, out, err = _run(code)
    assert rc == 0 and "blocked" in out and "ESCAPED" not in out and "['lo']" in out, err


@needs_confinement
def test_no_write_outside_its_tmpfs_and_no_huge_file(tmp_path):
    target = Path(__file__).resolve().parents[1] / "pipeline" / f"escape-{uuid.uuid4().hex}"
    code = (f"for p in [{str(target)!r}, '/usr/escape', '/escape']:\n"
            "    try:\n        open(p, 'w').write('x'); print('ESCAPED', p)\n"
            "    except OSError as e: print('blocked', p, type(e).__name__)\n"
            "try:\n    f = open('/tmp/big', 'wb')\n    [f.write(b'0' * 2**20) for _ in range(1024)]\n"
            "    f.close(); print('ESCAPED 1 GB')\nexcept OSError as e: print('file capped', type(e).__name__)\n")
    rc, out, err = _run(code)
    assert "ESCAPED" not in out and out.count("blocked") == 3, (out, err)
    # a write past RLIMIT_FSIZE gets SIGXFSZ (ignored by Python: an OSError) at 64 MB, never 1 GB
    assert "file capped" in out or rc != 0, (out, err)
    assert not target.exists()


@needs_confinement
def test_no_home_no_planted_secret_no_parents_environment(monkeypatch):
    home = Path(os.path.expanduser("~"))
    secret = home / f".qd-secret-{uuid.uuid4().hex}"
    secret.write_text("token")
    monkeypatch.setenv("QD_PARENT_SECRET", "s3cret-value")
    try:
        code = (f"import os\ntry: print('ESCAPED', open({str(secret)!r}).read())\n"
                "except OSError as e: print('blocked', type(e).__name__)\n"
                "print('env1', open('/proc/1/environ').read())\nprint('env', dict(os.environ))")
        rc, out, err = _run(code)
    finally:
        secret.unlink()
    assert rc == 0 and "blocked" in out and "ESCAPED" not in out, err
    assert "s3cret-value" not in out                   # /proc/1 is the sandbox's own first process


@needs_confinement
def test_no_host_namespace_and_no_unix_socket_in_run(tmp_path):
    path = Path("/run") / f"qd-test-{uuid.uuid4().hex}.sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
    except OSError as exc:
        pytest.skip(f"cannot make a socket in /run here: {exc}")
    server.listen(1)
    host_net = os.stat("/proc/self/ns/net").st_ino
    code = (f"import os, socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({str(path)!r}); "
            "print('ESCAPED')\nexcept OSError as e: print('blocked', type(e).__name__)\n"
            "try:\n    fd = os.open('/proc/1/ns/net', os.O_RDONLY); print('ns', os.fstat(fd).st_ino)\n"
            "except OSError as e: print('ns blocked', type(e).__name__)")
    try:
        rc, out, err = _run(code)
    finally:
        server.close()
        path.unlink()
    assert rc == 0 and "blocked" in out.splitlines()[0] and "ESCAPED" not in out, err
    ns = out.splitlines()[1]
    assert ns.startswith("ns blocked") or int(ns.split()[1]) != host_net, out


@needs_confinement
def test_a_fork_bomb_stops_at_the_process_cap():
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(10000):\n        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e: print('capped', n)\n"
            "print('forked', n)")
    rc, out, err = _run(code, timeout_s=120)
    forked = int(out.splitlines()[-1].split()[1])
    assert "capped" in out and forked < sandbox.MAX_PROCESSES, (out, err)


def test_the_bench_stage_skips_humaneval_with_the_refusal_and_runs_it_when_allowed(tiny_cfg, monkeypatch):
    """Where the confinement cannot be set up, bench:humaneval is skipped on every variant with the refusal as its
    reason (nothing model-written runs); bench.allow_unconfined=true runs it; a task that runs no code is never
    held back."""
    from pipeline.stages import lmeval_tasks as bench

    monkeypatch.setattr(sandbox, "confinement", lambda: {"confined": False, "argv": [], "processes": None,
                                                         "how": "NOT confined (bwrap missing)"})
    ran = []
    monkeypatch.setattr(bench, "bench_task", lambda cfg, o, r, a, task: ran.append(task) or {
        "dir": "d", "key_hash": "h", "metrics": {}, "samples": 0})
    cfg = tiny_cfg("run.suites=[smoke,bench:humaneval,bench:business_mc]")
    out = bench.run_bench(cfg, None, None, None)
    assert out["humaneval"]["status"] == "skipped" and "never run unconfined" in out["humaneval"]["reason"]
    assert out["business_mc"]["status"] == "ok" and ran == ["business_mc"]
    out = bench.run_bench(tiny_cfg("run.suites=[smoke,bench:humaneval]", "bench.allow_unconfined=true"),
                          None, None, None)
    assert out["humaneval"]["status"] == "ok" and ran[-1] == "humaneval"
