"""What the Makefile names: the cache layout (llama.cpp's tools, llm-compressor's environment) belongs to the
Makefile, and the pipeline asks it rather than repeating the paths."""

from __future__ import annotations

import subprocess
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]     # a leaf module: no import of pipeline.config


def make_print(target: str) -> str:
    """The last line `make -s TARGET` prints in the project ("" when make is missing or the target fails)."""
    try:
        out = subprocess.run(["make", "-s", "--no-print-directory", target], cwd=PROJECT_ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""


def vocab_dir(cache_dir: Path | None = None) -> Path:
    """llama.cpp's vocab files and chat templates as `make chat-templates` unpacks them (the version
    llama-cpp-python vendors)."""
    from importlib import metadata

    version = metadata.version("llama-cpp-python")
    return Path(cache_dir or PROJECT_ROOT / ".cache") / f"llama-cpp-python-{version}" / "models"
