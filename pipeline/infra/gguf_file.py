"""What a GGUF file holds (a leaf module, read by the prepare, reference and report code as well as the
quantizer): its tensor types, one metadata value, and the tensors a K-quant recipe left in a fallback type."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file really holds (K-quant names are a recipe, not a promise)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))


def gguf_metadata(path: Path, key: str):
    """One metadata value of a GGUF file (a string, number or list), or None when the file lacks it."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(key)
    return field.contents() if field is not None else None


LEGACY_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}   # 32-wide blocks: llama.cpp's fallbacks


def fallback_tensors(gguf_type: str, tensor_types: dict[str, int]) -> dict[str, int]:
    """Tensors of a K or IQ file that llama.cpp wrote in a 32-wide legacy type instead (their rows are not a
    multiple of the 256-wide super-block), by type; empty for other files."""
    k_family = "_K" in gguf_type or (gguf_type.startswith("IQ") and gguf_type != "IQ4_NL")
    return {t: n for t, n in (tensor_types or {}).items() if t in LEGACY_TYPES} if k_family else {}
