"""The llama.cpp runtime's batched decoding (``LlamaCppBatching``, a part of ``LlamaCppRuntime``): several
sequences decoded together in a second context over the same weights, one KV slot per sequence kept between calls
so a conversation's next turn prefills only what is new. Versioned with the runtime's own module in the keys of the
stages that use it (``pipeline.runtimes.runtime_code``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipeline.infra.llama_tools import load_llama_cpp
from pipeline.runtimes.base import Generation, greedy_decode_many


def _reusable(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Cached cells a new prompt can keep: the common prefix, leaving at least one token to evaluate (its logits
    give the first reply token)."""
    reuse = 0
    for a, b in zip(cached, prompt):
        if a != b:
            break
        reuse += 1
    return min(reuse, len(prompt) - 1)


class LlamaCppBatching:
    """``generate_many`` for ``LlamaCppRuntime``, on the attributes it sets when it loads: ``llm`` (the
    ``llama_cpp.Llama``), ``n_vocab``, ``choice`` (the decoding rule) and ``kv_unified``. The slots' context it keeps
    (``_multi``) is cleared by the runtime's ``reset`` and freed by its ``close``."""

    def _slots_context(self, slots: int, per_seq_ctx: int):
        """A second context over the same weights holding ``slots`` sequences of up to ``per_seq_ctx`` cells each:
        one KV buffer shared by all (``runtime.kv_unified``, llama-server's default layout) or one KV stream per
        sequence; and a batch able to carry one token per sequence or a prompt chunk. Kept while the shape fits."""
        llama_cpp = load_llama_cpp()
        from llama_cpp import _internals

        have = getattr(self, "_multi", None)
        if have and have["slots"] >= slots and have["per_seq_ctx"] >= per_seq_ctx:
            return have
        if have:
            have["batch"].close()
            have["ctx"].close()
        params = llama_cpp.llama_context_params.from_buffer_copy(self.llm.context_params)
        params.n_seq_max = slots
        params.n_ctx = slots * per_seq_ctx
        params.kv_unified = self.kv_unified
        ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        n_tokens = max(int(params.n_batch), slots)
        batch = _internals.LlamaBatch(n_tokens=n_tokens, embd=0, n_seq_max=1, verbose=False)
        self._multi = {"slots": slots, "per_seq_ctx": per_seq_ctx, "ctx": ctx, "batch": batch,
                       "n_batch": n_tokens, "cached": [[] for _ in range(slots)]}
        return self._multi

    def generate_many(self, requests: Sequence[tuple[int, Sequence[int], int]], stop_ids: Sequence[int],
                      slots: int = 1, forced: Sequence[Sequence[int]] | None = None) -> list[Generation]:
        """Greedy decoding of several sequences together, as llama.cpp's batched tools do: every step is ONE
        llama_batch holding the next token of each live sequence (its own seq id and position), so the weights
        are read once per step for all of them; each prompt is prefilled in chunks of its own, as ``generate``
        cuts them (see below). A slot keeps its
        KV cells between calls: a conversation's next turn prefills only the tokens after the common prefix.
        Batched float arithmetic may differ from single-sequence decoding in the last bits; ``make bench``
        measures the greedy-token agreement.

        ``forced`` (one token list per request, at least its budget long): decode on those tokens instead of the
        picks (each step feeds ``forced[i][t]``, the repetition penalty's window is the forced reply) and return,
        per position, the token the path WOULD have picked after the same history. ``make bench`` compares these
        with single-sequence decoding's tokens: the agreement per position, free of the cascade one early
        difference sets off in free running."""
        import time

        llama_cpp = load_llama_cpp()

        if not requests:
            return []
        slots = max(slots, 1 + max(r[0] for r in requests))
        per_seq = max(len(p) + n for _, p, n in requests)
        per_seq = ((per_seq + 255) // 256) * 256
        m = self._slots_context(slots, max(per_seq, getattr(self, "_multi", {}).get("per_seq_ctx", 0)))
        ctx, batch, cached = m["ctx"], m["batch"], m["cached"]
        raw = batch.batch
        n = len(requests)
        prompts = [[int(t) for t in p] for _, p, _ in requests]
        seq = [r[0] for r in requests]
        budgets = [r[2] for r in requests]
        if len(set(seq)) != n:
            raise ValueError("generate_many: two requests for the same slot")
        if forced is not None and (len(forced) != n or any(len(f) < b for f, b in zip(forced, budgets))):
            raise ValueError("generate_many: forced needs one token list per request, each as long as its budget")
        if forced is not None:
            forced = [[int(t) for t in f] for f in forced]
        # prefix reuse per slot: keep the cells of the common prefix, at least one token left to evaluate
        todo = []
        for i in range(n):
            reuse = _reusable(cached[seq[i]], prompts[i])
            llama_cpp.llama_memory_seq_rm(ctx.memory, seq[i], reuse, -1)
            todo.append(reuse)

        def run(entries: list[tuple[int, int, int, bool]]) -> None:
            """entries: (token, position, seq id, wants logits) -> one decode."""
            raw.n_tokens = len(entries)
            for j, (tok, pos, sid, want) in enumerate(entries):
                raw.token[j] = tok
                raw.pos[j] = pos
                raw.seq_id[j][0] = sid
                raw.n_seq_id[j] = 1
                raw.logits[j] = want
            rc = llama_cpp.llama_decode(ctx.ctx, raw)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}) with {len(entries)} tokens in the batch")

        def pick(row: int, i: int, reply: Sequence[int]) -> int:
            """The next id of request i from the batch's logits row ``row``."""
            ptr = llama_cpp.llama_get_logits_ith(ctx.ctx, row)
            return self.choice.pick(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)), prompts[i], reply)

        t0 = time.perf_counter()
        first: list[int | None] = [None] * n
        ttft = [0.0] * n
        # prefill: each request's remaining prompt tokens in chunks of its own, cut where single-sequence decoding
        # (generate: llm.eval from the reused prefix in n_batch chunks) cuts them. Measured (make bench, Q8_0): a
        # chunk that mixes sequences in unequal counts gives their rows other activation rounding in the quantized
        # matmuls, and 2-3 % of the greedy picks after the same history changed, in every sequence of the batch;
        # with chunks of their own the batched path's logits were bit-identical to single-sequence decoding's.
        chunk = self.llm.n_batch
        for i in range(n):
            if todo[i] >= len(prompts[i]):
                raise ValueError(f"generate_many: request {i} has no prompt token left to evaluate")
            for start in range(todo[i], len(prompts[i]), chunk):
                part = range(start, min(start + chunk, len(prompts[i])))
                run([(prompts[i][k], k, seq[i], k == len(prompts[i]) - 1) for k in part])
            first[i] = pick(len(part) - 1, i, [])
            ttft[i] = time.perf_counter() - t0

        def step(live: list[int], ids: list[list[int]]) -> list[int]:
            fed = ids if forced is None else [f[:len(r)] for f, r in zip(forced, ids)]
            run([(fed[i][-1], len(prompts[i]) + len(ids[i]) - 1, seq[i], True) for i in live])
            return [pick(j, i, fed[i]) for j, i in enumerate(live)]

        ids, stop, times = greedy_decode_many(first, step, budgets, stop_ids)
        out = []
        for i in range(n):
            fed_i = ids[i] if forced is None else forced[i][:len(ids[i])]
            cached[seq[i]] = prompts[i] + fed_i[:len(times[i])]      # the tokens whose cells exist
            out.append(Generation(ids=ids[i], stop=stop[i], prompt_tokens=len(prompts[i]),
                                  prefill_tokens=len(prompts[i]) - todo[i], ttft_s=ttft[i], decode_times_s=times[i]))
        return out
