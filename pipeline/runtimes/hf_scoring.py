"""The transformers runtime's teacher-forced scoring (``HFScoring``, a part of ``HFRuntime``): the logits at given
positions of a token sequence, streamed a block of rows at a time. The model body runs once and the model's own
head runs on a few hidden states at a time, so no (positions, vocab) tensor exists at once; with the integer KV
cache, the sequence is fed through the cache in chunks as decoding sees it. Versioned with the runtime's own module
in the keys of the stages that use it (``pipeline.runtimes.runtime_code``)."""

from __future__ import annotations

import functools
import logging
from typing import Iterator, Sequence

import numpy as np

from pipeline.runtimes.base import as_blocks, block_rows, in_position_order

log = logging.getLogger(__name__)


def _inference_mode(fn):
    """torch.inference_mode() without importing torch when this module is (the config validates settings)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapper


class HFScoring:
    """``logit_blocks`` for ``HFRuntime``, on the attributes it sets when it loads: ``model``, ``device``,
    ``dtype``, ``kv`` (the integer KV cache's settings or None) and ``_new_cache()``."""

    def logit_blocks(self, ids: Sequence[int], positions: Sequence[int]) -> Iterator[np.ndarray]:
        """One pass of the model body over ``ids`` (its hidden states, positions x hidden, are all it keeps), then
        the model's own head (the LM head and whatever the model applies after it: scaling, soft-capping) on
        ``block_rows`` positions at a time: no (positions, vocab) tensor exists at once. With the integer KV
        cache, the cache's scored chunks (``_blocks_through_cache``)."""
        ids, positions = [int(t) for t in ids], [int(p) for p in positions]
        if self.kv:
            yield from in_position_order(positions, lambda wanted: self._blocks_through_cache(ids, wanted))
            return
        if not positions:
            return
        hidden = self._hidden_states(ids)
        step = block_rows(self._vocab())
        if hidden is None:       # the model's forward does not call its body by name: one whole pass instead
            yield from as_blocks(self._whole_logits(ids, positions))
            return
        for start in range(0, len(positions), step):
            yield self._head(hidden, positions[start:start + step])

    def _vocab(self) -> int:
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return int(weight.shape[0]) if weight is not None else int(self.model.config.get_text_config().vocab_size)

    def _body(self):
        """The decoder the causal-LM forward calls by its attribute name (``base_model_prefix``), or None."""
        return getattr(self.model, getattr(self.model, "base_model_prefix", "") or "model", None)

    @_inference_mode
    def _whole_logits(self, ids: list[int], positions: list[int]) -> np.ndarray:
        import torch

        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        keep = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits[0].float().cpu().numpy()

    @_inference_mode
    def _hidden_states(self, ids: list[int]):
        """The body's last hidden states over ``ids`` ((1, n, hidden), as the forward hands them to its head), or
        None where the head cannot be run apart from the body here (checked once per runtime on a few tokens:
        the split path must reproduce the model's own forward)."""
        import torch

        body = self._body()
        if body is None:
            return None
        if getattr(self, "_split_head_ok", None) is None:
            probe = ids[: min(len(ids), 8)]
            whole = self._whole_logits(probe, list(range(len(probe))))
            try:
                h = body(input_ids=torch.tensor([probe], dtype=torch.long, device=self.device), use_cache=False)
                # the forward reads its body's own output class (a mixture of experts: router logits too)
                self._body_output = type(h)
                split = self._head(h.last_hidden_state, list(range(len(probe))))
                why = "did not reproduce the model's forward"
            except Exception as e:         # a forward that needs more of its body than the hidden states
                split, why = None, f"failed ({type(e).__name__}: {e})"
            scale = max(float(np.abs(whole).max()), 1.0)
            # float32 on a CPU: the same arithmetic up to the head's matmul blocking; half precision: its rounding
            tol = 1e-4 if self.dtype == torch.float32 else 3e-2
            self._split_head_ok = split is not None and bool(np.abs(split - whole).max() <= tol * scale)
            if not self._split_head_ok:
                log.warning("%s: the LM head run apart from the body %s; scoring takes each sequence's logits in "
                            "one pass", type(self.model).__name__, why)
        if not self._split_head_ok:
            return None
        return body(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                    use_cache=False).last_hidden_state

    @_inference_mode
    def _head(self, hidden, rows: list[int]) -> np.ndarray | None:
        """float32 logits at ``rows`` of ``hidden``: the model's own forward with its body answered by those
        hidden states, so the head and every transform after it are the model's code (None: the forward never
        called the body, so the rows would be wrong)."""
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPast

        body = self._body()
        picked = hidden[:, torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        called = []

        def answer(*args, **kwargs):
            called.append(True)
            return getattr(self, "_body_output", BaseModelOutputWithPast)(last_hidden_state=picked)

        saved = body.__dict__.get("forward")      # an accelerate hook's wrapper, when the model was dispatched
        body.forward = answer
        try:
            out = self.model(input_ids=torch.zeros((1, len(rows)), dtype=torch.long, device=self.device),
                             use_cache=False, logits_to_keep=0)
        finally:
            if saved is None:
                del body.forward
            else:
                body.forward = saved
        return out.logits[0].float().cpu().numpy() if called else None

    @_inference_mode
    def _cache_chunk(self, cache, tokens: list[int], keep: list[int]) -> np.ndarray:
        import torch

        out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device), cache=cache,
                         use_cache=True, logits_to_keep=torch.tensor(keep, device=self.device))
        return out.logits[0].float().cpu().numpy()

    def _blocks_through_cache(self, ids: list[int], positions: list[int]) -> Iterator[np.ndarray]:
        """Teacher-forced logits as decoding with a quantized cache sees them (``positions`` ascending). A single
        forward pass would attend to fresh keys and values only and never read the cache, hiding its error. So:
        every stretch of unscored tokens (a prompt) is one prefill chunk, like the prefill it is in free-running;
        scored stretches (replies) are fed ``score_chunk`` tokens at a time, each chunk attending to the
        quantized past plus the full-precision residual window and itself, as decode steps do. Each chunk's rows
        are handed on as it is computed."""
        wanted = sorted(set(positions))
        chunks: list[tuple[int, int]] = []
        cursor, i = 0, 0
        while i < len(wanted):
            j = i
            while j + 1 < len(wanted) and wanted[j + 1] == wanted[j] + 1:
                j += 1
            a, b = wanted[i], wanted[j]
            if a + 1 > cursor:
                chunks.append((cursor, a + 1))
            s = max(a + 1, cursor)
            while s <= b:
                e = min(s + self.kv["score_chunk"], b + 1)
                chunks.append((s, e))
                s = e
            cursor, i = b + 1, j + 1
        cache = self._new_cache()
        wanted_set = set(wanted)
        next_row = 0
        for s, e in chunks:
            keep = [p - s for p in range(s, e) if p in wanted_set]
            logits = self._cache_chunk(cache, ids[s:e], keep)
            row_of = {s + rel: k for k, rel in enumerate(keep)}
            stop = next_row
            while stop < len(positions) and positions[stop] in row_of:
                stop += 1
            if stop > next_row:
                yield logits[[row_of[p] for p in positions[next_row:stop]]].astype(np.float32)
                next_row = stop
