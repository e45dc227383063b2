"""llama.cpp's own command-line tools (llama-batched-bench, llama-bench, llama-perplexity, llama-server, ...), built
by `make llama-tools` from the same vendored llama.cpp source as the llama-cpp-python wheel and kept outside the
project. Cross-checks run them on the same files the pipeline measures."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pipeline.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]     # not pipeline.config's: this module is a leaf (quantizers use it)


def tools_dir(configured: str = "") -> Path:
    """The folder holding the built tools: ``configured`` (bench.llama_tools), else $QUANTDRIFT_LLAMA_TOOLS, else
    what `make print-llama-tools` names (the Makefile owns the cache layout)."""
    folder = configured or os.environ.get("QUANTDRIFT_LLAMA_TOOLS", "")
    if not folder:
        try:
            out = subprocess.run(["make", "-s", "--no-print-directory", "print-llama-tools"], cwd=PROJECT_ROOT,
                                 capture_output=True, text=True, timeout=60)
            folder = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            folder = ""
    if not folder:
        raise ConfigError("cannot locate llama.cpp's tools: set bench.llama_tools=FOLDER or run `make llama-tools`")
    return Path(folder)


def tool(name: str, configured: str = "") -> Path:
    """The path of llama.cpp tool ``name``; a clear error naming `make llama-tools` when it is not built."""
    path = tools_dir(configured) / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(f"{name} is not built at {path}: run `make llama-tools` (it builds llama.cpp's tools from "
                          "the same vendored source as the wheel, once per machine)")
    return path
