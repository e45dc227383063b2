"""An integer KV cache for the hf runtime: transformers' KIVI-style ``QuantizedLayer`` with a uint8 backend.

Why a subclass and not ``cache_implementation="quantized"``: the quanto backend allows only 2 and 4 bits, and the
HQQ backend adds a dependency whose storage layout we cannot inspect or measure. Here the stored bytes are plain
uint8 tensors (plus fp16 scales and zero points), so the memory the runtime reports is the memory it holds, and
the bit width is a config value (``kv_cache.bits``: 8 or 4).

Layout (the KIVI recipe): keys are quantized per channel (min/max over tokens: outlier channels get their own
scale), values per token (min/max over channels), asymmetric, round-to-nearest. The newest ``residual_length``
tokens stay in full precision; when the window fills, transformers' ``QuantizedLayer.update`` re-quantizes the
whole cache with the window folded in.

Batched decoding (several left-padded sequences, ``IntKVLayer.pads``): the padded positions are masked out of
attention but would enter a row's per-channel key ranges, so before each quantization they take the row's first
real key (ranges unchanged). A row's folds then see exactly the real tokens one sequence at a time would (the
cache's padded length and the row's own length differ by its padding, the same at every step), and a row that
leaves the batch goes through transformers' own deferred reorder of the quantized store.
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
        self.pads: torch.Tensor | None = None     # left padding of each batch row (batched decoding)

    def _quantize(self, tensor, axis):
        if self.pads is not None and axis == -2 and int(self.pads.max()) > 0:
            tensor = fill_pads(tensor, self.pads)
        return quantize(tensor, axis, self.nbits)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.pads is not None:
            self.pads = self.pads.index_select(0, beam_idx.to(self.pads.device))
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only these batch rows: the quantized store is selected on its next dequantization (transformers'
        deferred reorder), the full-precision window and the padding at once."""
        self.reorder_cache(torch.as_tensor(indices, dtype=torch.long))

    def _dequantize(self, q_tensor):
        return dequantize(q_tensor)


def fill_pads(x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, heads, tokens, dim) with each row's first ``pads[row]`` positions replaced by its first real
    position, so that a min/max over tokens sees the real tokens only."""
    t = x.shape[-2]
    idx = torch.maximum(torch.arange(t, device=x.device)[None, :], pads.to(x.device)[:, None]).clamp_(max=t - 1)
    return x.gather(-2, idx[:, None, :, None].expand(x.shape[0], x.shape[1], t, x.shape[3]))


def new_cache(n_layers: int, bits: int, residual_length: int, pads: torch.Tensor | None = None) -> Cache:
    """A fresh cache (``generate`` never resets a cache object it is given: build one per sequence); ``pads``: the
    left padding of each row of a batch."""
    layers = [IntKVLayer(bits, residual_length) for _ in range(n_layers)]
    for layer in layers:
        layer.pads = pads
    return Cache(layers=layers)


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
