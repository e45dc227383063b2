"""Stages on disk: manifests, stage caching, item-level resume, locks.

A stage writes its outputs into ``<dir>.tmp-<pid>`` and renames it into place; the manifest is the last file
written, so a directory without a manifest (or with one whose hash differs) is never taken as complete.
Long stages also keep a per-item journal (one JSON line per finished item) so an interrupted run resumes
where it stopped instead of from the start of the stage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.infra.cpus import usable_cpus
from pipeline.infra.files import dumps, read_json, stable_hash, write_json
from pipeline.infra.stage_memory import StagePeak

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# when this invocation began: ``quantdrift`` sets it once, and its variant jobs and child processes inherit it, so
# that force=true redoes each stage once per invocation, not once per variant job that passes through it
INVOCATION_ENV = "QUANTDRIFT_INVOCATION_START"


def invocation_start() -> float:
    """The invocation's start (``INVOCATION_ENV``); without it (the pipeline called in-process, as the tests do)
    infinity: force=true then redoes every stage it reaches."""
    try:
        return float(os.environ[INVOCATION_ENV])
    except (KeyError, ValueError):
        return float("inf")


def library_versions() -> dict[str, str]:
    from importlib import metadata

    from pipeline.infra.backends import libraries

    out = {"python": platform.python_version()}
    # the pipeline's own numerics, then every backend's, as each backend's registry line declares them
    for dist in ["numpy", "sacrebleu"] + libraries():
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


# the instruction-set features a build depends on: the Makefile keys its wheel and tool caches by the same list
ISA_FEATURES = re.compile(r"sse4_2|avx|avx2|fma|f16c|bmi2|avx_vnni|avx512[a-z0-9_]*|amx[a-z0-9_]*")


def cpu_features(cpuinfo: str) -> list[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if ISA_FEATURES.fullmatch(f))
    return []


def cpu_key(features: list[str]) -> str:
    """The Makefile's CPU_KEY: the first 8 hex digits of the SHA-1 of the sorted features, space-terminated."""
    return hashlib.sha1("".join(f + " " for f in features).encode()).hexdigest()[:8]


def hardware() -> dict[str, Any]:
    """What tells two machines apart: CPU model and instruction set, cores, memory (the bandwidth probe's figure
    sits beside this record in the summary)."""
    cpu, cpuinfo, memory_gib = platform.processor() or platform.machine(), "", None
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    features = cpu_features(cpuinfo)
    return {"cpu": cpu, "cores": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
            "cpu_features": features, "cpu_key": cpu_key(features) if features else None, "memory_gib": memory_gib,
            "usable_cpus": usable_cpus()}


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = -1) -> Iterator[None]:
    """An inter-process lock beside ``path`` so concurrent jobs never build the same output twice."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_name(path.name + ".lock")), timeout=timeout_s):
        yield


def load_manifest(out_dir: Path) -> dict | None:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except (OSError, json.JSONDecodeError):
        return None


def run_stage(stage: str, out_dir: Path, key: dict, build: Callable[[Path], dict | None], force: bool = False) -> dict:
    """Run ``build(tmp_dir)`` unless ``out_dir`` already holds a manifest for the same ``key``; with ``force``,
    unless that manifest was written during this invocation (``invocation_start``: a forced multirun rebuilt the
    shared reference, parity and exact rows once in every variant job, and timed each scoring with rows it then
    rebuilt).

    ``build`` writes its files into the temporary directory it is given and returns extra manifest fields
    (e.g. facts about the output). Returns the manifest. Upstream manifests' hashes belong in ``key``.
    """
    out_dir = Path(out_dir)
    key_hash = stable_hash(key)
    with locked(out_dir):
        existing = load_manifest(out_dir)
        if existing and existing.get("key_hash") == key_hash and (
                not force or float(existing.get("created_unix") or 0) >= invocation_start()):
            damaged = _damaged_files(out_dir, existing.get("files"))
            if not damaged:
                log.info("%s: up to date (%s), skipped", stage, out_dir)
                return existing
            log.warning("%s: %s changed on disk since it was built (truncated or deleted?): rebuilding %s",
                        stage, ", ".join(damaged[:3]), out_dir)
        # Leftovers of a killed attempt (we hold the stage's lock, so nobody else is writing them).
        for stale in list(out_dir.parent.glob(f"{out_dir.name}.tmp-*")) + list(out_dir.parent.glob(f"{out_dir.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        # Work files of an interrupted attempt live beside the output and are handed to the next attempt.
        journal_dir = journal_path(out_dir)
        journal_dir.mkdir(parents=True, exist_ok=True)
        log.info("%s: building %s", stage, out_dir)
        started = time.time()
        with StagePeak() as peak:
            extra = build(tmp) or {}
        manifest = {
            "stage": stage,
            "key_hash": key_hash,
            "key": key,
            "created_unix": time.time(),
            "wall_s": round(time.time() - started, 3),
            "versions": library_versions(),
            "hardware": hardware(),
            "host_memory": peak.record(),
            **extra,
        }
        manifest["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_json(tmp / MANIFEST, manifest)
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(journal_dir, ignore_errors=True)
        return manifest


def _damaged_files(out_dir: Path, files: dict | None) -> list[str]:
    """Files the manifest recorded that are now missing or of another size (a manifest written before sizes
    were recorded is trusted)."""
    bad = []
    for rel, size in (files or {}).items():
        p = out_dir / rel
        if not p.is_file() or p.stat().st_size != size:
            bad.append(rel)
    return bad


def journal_path(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(f"{out_dir.name}.partial")


class Journal:
    """Append-only record of finished items of a stage, keyed by the stage's key hash.

    Each line is ``{"key": key_hash, "item": item_id, "value": ...}``. On resume, lines with another key hash
    (a changed config) are ignored, and a torn last line (a kill mid-write) is dropped.
    """

    def __init__(self, out_dir: Path, name: str, key: dict):
        self.path = journal_path(out_dir) / f"{name}.jsonl"
        self.key_hash = stable_hash(key)
        self.done: dict[str, Any] = {}
        if self.path.is_file():
            self._drop_torn_tail()
            with open(self.path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if row.get("key") == self.key_hash:
                        self.done[row["item"]] = row["value"]
        if self.done:
            log.info("resuming %s: %d item(s) already done", self.path.parent.name, len(self.done))

    def _drop_torn_tail(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as fh:
                fh.truncate(data.rfind(b"\n") + 1)

    def __contains__(self, item: str) -> bool:
        return item in self.done

    def get(self, item: str) -> Any:
        return self.done[item]

    def add(self, item: str, value: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = dumps({"key": self.key_hash, "item": item, "value": value}, indent=None) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        self.done[item] = value
