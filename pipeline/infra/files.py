"""Files: atomic writes (a temporary file renamed into place), JSON and JSONL, content hashes, sizes and the
free-space check before a long write."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _default(obj: Any) -> Any:
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dumps(obj: Any, indent: int | None = 2, sort_keys: bool | None = None) -> str:
    """JSON text; keys sorted where it is indented (a file a person reads or diffs), unless ``sort_keys`` says
    otherwise (a document whose key order means something, such as the summary's variants in run order)."""
    sort = indent is not None if sort_keys is None else sort_keys
    return json.dumps(obj, indent=indent, sort_keys=sort, default=_default, ensure_ascii=False)


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=_default).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in blocks; kept per path, size and modification time, so a file hashed
    again unchanged (a task's data, asked for by every variant's stage) is read once."""
    st = Path(path).stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any, sort_keys: bool | None = None) -> None:
    atomic_write_text(path, dumps(obj, sort_keys=sort_keys) + "\n")


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r, indent=None) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def check_free_space(path: Path, need_bytes: float, what: str) -> None:
    """Stop before a long write that cannot fit: names the folder, what is needed and what is free."""
    from pipeline.infra.errors import ConfigError

    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise ConfigError(f"not enough free disk space for {what}: it needs about {need_bytes / 1e9:.2f} GB in "
                          f"{probe}, and {free / 1e9:.2f} GB are free. Free some space or point paths.artifacts "
                          "at a larger disk; everything computed so far is kept")


def dir_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
