"""What a GGUF file holds (a leaf module, read by the prepare, reference, plan and report code as well as the
quantizer): its tensors and their types, one metadata value, and the tensors a K-quant recipe left in a fallback
type.

The header is read here directly (GGUF's layout: magic, version, counts, key/value fields, tensor infos) instead
of through gguf-py's GGUFReader, which builds a numpy view for every element of every array field: on a 128k
vocabulary (the token strings, scores, types and 280k merges) that took 13-20 s of CPU per file read, a fixed
cost paid twice by every GGUF quantization. Array fields are stepped over unless asked for."""

from __future__ import annotations

import logging
import math
import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file as its header describes it; ``shape`` in ggml order (the row length first);
    ``n_bytes`` None for a type this gguf package does not know."""

    name: str
    shape: tuple[int, ...]
    type: str
    n_elements: int
    n_bytes: int | None


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict            # key -> value; an array field not asked for -> None
    tensors: list[TensorInfo]


def read_header(path: Path, arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """The key/value fields and tensor infos of a GGUF file (version 2 or 3, either byte order), the values of
    the array fields named in ``arrays`` decoded, every other array stepped over."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file: it starts with {bytes(mm[:4])!r}, expected b'GGUF'")
        order = "<"
        (version,) = struct.unpack_from("<I", mm, 4)
        if version & 0xFFFF == 0:           # written on a big-endian machine
            order, version = ">", struct.unpack_from(">I", mm, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here: expected version 2 or 3")
        n_tensors, n_fields = struct.unpack_from(order + "QQ", mm, 8)
        off = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from(order + "Q", mm, at)
            return mm[at + 8:at + 8 + n].decode("utf-8", errors="replace"), at + 8 + n

        def value(kind: int, at: int, keep: bool):
            if kind in _SCALARS:
                fmt = order + _SCALARS[kind]
                return struct.unpack_from(fmt, mm, at)[0], at + struct.calcsize(fmt)
            if kind == _STRING:
                return string(at)
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown GGUF value type {kind} at byte {at}")
            item, count = struct.unpack_from(order + "IQ", mm, at)
            at += 12
            if item in _SCALARS and not keep:
                return None, at + count * struct.calcsize(order + _SCALARS[item])
            if item in _SCALARS:
                fmt = order + _SCALARS[item]
                size = struct.calcsize(fmt)
                return [v for (v,) in struct.iter_unpack(fmt, mm[at:at + count * size])], at + count * size
            out = [] if keep else None
            for _ in range(count):
                v, at = value(item, at, keep)
                if keep:
                    out.append(v)
            return out, at

        fields = {}
        for _ in range(n_fields):
            key, off = string(off)
            (kind,) = struct.unpack_from(order + "I", mm, off)
            fields[key], off = value(kind, off + 4, key in arrays)
        tensors = []
        for _ in range(n_tensors):
            name, off = string(off)
            (n_dims,) = struct.unpack_from(order + "I", mm, off)
            shape = struct.unpack_from(order + "Q" * n_dims, mm, off + 4)
            off += 4 + 8 * n_dims
            type_id, _offset = struct.unpack_from(order + "IQ", mm, off)
            off += 12
            n = math.prod(shape)
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                tensors.append(TensorInfo(name, tuple(shape), f"TYPE_{type_id}", n, None))
                continue
            block, size = GGML_QUANT_SIZES[qtype]
            tensors.append(TensorInfo(name, tuple(shape), qtype.name, n, n * size // block))
    return GGUFHeader(fields, tensors)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file really holds (K-quant names are a recipe, not a promise)."""
    return dict(sorted(Counter(t.type for t in read_header(path).tensors).items()))


def type_elements(path: Path) -> dict[str, int]:
    """How many weights the file holds in each ggml type (what llama-quantize spent its time on, type by type)."""
    out: Counter = Counter()
    for t in read_header(path).tensors:
        out[t.type] += t.n_elements
    return dict(sorted(out.items()))


def gguf_metadata(path: Path, key: str):
    """One metadata value of a GGUF file (a string, number or list), or None when the file lacks it."""
    return read_header(path, arrays=(key,)).fields.get(key)


LEGACY_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}   # 32-wide blocks: llama.cpp's fallbacks


def fallback_tensors(gguf_type: str, tensor_types: dict[str, int]) -> dict[str, int]:
    """Tensors of a K or IQ file that llama.cpp wrote in a 32-wide legacy type instead (their rows are not a
    multiple of the 256-wide super-block), by type; empty for other files."""
    k_family = "_K" in gguf_type or (gguf_type.startswith("IQ") and gguf_type != "IQ4_NL")
    return {t: n for t, n in (tensor_types or {}).items() if t in LEGACY_TYPES} if k_family else {}
