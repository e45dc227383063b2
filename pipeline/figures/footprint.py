"""What a model's artifacts weigh on disk and in memory, from its tensor shapes alone (no weights loaded).

An ``Inventory`` is the model's tensors (name, shape) and its architecture facts. From it: the bytes of every
artifact a run writes (a GGUF file of a llama.cpp type, a GPTQ/AWQ packed checkpoint, a dense copy in fp32 or a
half type) and the memory a runtime holds for it (weights as loaded, the KV cache, logits rows). The stage plan
(``pipeline.plan.estimate``) adds the per-stage working sets; this module is the arithmetic, without I/O.

GGUF types follow llama.cpp's choice per tensor (llama-quant.cpp): 1-D tensors and MoE routers stay F32, the
output matrix (or the tied embedding) of a quantized file goes to Q6_K, the K-quant "_M" mixes give some attn_v
and ffn_down matrices more bits, and a row whose length is not a multiple of the type's block falls back to a
32-wide type (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), then to F16. Block and byte sizes come from gguf-py's
``GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20

# dtype names -> bytes per element
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8,
               "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk|h|block)\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]     # torch order: a linear weight is (out, in); rows are the last dimension

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def row(self) -> int:
        return int(self.shape[-1]) if self.shape else 1

    @property
    def layer(self) -> int | None:
        m = _LAYER.search(self.name)
        return int(m.group(1)) if m else None

    @property
    def role(self) -> str:
        """embedding | output | router | norm (1-D) | attn_v | ffn_down | attn_output | linear | other."""
        n = self.name
        if len(self.shape) < 2:
            return "norm"
        if "embed_tokens" in n or n.startswith("token_embd") or ".wte." in n or "word_embeddings" in n:
            return "embedding"
        if n.startswith(("lm_head", "output.")) or ".lm_head." in n:
            return "output"
        if n.endswith((".gate.weight", "ffn_gate_inp.weight")) or ".router." in n:
            return "router"
        if self.layer is None:
            return "other"
        if "v_proj" in n or ".attn_v." in n:
            return "attn_v"
        if "down_proj" in n or ".ffn_down" in n or ".w2." in n:
            return "ffn_down"
        if "o_proj" in n or ".attn_output." in n:
            return "attn_output"
        return "linear"


@dataclass
class Inventory:
    """A model's tensors and facts: layers, hidden_size, attention_heads, kv_heads, head_dim, kv_layout,
    vocab_size, context_length, params, tie_word_embeddings, intermediate_size (prepare.architecture_facts' keys)."""

    tensors: list[Tensor]
    facts: dict
    source: str = ""                  # where the shapes were read: safetensors headers, GGUF metadata, a config
    stored_bytes: int | None = None   # the checkpoint's weights as stored (None: not on disk yet)
    extra_bytes: int = 0              # tokenizer, config and template files beside the weights
    source_file_bytes: int = 0        # a GGUF source's own size (read while it is dequantized)

    @property
    def params(self) -> int:
        return sum(t.elements for t in self.tensors)

    @property
    def has_output(self) -> bool:
        return any(t.role == "output" for t in self.tensors)

    @property
    def largest_tensor(self) -> int:
        return max((t.elements for t in self.tensors), default=0)

    def quantizable(self, t: Tensor) -> bool:
        """A matrix GPTQ/AWQ pack: 2-D or stacked (experts) weights inside the decoder layers, routers excluded."""
        return t.layer is not None and len(t.shape) >= 2 and t.role != "router"


# ------------------------------------------------------------------ GGUF


@functools.lru_cache(maxsize=4)
def ggml_quant_sizes(cache_dir: str = "") -> dict[str, tuple[int, int]]:
    """{ggml type name: (block size, bytes per block)} from the extracted gguf-py (the converter's own, under
    paths.cache), else the installed gguf package."""
    import importlib.util

    for path in sorted(Path(cache_dir).glob("llama-cpp-python-*/gguf-py/gguf/constants.py")) if cache_dir else []:
        spec = importlib.util.spec_from_file_location("_qd_gguf_constants", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)                  # type: ignore[union-attr]
        return {t.name: tuple(v) for t, v in module.GGML_QUANT_SIZES.items()}
    from gguf.constants import GGML_QUANT_SIZES

    return {t.name: tuple(v) for t, v in GGML_QUANT_SIZES.items()}


# llama file type -> the ggml type most of its matrices get (llama_model_quantize_impl's default_type)
FTYPE_BASE = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
              "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K",
              "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K",
              "Q6_K": "Q6_K", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
              "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S", "IQ1_S": "IQ1_S",
              "IQ1_M": "IQ1_M", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0",
              "MXFP4_MOE": "MXFP4"}
# a type whose block does not divide the row -> the 32-wide type llama.cpp writes instead
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL",
            "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL",
            "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}
UNQUANTIZED = ("F32", "F16", "BF16")


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_tensor_type(ftype: str, t: Tensor, inv: Inventory, sizes: dict[str, tuple[int, int]]) -> str:
    """The ggml type llama.cpp writes ``t`` in for a file of type ``ftype`` (converter for F16/BF16/F32)."""
    ftype = ftype.upper()
    if ftype not in FTYPE_BASE:
        from pipeline.infra.errors import ConfigError

        raise ConfigError(f"variant.quantize.type={ftype!r} is not a llama.cpp file type the plan knows: expected "
                          f"one of {', '.join(FTYPE_BASE)}")
    if t.role in ("norm", "router"):
        return "F32"
    base = FTYPE_BASE[ftype]
    if base in UNQUANTIZED:
        return base
    new = base
    n_layers = int(inv.facts.get("layers") or 1)
    i = t.layer or 0
    gqa = (inv.facts.get("attention_heads") or 1) / max(1, inv.facts.get("kv_heads") or 1)
    role = t.role
    if role == "output" or (role == "embedding" and not inv.has_output):
        if t.row % sizes[new][0] != 0:
            new = "Q8_0"
        elif new != "Q8_0":
            new = "Q6_K"
    elif role == "embedding":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            new = "Q2_K"
        elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            new = "Q4_K"
    elif role == "attn_v":
        if ftype == "Q2_K":
            new = "Q4_K" if gqa >= 4 else "Q3_K"
        elif ftype in ("Q3_K_M",):
            new = "Q5_K" if i < 2 else "Q4_K"
        elif ftype in ("Q3_K_L", "IQ3_M") or (ftype in ("IQ4_XS", "IQ4_NL") and gqa >= 4):
            new = "Q5_K" if ftype != "IQ3_M" else "Q4_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n_layers):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            new = "Q5_K"
    elif role == "ffn_down":
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i < n_layers // 16 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n_layers):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < n_layers // 8:
            new = "Q5_K"
    elif role == "attn_output":
        new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new)
    if t.row % sizes[new][0] != 0:
        new = FALLBACK.get(new, "F16")
        if t.row % sizes[new][0] != 0:
            new = "F16"
    return new


def tensor_bytes(t: Tensor, ggml_type: str, sizes: dict[str, tuple[int, int]]) -> int:
    block, size = sizes[ggml_type]
    return t.elements // block * size


# A GGUF's tokenizer and other metadata: token strings, scores and types, and BPE merges. Measured on the embedded
# model's F16 file: 270,885,760 bytes, of which the tensors are 269,027,712 + alignment.
GGUF_METADATA_BYTES_PER_TOKEN = 36
GGUF_ALIGNMENT = 32


def gguf_file(inv: Inventory, ftype: str, sizes: dict[str, tuple[int, int]]) -> dict:
    """{"bytes", "tensor_types": {type: count}, "type_elements": {type: weights}} of the GGUF llama.cpp writes
    for ``ftype``."""
    types: dict[str, int] = {}
    elements: dict[str, int] = {}
    total = 0
    for t in inv.tensors:
        kind = gguf_tensor_type(ftype, t, inv, sizes)
        types[kind] = types.get(kind, 0) + 1
        elements[kind] = elements.get(kind, 0) + t.elements
        total += tensor_bytes(t, kind, sizes) + GGUF_ALIGNMENT // 2
    total += GGUF_METADATA_BYTES_PER_TOKEN * int(inv.facts.get("vocab_size") or 0)
    return {"bytes": total, "tensor_types": dict(sorted(types.items())),
            "type_elements": dict(sorted(elements.items()))}


# ------------------------------------------------------------------ GPTQ / AWQ and dense copies


def packed_bytes(inv: Inventory, bits: int, group_size: int, g_idx: bool, unquantized_dtype: str,
                 scale_bytes: int = 2) -> int:
    """A GPTQ/AWQ checkpoint: every quantizable matrix as ``bits``-bit codes, one scale (fp16) and one packed zero
    point per group of ``group_size`` inputs, and (GPTQ) an int32 group index per input row; everything else
    (embeddings, norms, the head, routers) in ``unquantized_dtype``."""
    total = 0
    for t in inv.tensors:
        if inv.quantizable(t) and t.row % group_size == 0:
            n = t.elements
            groups = n // group_size
            total += n * bits // 8 + groups * scale_bytes + groups * bits // 8
            if g_idx:
                total += 4 * t.row * (t.elements // t.row // int(t.shape[-2])) if len(t.shape) > 2 else 4 * t.row
        else:
            total += t.elements * DTYPE_BYTES[unquantized_dtype]
    return total


def dense_bytes(inv: Inventory, dtype: str) -> int:
    return inv.params * DTYPE_BYTES[dtype]


# ------------------------------------------------------------------ memory of a loaded model


def kv_bytes(facts: dict, element_bytes: float, context_tokens: int, sequences: int = 1,
             latent: bool = False) -> float:
    """KV-cache bytes of ``sequences`` sequences of ``context_tokens`` each (capacity's formula, with the
    architecture's layout: window layers hold at most their window, state layers nothing per token)."""
    from pipeline.figures.capacity import kv_bytes_per_token_formula

    if context_tokens <= 0:
        return 0.0
    return kv_bytes_per_token_formula(facts, element_bytes, context_tokens, latent) * context_tokens * sequences


def logits_bytes(rows: int, vocab: int, copies: int = 1) -> int:
    """Float32 logits rows (a teacher-forced pass keeps one row per position; log-softmax makes copies)."""
    return 4 * int(rows) * int(vocab) * copies


@dataclass
class Footprint:
    """One stage of one variant: disk it writes, peak host and device memory, and its time."""

    stage: str
    variant: str
    disk_bytes: float = 0.0
    host_bytes: float = 0.0
    device_bytes: float = 0.0
    time_s: float | None = None
    time_basis: str = ""
    exists: bool = False             # the stage's output is already on disk: it writes nothing again
    parts: dict = field(default_factory=dict)   # what the memory figure is made of, in bytes
    time_args: dict = field(default_factory=dict)   # what the stage's time scales with (weight kind, bytes, ...)

    def row(self) -> dict:
        return {"stage": self.stage, "variant": self.variant, "disk_mb": self.disk_bytes / MIB,
                "host_mb": self.host_bytes / MIB, "device_mb": self.device_bytes / MIB, "time_s": self.time_s,
                "time_basis": self.time_basis, "exists": self.exists,
                "parts_mb": {k: round(v / MIB, 1) for k, v in self.parts.items()}}
