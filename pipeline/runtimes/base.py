"""The runtime interface, in one place. Shapes are exact; every runtime is tested against it on a tiny model.

A runtime loads one artifact (plus KV-cache and runtime settings) and must offer:

- ``generate(prompt_ids, max_new_tokens, stop_ids) -> Generation``: greedy decoding (through ``greedy_decode``,
  each token picked by ``self.choice``, a ``TokenChoice``: the argmax, with the run's repetition penalty if any),
  reusing the cache of a previous call whose tokens the new prompt extends (multi-turn); ``reset()`` first for a
  cold prefill. Deterministic: the same call gives the same ids.
- ``score(ids, positions, candidates) -> Scores``: teacher-forced, from one pass over ``ids``: the log-probs of
  the candidate ids after ``ids[p]`` for each p in ``positions``, the argmax id there, and the log-sum-exp of the
  logits (the normaliser). This is all that drift scoring needs, so an engine that returns only top-k
  log-probs can implement it.

Optional capabilities, each declared by a class attribute:

- ``full_logits = True`` (``FullLogitsRuntime``): ``logit_blocks(ids, positions)`` streams the (n, vocab)
  float32 rows of one pass a block at a time (``logits`` returns them whole); ``score``, ``logprob_blocks`` and
  ``logprobs`` are derived from it. The original's reference distribution (top-K + tail), the F16 parity check
  and ``quantdrift corpus`` need it.
- ``own_tokenizer = True``: ``tokenize_served``/``detokenize_served``, the tokenizer a server on this runtime
  applies to chat text (the deployment path).

A backend owns its options: ``Settings`` (a dataclass validated when the config loads, so a misspelt option
fails in the first second), the KV-cache translation (``apply_kv_cache``), what its stage keys depend on
(``key_settings``) and how its cache is sized (``cache_element_bytes``, ``kv_cache_label``).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    from pipeline.config.schema import KVCacheConfig, RuntimeConfig


@dataclass
class NoSettings:
    """A backend without options of its own."""


@dataclass
class Scores:
    """``Runtime.score`` output for n positions and K candidates per position."""

    logprobs: np.ndarray     # float64 (n, K): log p(candidates[i, k] | ids[: positions[i] + 1])
    argmax: np.ndarray       # int64 (n,): the most likely next id at each position
    logsumexp: np.ndarray    # float64 (n,): log of the sum of exp(logits) over the vocabulary
    # float64 (len(full_rows),): the full-vocabulary KL divergence from ``full_ref`` at the rows asked for, computed
    # in the same pass a chunk of rows at a time (no row of the whole log-softmax is kept)
    kld_full: np.ndarray | None = None


@dataclass
class Generation:
    """One greedy reply. ``ids`` excludes the stop token; ``stop`` is 'eos' or 'length'."""

    ids: list[int]
    stop: str
    prompt_tokens: int            # length of the prompt
    prefill_tokens: int           # tokens actually evaluated before the first reply token (prefix reuse skips some)
    ttft_s: float                 # prefill + the first token
    decode_times_s: list[float] = field(default_factory=list)   # one per reply token after the first


@dataclass(frozen=True)
class TokenChoice:
    """How every runtime picks the next token from its logits: greedy (the argmax, the first on a tie), optionally
    with a repetition penalty as llama.cpp's sampler and transformers apply it (a logit above 0 divided by
    ``repeat_penalty``, one at or below 0 multiplied by it) on each distinct id among the last ``repeat_last_n``
    tokens of the reply so far (``scope="reply"``) or of the prompt and the reply (``scope="context"``, llama.cpp's
    and transformers' window). Deterministic, and the same arithmetic on every runtime: the penalty is applied here,
    on the float32 logits, never by an engine's own sampler."""

    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    scope: str = "reply"            # reply | context (runtime.repeat_scope, validated with the config)

    @classmethod
    def from_config(cls, rcfg: "RuntimeConfig | None") -> "TokenChoice":
        if rcfg is None:
            return cls()
        return cls(rcfg.repeat_penalty, rcfg.repeat_last_n, rcfg.repeat_scope)

    @property
    def greedy(self) -> bool:
        """Plain argmax: no penalty, or an empty window."""
        return self.repeat_penalty == 1.0 or self.repeat_last_n == 0

    def key(self) -> dict:
        """What stage keys record (nothing for plain greedy, so its stored stages stay valid)."""
        return {} if self.greedy else {"repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n,
                                       "repeat_scope": self.scope}

    def window(self, prompt: Sequence[int], reply: Sequence[int]) -> list[int]:
        if self.greedy:
            return []
        if self.scope == "reply" or len(reply) >= self.repeat_last_n:
            return list(reply[-self.repeat_last_n:])
        return list(prompt[len(prompt) - (self.repeat_last_n - len(reply)):]) + list(reply)

    def pick(self, logits: np.ndarray, prompt: Sequence[int], reply: Sequence[int]) -> int:
        """The next id from one row of logits (float32, vocabulary long; not modified)."""
        recent = self.window(prompt, reply)
        if not recent:
            return int(np.argmax(logits))
        row = np.array(logits, dtype=np.float32, copy=True)
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        vals = row[ids]
        row[ids] = np.where(vals > 0, vals / np.float32(self.repeat_penalty), vals * np.float32(self.repeat_penalty))
        return int(np.argmax(row))


def decoding_key(rcfg: "RuntimeConfig") -> dict:
    """What a stage key records of how replies are decoded: nothing for plain greedy (stored stages stay valid)."""
    key = TokenChoice.from_config(rcfg).key()
    return {"decoding": key} if key else {}


def greedy_decode(prefill: Callable[[], int], step: Callable[[int], int], max_new_tokens: int,
                  stop_ids: Sequence[int]) -> tuple[list[int], str, float, list[float]]:
    """The greedy loop every runtime shares: ``prefill()`` evaluates the prompt and returns the first token,
    ``step(token)`` feeds one token and returns the next. Returns (ids without the stop token, 'eos' or 'length',
    TTFT seconds, per-step decode seconds); ``len(times)`` ids were fed back into the model."""
    stops = set(stop_ids)
    t0 = time.perf_counter()
    token = prefill()
    ttft = time.perf_counter() - t0
    ids: list[int] = []
    times: list[float] = []
    while token not in stops:
        ids.append(token)
        if len(ids) >= max_new_tokens:
            return ids, "length", ttft, times
        t = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - t)
    return ids, "eos", ttft, times


def greedy_decode_many(first: Sequence[int], step: Callable[[list[int], list[list[int]]], list[int]],
                       budgets: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[list[int]], list[str],
                                                                                 list[list[float]]]:
    """``greedy_decode`` for several sequences decoded together: ``first`` holds each sequence's first token (from
    the prefill); ``step(live, ids)`` feeds the last reply token of each sequence in ``live`` (indices, in order;
    ``ids`` the replies so far) in one batched call and returns their next tokens. Returns (ids without stop
    tokens, 'eos' or 'length' per sequence, per-step decode seconds per sequence: the whole step's time, which
    the sequences share); ``len(times[i])`` ids of sequence i were fed back into the model."""
    stops = set(int(t) for t in stop_ids)
    n = len(first)
    ids: list[list[int]] = [[] for _ in range(n)]
    stop = ["length"] * n
    times: list[list[float]] = [[] for _ in range(n)]
    live, nxt = list(range(n)), list(first)
    while True:
        still = []
        for i, token in zip(live, nxt):
            if token in stops:
                stop[i] = "eos"
                continue
            ids[i].append(token)
            if len(ids[i]) < budgets[i]:
                still.append(i)
        live = still
        if not live:
            return ids, stop, times
        t = time.perf_counter()
        nxt = step(live, ids)
        dt = time.perf_counter() - t
        for i in live:
            times[i].append(dt)


class Runtime(abc.ABC):
    """A loaded artifact. Subclasses set ``self.info`` (device, dtype, threads, kernel, ...)."""

    name: str = ""
    info: dict
    Settings: type = NoSettings      # the variant's runtime_options, validated when the config loads
    full_logits: bool = False
    # True when the runtime has a tokenizer of its own that a server built on it applies to chat text (llama.cpp's
    # GGUF vocabulary); then ``tokenize_served``/``detokenize_served`` exist and the deployment path is measured.
    own_tokenizer: bool = False
    # how the next token is picked (``TokenChoice``): runtimes set it from ``runtime.repeat_*`` when they load
    choice: TokenChoice = TokenChoice()

    # ------------------------------------------------------------------ options (class level, no model loaded)
    @classmethod
    def parse_options(cls, options: dict, where: str = "variant.runtime_options"):
        from pipeline.config.settings import build_settings

        return build_settings(cls.Settings, {k: v for k, v in (options or {}).items() if k != "n_ctx"}, where)

    @classmethod
    def apply_kv_cache(cls, options: dict, kv: "KVCacheConfig") -> tuple[dict, str]:
        """The runtime options with a quantized KV-cache setting folded in, and the variant-name suffix for it."""
        from pipeline.infra.errors import Skip

        raise Skip(f"runtime {cls.name!r} has no quantized KV cache")

    @classmethod
    def kv_cache_applied(cls, options: dict) -> bool:
        """Whether ``options`` already hold a quantized KV-cache setting."""
        return False

    @classmethod
    def key_settings(cls, rcfg: "RuntimeConfig") -> dict:
        """Run-wide runtime settings that change this runtime's numbers (stage keys include them)."""
        return {}

    @classmethod
    def cache_element_bytes(cls, info: dict, head_dim: int) -> float:
        """Mean bytes per cached K/V element for the cache described by ``info`` (the runtime's ``info``)."""
        return {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(info.get("dtype", "float32"), 4.0)

    @classmethod
    def kv_cache_label(cls, info: dict) -> str | None:
        return info.get("dtype")

    @classmethod
    def keeps_window_only(cls, info: dict) -> bool:
        """A sliding-window layer's cache holds at most its window (False: the runtime allocates it in full, as
        llama.cpp's context does by default, ``swa_full``)."""
        return not info.get("swa_full", False)

    # ------------------------------------------------------------------ the interface
    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> Generation:
        """Greedy decoding from ``prompt_ids`` (via ``greedy_decode``). A prompt that extends the previous call's
        tokens reuses their cache (multi-turn); ``reset()`` first for a cold prefill (timing probes)."""

    @abc.abstractmethod
    def score(self, ids: Sequence[int], positions: Sequence[int], candidates: np.ndarray,
              full_rows: Sequence[int] = (), full_ref: np.ndarray | None = None) -> Scores:
        """Teacher-forced log-probs of ``candidates`` (int (len(positions), K)) after ``ids[p]`` for each p in
        ``positions``, from one pass over ``ids``; see ``Scores``. ``full_rows`` (ascending indices into
        ``positions``) with ``full_ref`` (a reference's whole log-softmax there, (len(full_rows), vocab)): the
        full-vocabulary KL divergence from the reference at those rows (``Scores.kld_full``), from the same
        pass; only a ``full_logits`` runtime can."""

    def tokenize_document(self, text: str) -> tuple[list[int], int | None]:
        """A whole text as this runtime's own tools tokenize a document (BOS per the model's metadata, special-
        token strings as plain text): the ids and the BOS id when the model adds one. Only where
        ``own_tokenizer``."""
        raise NotImplementedError(f"runtime {self.name!r} has no tokenizer of its own")

    def tokenize_served(self, text: str) -> list[int]:
        """The ids a server on this runtime sends the model for a rendered prompt ``text`` (its own tokenizer,
        special tokens parsed, BOS as the model's metadata says). Only where ``own_tokenizer``."""
        raise NotImplementedError(f"runtime {self.name!r} has no tokenizer of its own")

    def detokenize_served(self, ids: Sequence[int]) -> str:
        """The text such a server returns for generated ``ids``. Only where ``own_tokenizer``."""
        raise NotImplementedError(f"runtime {self.name!r} has no tokenizer of its own")

    # True when ``generate_many`` decodes several sequences in one batch (else it runs them one after another).
    batched: bool = False
    # keeps latent attention's compressed latent (kv_lora_rank + rope dims) rather than per-head keys and values
    latent_kv_cache: bool = False

    def generate_many(self, requests: Sequence[tuple[int, Sequence[int], int]], stop_ids: Sequence[int],
                      slots: int = 1) -> list[Generation]:
        """Greedy replies to several prompts: ``requests`` are (slot, prompt_ids, max_new_tokens), a slot being a
        sequence whose cache a later request for the same slot may reuse (a conversation's next turn). This
        default runs them one at a time through ``generate``; a batched runtime decodes them together."""
        out = []
        for _, prompt, budget in requests:
            self.reset()
            out.append(self.generate(prompt, budget, stop_ids))
        return out

    def reset(self) -> None:
        """Forget any cached prefix so the next ``generate`` starts cold."""

    def kv_cache_bytes(self) -> dict | None:
        """KV-cache size as the runtime itself reports or holds it: {"bytes": int, "tokens": int} or None."""
        return None

    def close(self) -> None:
        pass


class FullLogitsRuntime(Runtime):
    """A runtime that can return full-vocabulary logits; ``score`` and ``logprobs`` are derived from them.

    A subclass implements ``logit_blocks`` (the rows streamed from one pass) or ``logits`` (all rows at once); the
    other is derived. Scoring reads ``logit_blocks``, so a runtime that streams never has a conversation's whole
    (positions, vocab) matrix built by this project's code."""

    full_logits = True

    def logit_blocks(self, ids: Sequence[int], positions: Sequence[int]) -> Iterator[np.ndarray]:
        """The rows of ``logits(ids, positions)``, from ONE pass over ``ids``, in the order of ``positions``, as
        consecutive float32 blocks of at most ``block_rows(vocab)`` rows; each block is the caller's to keep.
        This default cuts ``logits``' matrix (for runtimes that can only return it whole)."""
        if type(self).logits is FullLogitsRuntime.logits:
            raise NotImplementedError(f"runtime {self.name!r} implements neither logits nor logit_blocks")
        yield from as_blocks(self.logits(ids, positions))

    def logits(self, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Teacher-forced next-token logits after ``ids[p]`` for each p in ``positions``, from ONE forward pass
        over ``ids``: float32 array of shape (len(positions), vocab_size). The whole matrix: scoring reads
        ``logit_blocks`` instead."""
        if type(self).logit_blocks is FullLogitsRuntime.logit_blocks:
            raise NotImplementedError(f"runtime {self.name!r} implements neither logits nor logit_blocks")
        blocks = list(self.logit_blocks(ids, positions))
        return np.concatenate(blocks) if blocks else np.empty((0, 0), dtype=np.float32)

    def logprob_blocks(self, ids: Sequence[int], positions: Sequence[int]) -> Iterator[np.ndarray]:
        """``logit_blocks`` log-softmax normalised: float64 chunks of at most ``drift.chunk_rows(vocab)`` rows."""
        from pipeline.figures.drift import logprob_chunks

        return logprob_chunks(self.logit_blocks(ids, positions))

    def logprobs(self, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Like ``logits`` but log-softmax normalised: float64 (len(positions), vocab_size). The whole matrix:
        for short checks; scoring streams ``logprob_blocks``."""
        chunks = list(self.logprob_blocks(ids, positions))
        return np.concatenate(chunks) if chunks else np.empty((0, 0), dtype=np.float64)

    def score(self, ids: Sequence[int], positions: Sequence[int], candidates: np.ndarray,
              full_rows: Sequence[int] = (), full_ref: np.ndarray | None = None) -> Scores:
        """One forward pass, streamed: the log-softmax runs a chunk of rows at a time (``drift.score_chunks``),
        so no (positions, vocab) matrix is held whatever the sequence's length."""
        from pipeline.figures.drift import score_chunks

        out, argmax, lse, kld = score_chunks(self.logit_blocks(ids, positions), candidates, full_rows, full_ref)
        return Scores(logprobs=out, argmax=argmax, logsumexp=lse, kld_full=kld)


# The most float32 logit bytes a runtime hands over in one block (``logit_blocks``): 64 rows at a 256k vocabulary,
# 341 at 49k. Large enough that a head applied per block reads its weights a few times per sequence, not per row.
BLOCK_BYTES = 64 * 2**20


def block_rows(vocab: int) -> int:
    """Rows per ``logit_blocks`` block: float32 rows of ``vocab`` entries within BLOCK_BYTES."""
    return max(1, BLOCK_BYTES // (4 * max(int(vocab), 1)))


def as_blocks(rows: np.ndarray) -> Iterator[np.ndarray]:
    """A whole (n, vocab) matrix handed over as ``logit_blocks`` blocks (views of it, ``block_rows`` rows each)."""
    step = block_rows(rows.shape[-1])
    return (rows[start:start + step] for start in range(0, len(rows), step))


def in_position_order(positions: Sequence[int], ascending: Callable[[list[int]], Iterator[np.ndarray]]
                      ) -> Iterator[np.ndarray]:
    """``logit_blocks`` from a runtime's ``ascending(sorted_positions)`` stream (rows computed in token order):
    streamed as they come when ``positions`` ascend (every caller's case), else gathered whole and reordered."""
    positions = [int(p) for p in positions]
    if all(a <= b for a, b in zip(positions, positions[1:])):
        yield from ascending(positions)
        return
    order = np.argsort(positions, kind="stable")
    blocks = list(ascending([positions[i] for i in order]))
    if not blocks:
        return
    rows = np.concatenate(blocks)
    out = np.empty_like(rows)
    out[order] = rows
    yield from as_blocks(out)
