"""Seconds per weight of llama.cpp's quantization of each ggml type on this CPU: the short calibration the planner
carries a GGUF quantization's time with.

llama-quantize reads the F16 file, quantizes each tensor to its ggml type and writes it, and a type's cost per
weight varies 60-fold: Q8_0 and Q4_0 round each block once, the K-quants search every super-block's scales and
IQ4_NL its non-linear grid (the measured costs: docs/plan.md, "The planner's constants and their sources"). A small
model's K-quant file is mostly 32-wide fallbacks (rows not a multiple of 256), so its quantization says little about
a larger model's by the parameters alone. This times ``ggml_quantize_chunk`` (the function llama-quantize calls per
tensor, from the same build's ggml) on a random float32 matrix for each type, once per process: well under a second
for the types of one plan.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import time
from pathlib import Path

from pipeline.figures.footprint import UNQUANTIZED     # stored as they come: no quantization cost of their own

log = logging.getLogger(__name__)

# the matrix timed: 128 rows of 2048 (a multiple of every block size), best of _REPEATS
_ROWS, _ROW = 128, 2048
_REPEATS = 3


def _library(tools: str = "") -> Path | None:
    """libggml-base of llama.cpp's tools (``tools``, else LLAMA_CPP_LIB_PATH, else `make llama-tools`' folder), else
    one inside the llama_cpp package (a wheel built with its own libraries); None if none."""
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.llama_tools import tools_dir

    folders = [Path(tools)] if tools else []
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        folders.append(Path(os.environ["LLAMA_CPP_LIB_PATH"]))
    try:
        folders.append(tools_dir())
    except ConfigError:
        pass
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        folders += [Path(p) / "lib" for p in spec.submodule_search_locations]
    return next((f / "libggml-base.so" for f in folders if (f / "libggml-base.so").is_file()), None)


def type_ids() -> dict[str, int]:
    from gguf.constants import GGMLQuantizationType

    return {t.name: int(t.value) for t in GGMLQuantizationType}


@functools.lru_cache(maxsize=4)
def ggml_library(tools: str = ""):
    """The ctypes handle of libggml-base (``_library``) with the quantization entry points declared; None if absent."""
    lib_path = _library(tools)
    if lib_path is None:
        return None
    lib = ctypes.CDLL(str(lib_path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize_rows(lib, type_id: int, x, imatrix=None):
    """``x`` (rows, row length; float32, C-contiguous) in ggml type ``type_id`` as ggml stores it: uint8 of shape
    (rows, bytes per row)."""
    import numpy as np

    rows, row = x.shape
    lib.ggml_quantize_init(type_id)
    size = lib.ggml_row_size(type_id, row)
    dst = np.empty((rows, size), dtype=np.uint8)
    lib.ggml_quantize_chunk(type_id, x.ctypes.data, dst.ctypes.data, 0, rows, row,
                            None if imatrix is None else imatrix.ctypes.data)
    return dst


@functools.lru_cache(maxsize=8)
def seconds_per_weight(types: tuple[str, ...], tools: str = "") -> dict[str, float] | None:
    """{type: seconds to quantize one weight on one thread} for ``types`` (an unquantized type: 0); None when no
    ggml library is here or a type is not one this gguf package knows."""
    import numpy as np

    lib, ids = ggml_library(tools), type_ids()
    if lib is None or any(t not in ids for t in types if t not in UNQUANTIZED):
        return None
    x = np.random.default_rng(0).standard_normal((_ROWS, _ROW)).astype(np.float32) * 0.02
    out = {}
    for name in types:
        if name in UNQUANTIZED:
            out[name] = 0.0
            continue
        t = ids[name]
        if lib.ggml_quantize_requires_imatrix(t):     # never quantized without one: nothing to time it on
            return None
        best = float("inf")
        for _ in range(_REPEATS):
            start = time.perf_counter()
            quantize_rows(lib, t, x)
            best = min(best, time.perf_counter() - start)
        out[name] = best / (_ROWS * _ROW)
    log.debug("quantization seconds per weight here: %s", out)
    return out
