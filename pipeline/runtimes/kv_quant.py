"""An integer KV cache for the hf runtime: transformers' KIVI-style ``QuantizedLayer`` with a uint8 backend.

Why a subclass and not ``cache_implementation="quantized"``: the quanto backend allows only 2 and 4 bits, and the
HQQ backend adds a dependency whose storage layout we cannot inspect or measure. Here the stored bytes are plain
uint8 tensors (plus fp16 scales and zero points), so the memory the runtime reports is the memory it holds, and
the bit width is a config value (``kv_cache.bits``: 8 or 4).

Layout (the KIVI recipe): keys are quantized per channel (min/max over tokens: outlier channels get their own
scale), values per token (min/max over channels), asymmetric, round-to-nearest. The newest ``residual_length``
tokens stay in full precision; when the window fills, transformers' ``QuantizedLayer.update`` re-quantizes the
whole cache with the window folded in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, QuantizedLayer

_FP16_MIN_NORMAL = 6.2e-5


@dataclass
class QTensor:
    data: torch.Tensor       # uint8; two 4-bit codes per byte when bits == 4
    scale: torch.Tensor      # fp16, broadcastable to the original shape
    zero: torch.Tensor       # fp16 (the minimum), same shape as scale
    shape: tuple
    dtype: torch.dtype
    bits: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))

    @property
    def tokens(self) -> int:
        return int(self.shape[-2])


def quantize(tensor: torch.Tensor, reduce_dim: int, bits: int) -> QTensor:
    """Asymmetric round-to-nearest with min/max taken over ``reduce_dim``; scales stored (and used) in fp16."""
    levels = 2 ** bits - 1
    x = tensor.float()
    lo = x.amin(dim=reduce_dim, keepdim=True).half()
    scale = ((x.amax(dim=reduce_dim, keepdim=True) - lo.float()) / levels).clamp(min=_FP16_MIN_NORMAL).half()
    q = torch.round((x - lo.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        if q.shape[-1] % 2:
            raise ValueError(f"4-bit KV packing needs an even head dimension, got {q.shape[-1]}")
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return QTensor(q, scale, lo, tuple(tensor.shape), tensor.dtype, bits)


def dequantize(qt: QTensor) -> torch.Tensor:
    q = qt.data
    if qt.bits == 4:
        q = torch.stack((q & 0xF, q >> 4), dim=-1).reshape(qt.shape)
    return (q.float() * qt.scale.float() + qt.zero.float()).to(qt.dtype)


class IntKVLayer(QuantizedLayer):
    """One attention layer's cache; keys per channel (reduce over tokens), values per token (reduce over
    channels). Tensors are (batch, kv_heads, tokens, head_dim)."""

    def __init__(self, bits: int = 8, residual_length: int = 16):
        super().__init__(nbits=bits, axis_key=-2, axis_value=-1, residual_length=residual_length)

    def _quantize(self, tensor, axis):
        return quantize(tensor, axis, self.nbits)

    def _dequantize(self, q_tensor):
        return dequantize(q_tensor)


def new_cache(n_layers: int, bits: int, residual_length: int) -> Cache:
    """A fresh cache (``generate`` never resets a cache object it is given: build one per sequence)."""
    return Cache(layers=[IntKVLayer(bits, residual_length) for _ in range(n_layers)])


def cache_bytes(cache: Cache) -> dict:
    """Bytes the cache holds: the quantized store (codes + scales + zero points) per quantized token, and the
    full-precision residual window separately (a fixed few tokens, so it is not a per-token cost)."""
    q_bytes = q_tokens = r_bytes = r_tokens = 0
    for layer in cache.layers:
        for qt in (layer._quantized_keys, layer._quantized_values):
            if isinstance(qt, QTensor):
                q_bytes += qt.nbytes
        if isinstance(layer._quantized_keys, QTensor):
            q_tokens = max(q_tokens, layer._quantized_keys.tokens)
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                r_bytes += t.numel() * t.element_size()
                r_tokens = max(r_tokens, t.shape[-2])
    return {"bytes": int(q_bytes), "tokens": int(q_tokens), "residual_bytes": int(r_bytes),
            "residual_tokens": int(r_tokens), "source": "uint8 cache tensors (codes + fp16 scales/zero points)"}
