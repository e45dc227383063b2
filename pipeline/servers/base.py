"""What every serving engine shares: a server process started on 127.0.0.1 on a free port, health-checked before
use, its log kept, and stopped on every exit path (the ``with`` block's end, an exception, and, through the
parent-death signal of pipeline.infra.child_processes, a run killed with SIGKILL).

An engine module subclasses ``ServedEngine`` with what is its own: the command line and environment (``command``,
``env``), what it serves for a variant and with which settings (``plan``), how a request asks it for exactly N
output tokens (``request_body``), its version and a one-line description of its set-up."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.infra.child_processes import child_options

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 8        # the warm-up request's reply length (ServedEngine.warm_up)
IDLE_CPU_SHARE = 0.10     # ServedEngine.wait_idle: a server using less of one core than this ...
IDLE_WINDOW_S = 0.5       # ... over two windows in a row of this length has nothing left to do


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime: fields 14, 15 of stat


class ServerError(RuntimeError):
    """The server did not start or stopped answering; the message ends with its log's last lines."""


class ServedEngine:
    """One server process for one variant's artifact; ``with Engine(...) as server:`` starts it and waits until
    ``GET /health`` answers ok, and stops it (SIGTERM, then SIGKILL after 10 s) however the block ends."""

    name = "engine"
    # Whether the engine may answer a repeated prompt from KV blocks an earlier request left (transformers serve
    # shares them between requests with the same prefix): every request of a trial then needs a prompt of its own,
    # and the load generator runs one level per invocation (pipeline.instruments.loadgen.run_guidellm's ``grouped``).
    serves_repeats_from_cache = True

    def __init__(self, served: Path, *, settings: dict, log_path: Path, startup_timeout_s: float):
        self.served, self.log_path = Path(served), Path(log_path)
        self.settings = settings
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    # ------------------------------------------------------------------ what an engine defines
    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict | None:
        """The server's environment (None: this process's)."""
        return None

    @classmethod
    def request_body(cls, output_tokens: int) -> dict:
        """The OpenAI request fields that make the engine generate exactly ``output_tokens`` tokens (no early stop
        at end-of-sequence) and serve no prompt from a cache of earlier requests."""
        raise NotImplementedError

    @classmethod
    def check(cls, variant) -> None:
        """Raise pipeline.infra.errors.Skip, with the reason, where the engine cannot serve ``variant`` whatever its
        artifact holds (e.g. a KV-cache setting it has no equivalent of); asked before any artifact is built."""

    @classmethod
    def plan(cls, cfg, variant, artifact, head_dim: int) -> dict:
        """What this engine serves for ``variant`` and how: {"served": file or folder, "weight_bytes",
        "kv_element_bytes", "settings"}; raises pipeline.infra.errors.Skip, with the reason, where it cannot serve
        it."""
        raise NotImplementedError

    @classmethod
    def version(cls, cfg) -> str:
        raise NotImplementedError

    @classmethod
    def launch(cls, plan: dict, *, slots: int, ctx_per_slot: int, gpu: bool, log_path: Path) -> "ServedEngine":
        """An engine (not yet started) for one trial of ``plan``."""
        raise NotImplementedError

    @classmethod
    def describe(cls, settings: dict) -> str:
        """The set-up in a few words, for the report."""
        return ", ".join(f"{k} {v}" for k, v in settings.items())

    # ------------------------------------------------------------------ the lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        try:
            for attempt in range(3):          # another process may take the free port between bind and listen
                self.port = free_port()
                cmd = self.command(self.port)
                self._log.write(("\n$ " + " ".join(cmd) + "\n").encode())
                self._log.flush()
                self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env(), **child_options())
                try:
                    self._wait_healthy()
                    log.info("%s %s on %s (pid %d)", self.name, self.served.name, self.url, self.proc.pid)
                    self.warm_up()
                    return
                except ServerError as exc:
                    port_taken = "bind" in str(exc).lower() or "address already in use" in str(exc).lower()
                    self._terminate()
                    if not port_taken or attempt == 2:
                        raise
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with status {self.proc.returncode} while starting "
                                  f"({self.served.name}); its log ({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read() or b"{}").get("status") == "ok":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass                          # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise ServerError(f"{self.name} did not become healthy within {self.startup_timeout_s:.0f} s "
                          f"({self.served.name}); its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def warm_up(self) -> None:
        """One short request before any is measured: a served model is warm in production, and the first request
        to a fresh process pays one-off costs (transformers: first-call kernel and allocator set-up, about 15 s of
        a 32-token reply here) that would land on the first level measured."""
        body = json.dumps({"messages": [{"role": "user", "content": "Confirm order PO-4471 for 12 pallets."}],
                           **self.request_body(WARM_UP_TOKENS)}).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.startup_timeout_s) as r:
                r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ServerError(f"{self.name} did not answer its warm-up request ({self.served.name}): {exc}; its log "
                              f"({self.log_path}) ends with:\n{self.log_tail()}") from None

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Until the server has finished what an earlier level left running (a level cut at its deadline leaves
        requests in flight, and an engine may go on generating for a client that has gone): here until the process
        uses under IDLE_CPU_SHARE of a core over two IDLE_WINDOW_S windows in a row; an engine with a finer signal
        overrides it. True when idle, False on timeout or when the process is gone."""
        pid = self.proc.pid if self.proc is not None else None
        last = cpu_seconds(pid) if pid is not None else None
        if last is None:
            return False
        deadline, quiet = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            time.sleep(IDLE_WINDOW_S)
            now = cpu_seconds(pid)
            if now is None:
                return False
            quiet = quiet + 1 if (now - last) < IDLE_CPU_SHARE * IDLE_WINDOW_S else 0
            last = now
            if quiet >= 2:
                return True
        log.warning("%s (%s) still busy after %.0f s: the next level starts anyway", self.name, self.served.name,
                    timeout_s)
        return False

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def peak_rss_mb(self) -> float | None:
        """The server's resident high-water mark so far (read while it runs: gone after stop)."""
        from pipeline.infra.stage_memory import status_mb

        return status_mb("VmHWM", self.proc.pid) if self.proc and self.proc.poll() is None else None

    def log_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and close its log; safe to call twice."""
        try:
            self._terminate()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


def _live_pids(matches) -> list[int]:
    """Live processes other than this one for which ``matches(proc_dir)`` holds (processes that vanish or cannot
    be read while being looked at are left out)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if matches(d):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def pids_of(exe: Path) -> list[int]:
    """Live processes running the executable ``exe`` (a test's check that no server outlived its run)."""
    target = str(Path(exe).resolve())
    return _live_pids(lambda d: os.readlink(d / "exe") == target)


def pids_running(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (for servers run by an interpreter, whose
    executable is python itself)."""
    return _live_pids(lambda d: marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
