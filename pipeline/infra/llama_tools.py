"""llama.cpp's own command-line tools (llama-batched-bench, llama-bench, llama-perplexity, llama-server, ...) and the
libraries the pipeline's llama.cpp runtime loads: one build by `make llama-tools` from the llama.cpp source vendored
in llama-cpp-python's sdist, kept outside the project. Cross-checks run the tools on the same files the pipeline
measures, with the same kernels."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.infra.make_paths import make_print


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
        raise ConfigError(f"{name} is not built at {path}: run `make llama-tools` (it builds llama.cpp's tools and "
                          "the libraries the pipeline loads, once per machine)")
    return path


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o jsonl: one dict per test line (n_prompt, n_gen, n_depth, avg_ts, stddev_ts, samples_ts)."""
    import json

    return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{") and '"avg_ts"' in line]


# ---------------------------------------------------------------------------------------------------------------
# one run-time-selected build of llama.cpp for the tools and the pipeline
#
# `make llama-tools` builds llama.cpp as llama.cpp's own releases are built: GGML_BACKEND_DL with
# GGML_CPU_ALL_VARIANTS, one libggml-cpu-VARIANT.so per x86 level (haswell, skylakex, icelake, zen4, ...), of which
# ggml loads the best this CPU advertises. On an AVX-512 EPYC that is 1.1-1.2x decode and 1.2-1.5x prefill over
# an AVX2 baseline build (docs/measurements.md, "The llama.cpp build"). ggml scores a variant by CPUID alone, so
# a machine that advertises what its OS does not grant (AMX on one VM here) would load kernels that die with
# SIGILL: the build runs each chosen variant once and removes the ones that die (prune_cpu_variants). The
# pipeline's llama.cpp runtime then loads the same libraries (use_tool_libraries), so the pipeline and the tools it
# is checked against run the same kernels.

CPU_MODULE = "libggml-cpu-"
_LOADED = re.compile(r"loaded CPU backend from (\S+)")
_library_choice: list[str | None] = []        # decided once per process


def has_selectable_cpu(folder: Path) -> bool:
    """Whether ``folder`` holds llama.cpp's shared libraries with run-time-selected CPU modules."""
    return (folder / "libllama.so").is_file() and any(folder.glob(f"{CPU_MODULE}*.so"))


def use_tool_libraries() -> str | None:
    """Make llama-cpp-python load the libraries of `make llama-tools` (llama.cpp's one build: the run-time-selected
    CPU kernels, CUDA's module where built with it); call before the first ``import llama_cpp``. The bindings are
    installed without libraries of their own (the Makefile's llama-bindings), so these are the ones every process
    loads. Honours a LLAMA_CPP_LIB_PATH the user set. Returns the folder in use, or None where none is known
    (tools not built, or llama_cpp already imported: one process loads one build)."""
    if _library_choice:
        return _library_choice[0]
    choice = os.environ.get("LLAMA_CPP_LIB_PATH") or None
    if choice is None and "llama_cpp" not in sys.modules:
        try:
            folder = tools_dir()
        except ConfigError:
            folder = None
        if folder is not None and (folder / "libllama.so").is_file():
            os.environ["LLAMA_CPP_LIB_PATH"] = choice = str(folder)
    _library_choice.append(choice)
    return choice


def load_llama_cpp():
    """The ``llama_cpp`` module, bound to the tools' libraries (``use_tool_libraries``); every import of llama_cpp
    in the pipeline goes through here. A ConfigError naming `make llama-tools` where no llama.cpp library loads."""
    folder = use_tool_libraries()
    try:
        import llama_cpp
    except (FileNotFoundError, OSError, RuntimeError) as exc:
        where = folder or "the llama-cpp-python package (installed without libraries by `make setup`)"
        raise ConfigError(f"llama.cpp's libraries could not be loaded from {where}: {exc}. Build them with "
                          "`make llama-tools` (llama.cpp's one build: its tools and the libraries the Python bindings "
                          "load), or set LLAMA_CPP_LIB_PATH to a folder holding libllama.so") from None
    return llama_cpp


def prune_cpu_variants(folder: Path, gguf: Path, timeout_s: float = 300) -> dict:
    """Run ``folder``'s llama-bench once on ``gguf`` (a prompt batch and a few decode steps); while it dies of a
    signal (SIGILL: kernels the CPU advertises but the OS does not grant), delete the CPU module it loaded and run
    again, so ggml's pick falls to the next variant. Returns the variant that ran and the ones removed; raises
    RuntimeError with the tool's output when no variant runs or the tool fails otherwise."""
    import subprocess

    folder = Path(folder)
    removed = []
    while True:
        cmd = [str(folder / "llama-bench"), "-m", str(gguf), "-p", "32", "-n", "4", "-r", "1", "-t", "1", "-o", "jsonl"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        found = _LOADED.findall(proc.stderr + proc.stdout)
        module = Path(found[-1]).name if found else None
        variant = module and module.removeprefix(CPU_MODULE).removesuffix(".so")
        if proc.returncode == 0 and module:
            return {"variant": variant, "removed": removed}
        if proc.returncode < 0 and module and (folder / module).is_file():
            (folder / module).unlink()
            removed.append(variant)
            continue
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"llama-bench with the CPU modules of {folder} failed (exit {proc.returncode}, loaded "
                           f"{module}, removed {removed}): {' '.join(cmd)}\n{tail}")
