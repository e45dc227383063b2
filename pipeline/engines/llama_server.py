"""llama.cpp's own ``llama-server`` for one GGUF variant, built by `make llama-tools` from the same vendored llama.cpp
as the llama-cpp-python wheel, with the same CMake flags (CUDA when TORCH=cuda).

``with LlamaServer(...) as server:`` starts it on 127.0.0.1 on a free port with the variant's settings (threads,
slots, context per slot, flash attention, K/V cache types, every layer on the GPU on CUDA), waits until
``GET /health`` answers ok, and stops it on every exit path: the ``with`` block's end, an exception, and, through
the parent-death signal (pipeline.children), a run killed with SIGKILL. Its log is kept at ``log_path``.
Continuous batching is llama-server's default; it is passed explicitly and recorded."""

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

from pipeline.children import child_options

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice); the server binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server did not start or stopped answering; the message ends with its log's last lines."""


class LlamaServer:
    name = "llama-server"

    def __init__(self, exe: Path, gguf: Path, *, threads: int, slots: int, ctx_per_slot: int, flash_attn: bool,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", gpu: bool = False, n_gpu_layers: int = -1,
                 n_batch: int = 512, log_path: Path, startup_timeout_s: float = 120.0, version: str = ""):
        self.exe, self.gguf, self.log_path = Path(exe), Path(gguf), Path(log_path)
        self.settings = {
            "engine": self.name, "version": version, "threads": threads, "slots": slots,
            "ctx_per_slot": ctx_per_slot, "ctx_total": slots * ctx_per_slot, "flash_attn": flash_attn,
            "cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "continuous_batching": True,
            "gpu": gpu, "n_gpu_layers": (n_gpu_layers if n_gpu_layers >= 0 else "all") if gpu else 0,
            "n_batch": n_batch, "prompt_cache_ram": 0, "file": self.gguf.name,
        }
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    def command(self, port: int) -> list[str]:
        s = self.settings
        # -no-kvu: one KV stream per slot, so every slot holds its own ctx_per_slot (as llama-batched-bench runs);
        # -cram 0: no host-RAM prompt cache across requests (the same prompt repeated across trials would otherwise
        # be served from it and flatter TTFT); the slots' own prefix reuse stays, as in production.
        return [str(self.exe), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(s["threads"]), "-tb", str(s["threads"]), "-np", str(s["slots"]), "-c", str(s["ctx_total"]),
                "-b", str(s["n_batch"]), "-ub", str(s["n_batch"]), "-fa", "on" if s["flash_attn"] else "off",
                "-ctk", s["cache_type_k"], "-ctv", s["cache_type_v"], "-ngl", str(s["n_gpu_layers"]),
                "--cont-batching", "-no-kvu", "-cram", "0", "--no-webui", "--metrics"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
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
                                             stdin=subprocess.DEVNULL, **child_options())
                try:
                    self._wait_healthy()
                    log.info("llama-server %s on %s (pid %d)", self.gguf.name, self.url, self.proc.pid)
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
                raise ServerError(f"llama-server exited with status {self.proc.returncode} while starting "
                                  f"({self.gguf.name}); its log ({self.log_path}) ends with:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read() or b"{}").get("status") == "ok":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass                          # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise ServerError(f"llama-server did not become healthy within {self.startup_timeout_s:.0f} s "
                          f"({self.gguf.name}); its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def peak_rss_mb(self) -> float | None:
        """The server's resident high-water mark so far (read while it runs: gone after stop)."""
        from pipeline.memory import status_mb

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


def server_version(exe: Path) -> str:
    """What ``llama-server --version`` prints (its first line), or "" when it prints nothing usable."""
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30, **child_options())
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.lower().startswith("version")), lines[0] if lines else "")


def engine_version(exe: Path) -> str:
    """The server's own version line with the llama-cpp-python release whose vendored llama.cpp it was built from
    (`make llama-tools`): the vendored tree reports a placeholder version ("0.5.0-dev, build 0")."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = f"llama.cpp vendored in llama-cpp-python {version('llama_cpp_python')}"
    except PackageNotFoundError:
        release = "llama.cpp"
    own = server_version(exe)
    return f"{release} ({own})" if own else release


def pids_of(exe: Path) -> list[int]:
    """Live processes running ``exe`` (a test's check that no server outlived its run)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "exe") == str(Path(exe).resolve()):
                    out.append(int(d.name))
            except OSError:
                continue
    return out
