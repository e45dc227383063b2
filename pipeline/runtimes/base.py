"""The runtime interface. Shapes are exact; every runtime is tested against it on a tiny model."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class Generation:
    """One greedy reply. ``ids`` excludes the stop token; ``stop`` is 'eos' or 'length'."""

    ids: list[int]
    stop: str
    prompt_tokens: int            # length of the prompt
    prefill_tokens: int           # tokens actually evaluated before the first reply token (prefix reuse skips some)
    ttft_s: float                 # prefill + the first token
    decode_times_s: list[float] = field(default_factory=list)   # one per reply token after the first


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


class Runtime(abc.ABC):
    """A loaded artifact. Subclasses set ``self.info`` (device, dtype, threads, kernel, ...)."""

    name: str = ""
    info: dict
    # True when the runtime has a tokenizer of its own that a server built on it applies to chat text (llama.cpp's
    # GGUF vocabulary); then ``tokenize_served``/``detokenize_served`` exist and the deployment path is measured.
    own_tokenizer: bool = False

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> Generation:
        """Greedy decoding from ``prompt_ids`` (via ``greedy_decode``). A prompt that extends the previous call's
        tokens reuses their cache (multi-turn); ``reset()`` first for a cold prefill (timing probes)."""

    @abc.abstractmethod
    def logits(self, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Teacher-forced next-token logits after ``ids[p]`` for each p in ``positions``, from ONE forward pass
        over ``ids``: float32 array of shape (len(positions), vocab_size)."""

    def logprobs(self, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """Like ``logits`` but log-softmax normalised: float64 (len(positions), vocab_size)."""
        from pipeline.metrics import log_softmax

        return log_softmax(self.logits(ids, positions))

    def tokenize_served(self, text: str) -> list[int]:
        """The ids a server on this runtime sends the model for a rendered prompt ``text`` (its own tokenizer,
        special tokens parsed, BOS as the model's metadata says). Only where ``own_tokenizer``."""
        raise NotImplementedError(f"runtime {self.name!r} has no tokenizer of its own")

    def detokenize_served(self, ids: Sequence[int]) -> str:
        """The text such a server returns for generated ``ids``. Only where ``own_tokenizer``."""
        raise NotImplementedError(f"runtime {self.name!r} has no tokenizer of its own")

    def reset(self) -> None:
        """Forget any cached prefix so the next ``generate`` starts cold."""

    def kv_cache_bytes(self) -> dict | None:
        """KV-cache size as the runtime itself reports or holds it: {"bytes": int, "tokens": int} or None."""
        return None

    def close(self) -> None:
        pass

    def gather(self, ids: Sequence[int], positions: Sequence[int], candidates: np.ndarray,
               chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """Log-probs of chosen ids at chosen positions, and the argmax id at each position.

        ``candidates``: int (len(positions), K). Returns (float64 (len(positions), K), int64 (len(positions),)).
        One forward pass; the log-softmax runs in chunks of positions to bound float64 temporaries.
        """
        from pipeline.metrics import log_softmax

        candidates = np.asarray(candidates, dtype=np.int64)
        logits = self.logits(ids, positions)
        out = np.empty(candidates.shape, dtype=np.float64)
        argmax = np.empty(len(candidates), dtype=np.int64)
        for start in range(0, len(candidates), chunk):
            sel = slice(start, start + chunk)
            lp = log_softmax(logits[sel])
            out[sel] = np.take_along_axis(lp, candidates[sel], axis=-1)
            argmax[sel] = logits[sel].argmax(axis=-1)
        return out, argmax
