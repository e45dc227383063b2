"""Drift metrics. Pure numpy/stdlib: everything here is unit-tested against exact computations."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_TINY = 1e-30


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    m = logits.max(axis=-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def tail_logmass(topk_logprobs: np.ndarray) -> np.ndarray:
    """log(1 - sum_k p_k) per row: the probability left outside the kept ids, clamped away from log(0)."""
    mass = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(axis=-1)
    return np.log(np.clip(1.0 - mass, _TINY, None))


def topk_from_logprobs(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k ids (descending probability; ties broken by lower id), their log-probs, and the tail log-mass."""
    logprobs = np.asarray(logprobs, dtype=np.float64)
    k = min(k, logprobs.shape[-1])
    part = np.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    lps = np.take_along_axis(vals, order, axis=-1)
    return ids.astype(np.int64), lps, tail_logmass(lps)


def kld_topk_tail(ref_logprobs: np.ndarray, ref_tail: np.ndarray, var_logprobs: np.ndarray) -> np.ndarray:
    """KL(P_ref || Q_var) per position over the reference's top-K ids plus one bucket for everything else.

    ``ref_logprobs``/``var_logprobs``: (n, K) log-probs of the same K ids under each model; ``ref_tail``: (n,)
    log of the reference's remaining mass. Merging the tail into one bucket can only lower KL (log-sum
    inequality), so this is a tight lower bound of the full-vocabulary KL when the top-K hold most mass.
    """
    lp = np.asarray(ref_logprobs, dtype=np.float64)
    lq = np.asarray(var_logprobs, dtype=np.float64)
    tail_p = np.asarray(ref_tail, dtype=np.float64)
    tail_q = tail_logmass(lq)
    head = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    tail = np.exp(tail_p) * (tail_p - tail_q)
    return np.maximum(head + tail, 0.0)


def kld_full(ref_logprobs: np.ndarray, var_logprobs: np.ndarray) -> np.ndarray:
    lp = np.asarray(ref_logprobs, dtype=np.float64)
    lq = np.asarray(var_logprobs, dtype=np.float64)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None, "max": None, "n": 0}
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "n": int(arr.size),
    }


# The percentiles llama.cpp's perplexity tool prints with --kl-divergence (KLD and Δp).
KLD_PERCENTILES = (99.9, 99.0, 90.0, 50.0, 10.0, 5.0, 1.0)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def percentiles(values: Sequence[float], qs: Sequence[float]) -> dict[str, float] | None:
    """{"99.9": x, ...} (numpy's linear interpolation, as llama.cpp's sorted-index lookup approximates)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return None
    return {f"{q:g}": float(v) for q, v in zip(qs, np.percentile(arr, qs))}


def delta_p(nll_reference: Sequence[float], nll_variant: Sequence[float]) -> dict | None:
    """Δp as llama.cpp's KLD tool reports it: the change in the probability of the text's next token (here the
    reference's own token), variant minus reference; its mean, RMS, extremes and percentiles."""
    pr = np.exp(-np.asarray(nll_reference, dtype=np.float64))
    pv = np.exp(-np.asarray(nll_variant, dtype=np.float64))
    if pr.size == 0:
        return None
    d = pv - pr
    return {"mean": float(d.mean()), "rms": float(np.sqrt(np.mean(d * d))), "min": float(d.min()),
            "max": float(d.max()), "percentiles": percentiles(d, DELTA_P_PERCENTILES), "n": int(d.size)}


def position_buckets(positions: Sequence[int], values: Sequence[float], width: int = 128) -> dict[str, dict]:
    """Group per-token values by output position: '0-128', '128-256', ..."""
    groups: dict[int, list[float]] = {}
    for pos, v in zip(positions, values):
        groups.setdefault(int(pos) // width, []).append(float(v))
    return {f"{b * width}-{(b + 1) * width}": {"mean": float(np.mean(vs)), "n": len(vs)}
            for b, vs in sorted(groups.items())}


def repeated_ngram_rate(tokens: Sequence, n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the same sequence (0: none repeated)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def longest_loop(tokens: Sequence, max_period: int = 64) -> int:
    """Length in tokens of the longest tail that repeats with some period (a degenerate loop)."""
    best = 0
    n = len(tokens)
    for period in range(1, min(max_period, n // 2) + 1):
        run = 0
        for i in range(n - 1, period - 1, -1):
            if tokens[i] == tokens[i - period]:
                run += 1
            else:
                break
        if run >= period:
            best = max(best, run + period)
    return best


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing token, or None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def chrf(hypothesis: str, reference: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_chrf(hypothesis, [reference]).score)


def flips(reference: Sequence[bool], variant: Sequence[bool]) -> dict[str, int]:
    """Checks that changed outcome between the reference and the variant."""
    if len(reference) != len(variant):
        raise ValueError(f"flip count needs paired results, got {len(reference)} and {len(variant)}")
    pass_to_fail = sum(1 for r, v in zip(reference, variant) if r and not v)
    fail_to_pass = sum(1 for r, v in zip(reference, variant) if v and not r)
    return {"pass_to_fail": pass_to_fail, "fail_to_pass": fail_to_pass, "total": len(reference)}


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar test on the discordant pair counts b and c."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)
