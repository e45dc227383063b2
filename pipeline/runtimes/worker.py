"""A runtime in a process of its own: llama.cpp never shares a process with torch.

llama.cpp's CUDA backend and torch's CUDA runtime (each with its own CUDA runtime and cuBLAS) in one process is the
suspected cause of a SIGSEGV at llama.cpp's first CUDA model load in a pipeline process that had imported torch.
``pipeline.runtimes.load_runtime`` therefore loads a runtime class that sets ``own_process`` (llama.cpp's) in a
``WorkerRuntime`` wherever the calling process has imported torch: a fresh interpreter
(``python -m pipeline.runtimes.worker FD``) that imports the runtime's module alone (no torch: the worker refuses to
load when torch is in its modules) and answers the caller's method calls over a socket pair. The same path runs on
the CPU, where it is tested, and on CUDA.

The proxy answers as the runtime does: classmethods from the class itself, methods and attributes (``info``,
``choice``, ``n_ctx`` ...) from the worker, a method's generator (``logprob_blocks``) block by block. An exception
in the worker is raised again in the caller (its type kept where it pickles); a worker that dies (a signal, an
abort inside llama.cpp) is a RuntimeError naming how it ended. ``close`` stops the worker; the parent-death signal
and a finalizer stop it on every other exit path.
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection

_MISSING = object()


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    """Ask the worker to end, then make sure it has."""
    try:
        if proc.poll() is None:
            conn.send(("close",))
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        conn.close()
    except OSError:
        pass


def _ended(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _map_file(filename: str, dtype: str, shape: tuple, offset: int, order: str):
    """A read-only memory map of ``filename``, as ``_reduce_memmap`` describes it."""
    import numpy as np

    return np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=shape, offset=offset, order=order)


def _reduce_memmap(a):
    """A read-only memory map of a whole array in a file travels as the file's name, shape and offset, and the other
    side maps the file itself: a conversation's exact rows (hundreds of MB at a large vocabulary) are otherwise
    pickled, copied through the socket and held in both processes. A view into a map, or a writable map, is sent
    as numpy pickles it (its values)."""
    if a.mode == "r" and a.filename and a.base is getattr(a, "_mmap", None) and (
            a.flags.c_contiguous or a.flags.f_contiguous):
        order = "C" if a.flags.c_contiguous else "F"
        return _map_file, (a.filename, a.dtype.str, a.shape, int(a.offset), order)
    return a.__reduce__()


def _send_maps_by_name() -> None:
    """Have this process's sends (``multiprocessing.connection``'s pickler) carry read-only maps by name."""
    import numpy as np
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(np.memmap, _reduce_memmap)


class WorkerRuntime:
    """``cls(*args)`` loaded in a worker process; see the module docstring."""

    def __init__(self, cls: type, *args):
        from pipeline.infra.child_processes import child_options

        _send_maps_by_name()
        self._cls = cls
        parent, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "pipeline.runtimes.worker", str(child.fileno())],
                                          pass_fds=[child.fileno()], **child_options())
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        try:
            self.process = self._request(("init", cls.__module__, cls.__qualname__, args), "loading the runtime")
        except BaseException:
            self._finalizer()                      # no runtime to close: stop the worker
            raise

    # ------------------------------------------------------------------ the protocol
    def _request(self, message: tuple, what: str):
        try:
            self._conn.send(message)
            reply = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            how = _ended(self._proc)
            self._finalizer()
            raise RuntimeError(f"the {self._cls.__name__} worker process (pid {self._proc.pid}) {how} while "
                               f"{what}; its own output is above") from None
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "stream":
            return self._iterate(reply[1], what)
        if reply[0] == "end":
            raise StopIteration
        _, exc, text = reply
        if exc is None:
            raise RuntimeError(f"{self._cls.__name__} worker, while {what}:\n{text}")
        exc.add_note(f"raised in the {self._cls.__name__} worker process (pid {self._proc.pid}):\n{text}")
        raise exc

    def _call(self, name: str):
        def call(*args, **kwargs):
            return self._request(("call", name, args, kwargs), f"running {name}")
        call.__name__ = name
        return call

    def _iterate(self, sid: int, what: str):
        """The items of an iterator the worker holds (a method's generator), one request each."""
        done = False
        try:
            while True:
                try:
                    item = self._request(("next", sid), what)
                except StopIteration:
                    done = True
                    return
                yield item
        finally:
            if not done and self._proc.poll() is None:
                self._request(("drop", sid), what)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_cls", "_proc", "_conn", "_finalizer", "process"):
            raise AttributeError(name)
        static = inspect.getattr_static(self._cls, name, _MISSING)
        if isinstance(static, (classmethod, staticmethod)):
            return getattr(self._cls, name)
        if inspect.isfunction(static):
            return self._call(name)
        # anything else is read where the runtime lives: an instance attribute may shadow a class default
        # (``choice``: the class's plain greedy, the instance's from runtime.repeat_*)
        return self._request(("get", name), f"reading {name}")

    def close(self) -> None:
        """Close the runtime in the worker and stop the worker; its ``info`` stays readable, as an in-process
        runtime's does after close."""
        if self._finalizer.alive:
            try:
                if self._proc.poll() is None:
                    self.__dict__["info"] = self._request(("get", "info"), "reading info")
                    self._request(("call", "close", (), {}), "closing the runtime")
            finally:
                self._finalizer()


# ---------------------------------------------------------------------------------------------------------------
# the worker's side


def _reply_error(conn: Connection, exc: BaseException) -> None:
    """The exception itself where it survives pickling both ways (its type is what callers catch: ConfigError,
    Skip), else its text."""
    import pickle

    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:                                     # noqa: BLE001 - any failure: send the text instead
        exc = None
    conn.send(("error", exc, text))


def serve(conn: Connection) -> None:
    """Answer one caller until it says close or goes away."""
    import importlib

    runtime = None
    streams: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "close":
            return
        try:
            if kind == "init":
                if "torch" in sys.modules:
                    raise RuntimeError("torch was imported in the runtime worker before its runtime loaded")
                module, qualname, args = message[1:]
                cls = getattr(importlib.import_module(module), qualname)
                runtime = cls(*args)
                result = {"pid": os.getpid(), "torch_loaded": "torch" in sys.modules}
            elif kind == "call":
                result = getattr(runtime, message[1])(*message[2], **message[3])
                if isinstance(result, Iterator):              # a generator: its items on request
                    sid = max(streams, default=0) + 1
                    streams[sid] = result
                    conn.send(("stream", sid))
                    continue
            elif kind == "get":
                result = getattr(runtime, message[1])
            elif kind == "next":
                try:
                    result = next(streams[message[1]])
                except StopIteration:
                    streams.pop(message[1], None)
                    conn.send(("end",))
                    continue
            elif kind == "drop":
                gen = streams.pop(message[1], None)
                if hasattr(gen, "close"):
                    gen.close()
                result = None
            else:
                raise ValueError(f"unknown request {kind!r}")
        except BaseException as exc:            # noqa: BLE001 - every failure goes back to the caller
            _reply_error(conn, exc)
            continue
        try:
            conn.send(("ok", result))
        except Exception as exc:                 # noqa: BLE001 - a result that does not pickle
            _reply_error(conn, TypeError(f"{message[:2]!r} returned what cannot be sent back: {exc}"))


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
