"""llama.cpp's own command-line tools (llama-batched-bench, llama-bench, llama-perplexity, llama-server, ...), built
by `make llama-tools` from the same vendored llama.cpp source as the llama-cpp-python wheel and kept outside the
project. Cross-checks run them on the same files the pipeline measures."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.makefile import make_print


def tools_dir(configured: str = "") -> Path:
    """The folder holding the built tools: ``configured`` (bench.llama_tools), else $QUANTDRIFT_LLAMA_TOOLS, else
    what `make print-llama-tools` names (the Makefile owns the cache layout)."""
    folder = configured or os.environ.get("QUANTDRIFT_LLAMA_TOOLS", "") or make_print("print-llama-tools")
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
