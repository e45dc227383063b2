"""Drift metrics. Pure numpy/stdlib: everything here is unit-tested against exact computations."""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

import numpy as np

_TINY = 1e-30

# Scoring holds a conversation's log-probs a chunk of rows at a time, never as one (positions, vocabulary) matrix:
# at a 256k vocabulary and 2k reply tokens one float64 copy of that matrix is 4 GB. A chunk's rows are sized so
# that its temporaries stay under CHUNK_BYTES: the row math holds at most about PEAK_BYTES_PER_ENTRY bytes per
# vocabulary entry at once (a float64 copy, its exp, argpartition's negated copy and int64 indices, or both
# models' float64 log-probs with their difference and product), measured with tracemalloc
# (tests/test_streaming_scoring.py).
CHUNK_BYTES = 64 * 2**20
PEAK_BYTES_PER_ENTRY = 40


def chunk_rows(vocab: int, bytes_per_entry: int = PEAK_BYTES_PER_ENTRY) -> int:
    """Rows per chunk for a vocabulary of ``vocab`` entries: ``bytes_per_entry`` x vocab x rows <= CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (max(int(vocab), 1) * bytes_per_entry))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    m = logits.max(axis=-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def log_softmax_parts(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``log_softmax`` in its parts, term for term: (z = logits - max in float64, log of the sum of exp(z), the
    max), the last two (rows, 1); the log-probs are z - log_sum."""
    z = np.array(logits, dtype=np.float64)          # a copy: the caller's rows are left as they are
    m = z.max(axis=-1, keepdims=True)
    z -= m
    return z, np.log(np.exp(z).sum(axis=-1, keepdims=True)), m


def split_rows(blocks: Iterable[np.ndarray], rows: int | None = None) -> Iterator[np.ndarray]:
    """The blocks' rows again, in order, cut into pieces of at most ``rows`` rows (default: ``chunk_rows``)."""
    for block in blocks:
        step = rows or chunk_rows(block.shape[-1])
        for start in range(0, len(block), step):
            yield block[start:start + step]
        del block        # before the next block is made: one block at a time, not two


def logprob_chunks(logit_blocks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """float64 log-softmax of a stream of float32 logit rows (as ``log_softmax``, term for term), a chunk of
    ``chunk_rows`` rows at a time."""
    for rows in split_rows(logit_blocks):
        z, log_sum, _ = log_softmax_parts(rows)
        del rows         # a view that would keep its whole block alive while the next one is made
        z -= log_sum
        yield z


def stored_chunks(logprobs: np.ndarray) -> Iterator[np.ndarray]:
    """Stored log-prob rows (an array or a memory map of one, any float dtype) as float64 chunks."""
    for rows in split_rows([logprobs]):
        yield np.asarray(rows, dtype=np.float64)


def paired(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Two streams of row chunks over the same rows, in order, cut at common boundaries: each pair holds the same
    rows of both (at most one chunk of each stream is held)."""
    it_a, it_b = iter(a), iter(b)
    left_a = left_b = None
    while True:
        while left_a is None or len(left_a) == 0:
            left_a = next(it_a, None)
            if left_a is None:
                break
        while left_b is None or len(left_b) == 0:
            left_b = next(it_b, None)
            if left_b is None:
                break
        if left_a is None or left_b is None:
            if left_a is not None or left_b is not None:
                raise ValueError("paired row streams of different lengths")
            return
        k = min(len(left_a), len(left_b))
        yield left_a[:k], left_b[:k]
        left_a, left_b = left_a[k:], left_b[k:]


def write_rows(path, blocks: Iterable[np.ndarray], n_rows: int, dtype=np.float32) -> int:
    """A .npy file of ``n_rows`` rows (``np.load`` reads it, ``mmap_mode="r"`` without loading it) written a block
    at a time from a stream of row blocks cast to ``dtype``; returns the rows written (a count that differs from
    ``n_rows`` raises)."""
    written, header = 0, None
    with open(path, "wb") as fh:
        for block in blocks:
            if header is None:
                header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                          "shape": (int(n_rows), int(block.shape[-1]))}
                np.lib.format.write_array_header_1_0(fh, header)
            fh.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
            written += len(block)
        if header is None:
            np.lib.format.write_array_header_1_0(fh, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                      "fortran_order": False, "shape": (0, 0)})
    if written != n_rows:
        raise ValueError(f"{path}: {written} rows written, {n_rows} expected")
    return written


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


def score_chunks(logit_blocks: Iterable[np.ndarray], candidates: np.ndarray, full_rows: Sequence[int] = (),
                 full_ref: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Teacher-forced figures from a stream of float32 logit rows, a chunk at a time: the float64 log-probs of
    ``candidates`` (int (n, K)) in each row, the argmax (of the float32 logits), the log-sum-exp; and at
    ``full_rows`` (indices into the rows, ascending) the full-vocabulary ``kld_full`` from ``full_ref`` (the
    reference's log-probs there, (len(full_rows), vocab), any float dtype; read a chunk at a time)."""
    candidates = np.asarray(candidates, dtype=np.int64)
    n = len(candidates)
    out = np.empty(candidates.shape, dtype=np.float64)
    argmax = np.empty(n, dtype=np.int64)
    lse = np.empty(n, dtype=np.float64)
    full_rows = np.asarray(full_rows, dtype=np.int64)
    if len(full_rows) and (full_ref is None or len(full_ref) != len(full_rows)):
        raise ValueError(f"score: {len(full_rows)} full rows need as many reference rows, got "
                         f"{None if full_ref is None else len(full_ref)}")
    kld = np.empty(len(full_rows), dtype=np.float64) if len(full_rows) else None
    start = 0
    for rows in split_rows(logit_blocks):
        stop = start + len(rows)
        if stop > n:
            raise ValueError(f"score: more logit rows than the {n} candidate rows")
        z, log_sum, m = log_softmax_parts(rows)
        out[start:stop] = np.take_along_axis(z, candidates[start:stop], axis=-1) - log_sum
        lse[start:stop] = (m + log_sum)[:, 0]
        argmax[start:stop] = rows.argmax(axis=-1)
        del rows         # a view that would keep its whole block alive while the next one is made
        if kld is not None:
            here = np.flatnonzero((full_rows >= start) & (full_rows < stop))
            if len(here):
                local = full_rows[here] - start
                kld[here] = kld_full(full_ref[here], z[local] - log_sum[local])
        start = stop
    if start != n:
        raise ValueError(f"score: {start} logit rows for {n} candidate rows")
    return out, argmax, lse, kld


def topk_chunks(logprob_rows: Iterable[np.ndarray], k: int, targets: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``topk_from_logprobs`` over a stream of float64 log-prob chunks, row for row the same, and the log-prob of
    ``targets`` (int (n,): the token that came) in each row: (ids, log-probs, tail log-mass, target log-probs)."""
    targets = np.asarray(targets, dtype=np.int64)
    parts: list[tuple[np.ndarray, ...]] = []
    start = 0
    for lp in logprob_rows:
        stop = start + len(lp)
        ids, lps, tail = topk_from_logprobs(lp, k)
        parts.append((ids, lps, tail, np.take_along_axis(lp, targets[start:stop, None], axis=-1)[:, 0]))
        start = stop
    if start != len(targets):
        raise ValueError(f"top-k: {start} log-prob rows for {len(targets)} target tokens")
    if not parts:
        return (np.empty((0, k), dtype=np.int64), np.empty((0, k)), np.empty(0), np.empty(0))
    return tuple(np.concatenate(x) for x in zip(*parts))       # type: ignore[return-value]


def compare_chunks(pairs: Iterable[tuple[np.ndarray, np.ndarray]], targets: np.ndarray | None = None
                   ) -> dict[str, np.ndarray]:
    """Per-row comparison of two models' float64 log-prob chunks over the same rows (``paired``): ``kld``
    (``kld_full`` from the first to the second), ``argmax_a``/``argmax_b``, and with ``targets`` (int (n,)) the
    log-prob of each target under both (``target_a``, ``target_b``)."""
    cols: dict[str, list[np.ndarray]] = {"kld": [], "argmax_a": [], "argmax_b": [], "target_a": [], "target_b": []}
    start = 0
    for la, lb in pairs:
        stop = start + len(la)
        cols["kld"].append(kld_full(la, lb))
        cols["argmax_a"].append(la.argmax(-1))
        cols["argmax_b"].append(lb.argmax(-1))
        if targets is not None:
            t = np.asarray(targets[start:stop], dtype=np.int64)[:, None]
            cols["target_a"].append(np.take_along_axis(la, t, axis=-1)[:, 0])
            cols["target_b"].append(np.take_along_axis(lb, t, axis=-1)[:, 0])
        start = stop
    if targets is not None and start != len(targets):
        raise ValueError(f"compare: {start} rows for {len(targets)} targets")
    return {k: (np.concatenate(v) if v else np.empty(0)) for k, v in cols.items()}


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
