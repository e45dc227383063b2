"""A benchmark scored per sample across variants: accuracy and recovery with bootstrap intervals, and the flips
that equal accuracy hides (correct -> wrong, wrong -> correct) with the exact McNemar test.

Samples are the unit of resampling here (a benchmark's items are independent questions, unlike the checks of one
conversation); the variant and the original are resampled with the same draw, so recovery's interval is paired.
The statistics are the pipeline's own: ``figures.stats.bootstrap_ratio`` and ``adjust_p``, ``figures.drift.flips``
and ``mcnemar_exact_p``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from pipeline.figures import drift
from pipeline.figures.stats import NO_SIGNAL_PASS_RATE, adjust_p, bootstrap_ratio, interval


def _interval(ci: dict | None) -> dict | None:
    return None if ci is None else interval(ci["estimate"], ci["low"], ci["high"], ci["level"], ci["units"])


def _proportion(x: np.ndarray, seed: int) -> dict | None:
    """A share of correct answers with its 95 % interval: the bootstrap's, except where every answer is the same
    (0 of n or n of n right), where resampling has no spread and the exact Clopper-Pearson bound is given (0 of 16:
    [0, 20.6 %])."""
    n = len(x)
    if n and (x.sum() == 0 or x.sum() == n):
        edge = 0.025 ** (1 / n)
        low, high = (0.0, 1 - edge) if x.sum() == 0 else (edge, 1.0)
        out = interval(float(x.mean()), low, high, 0.95, n)
        out["method"] = "exact (Clopper-Pearson): every answer the same"
        return out
    return _interval(bootstrap_ratio(x, np.ones(n), seed))


def paired(original: Mapping[str, bool], variant: Mapping[str, bool]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The sample ids both sides hold (sorted) and their outcomes as 0/1 arrays; a ValueError naming the
    difference when the two sides did not answer the same samples."""
    missing, extra = sorted(set(original) - set(variant)), sorted(set(variant) - set(original))
    if missing or extra:
        raise ValueError(f"paired flips need the same samples on both sides: {len(missing)} only in the original "
                         f"(e.g. {missing[:3]}), {len(extra)} only in the variant (e.g. {extra[:3]})")
    ids = sorted(original)
    return (ids, np.asarray([bool(original[i]) for i in ids], dtype=np.float64),
            np.asarray([bool(variant[i]) for i in ids], dtype=np.float64))


def compare(original: Mapping[str, bool], variant: Mapping[str, bool], seed: int = 0) -> dict:
    """Per-sample correctness of the original and a variant (sample id -> correct) -> the variant's accuracy,
    the original's, their paired difference and recovery (variant / original) with 95 % bootstrap intervals
    (samples resampled), the flips each way, the flip rate and the two-sided exact McNemar p-value on the
    discordant pairs. ``recovery`` is None when the original gets nothing right; ``no_signal_for_flips`` says
    the original is right on fewer than ``NO_SIGNAL_PASS_RATE`` of the samples (flips are then mostly lucky
    answers, not damage)."""
    ids, o, v = paired(original, variant)
    n = len(ids)
    if n == 0:
        raise ValueError("paired flips need at least one sample")
    ones = np.ones(n)
    f = drift.flips(o.astype(bool).tolist(), v.astype(bool).tolist())
    return {
        "samples": n,
        "accuracy": _proportion(v, seed),
        "reference_accuracy": _proportion(o, seed),
        "accuracy_delta": _interval(bootstrap_ratio(v - o, ones, seed)),
        "recovery": _interval(bootstrap_ratio(v, o, seed)) if o.sum() > 0 else None,
        "correct_to_wrong": f["pass_to_fail"],
        "wrong_to_correct": f["fail_to_pass"],
        "flip_rate": (f["pass_to_fail"] + f["fail_to_pass"]) / n,
        # no discordant pair: nothing to test (a p of 1 would read as "no loss" on a task with no signal)
        "mcnemar_p": (drift.mcnemar_exact_p(f["pass_to_fail"], f["fail_to_pass"])
                      if f["pass_to_fail"] + f["fail_to_pass"] else None),
        "no_signal_for_flips": bool(o.mean() < NO_SIGNAL_PASS_RATE),
    }


def compare_variants(original: Mapping[str, bool], variants: Mapping[str, Mapping[str, bool]], seed: int = 0,
                     method: str = "holm") -> dict[str, dict]:
    """``compare`` for every variant of one task, with ``mcnemar_p_adjusted``: the family-wise adjusted p-value
    over the task's variants (``stats.adjust_p``, ``decision.multiple_comparisons``)."""
    out = {name: compare(original, outcome, seed) for name, outcome in variants.items()}
    adjusted = adjust_p({name: r["mcnemar_p"] for name, r in out.items()}, method)
    for name, r in out.items():
        r["mcnemar_p_adjusted"] = adjusted[name]
        r["multiple_comparisons"] = method
    return out


def accuracy(outcome: Mapping[str, bool], seed: int = 0) -> dict | None:
    """One side's accuracy with its 95 % bootstrap interval (samples resampled); None without samples: what a
    variant shows where no original answered the same task."""
    if not outcome:
        return None
    x = np.asarray([bool(outcome[i]) for i in sorted(outcome)], dtype=np.float64)
    return _proportion(x, seed)


def by_category(categories: Mapping[str, str], outcome: Mapping[str, bool],
                reference: Mapping[str, bool] | None = None) -> dict[str, dict]:
    """Per category of the samples (``categories``: sample id -> category, in the data file's order, which the
    result keeps): how many samples ``outcome`` answered there, how many right and their share, and against the
    ``reference``'s answers to the same samples the flips each way (None without a reference). Samples of
    ``outcome`` that ``categories`` lacks are left out; a category none of whose samples were answered (a limited
    run) is absent."""
    out: dict[str, dict] = {}
    for sid, category in categories.items():
        if sid not in outcome:
            continue
        c = out.setdefault(category, {"samples": 0, "correct": 0, "accuracy": None,
                                      "correct_to_wrong": None if reference is None else 0,
                                      "wrong_to_correct": None if reference is None else 0})
        right = bool(outcome[sid])
        c["samples"] += 1
        c["correct"] += right
        if reference is not None:
            was = bool(reference[sid])
            c["correct_to_wrong"] += was and not right
            c["wrong_to_correct"] += right and not was
    for c in out.values():
        c["accuracy"] = c["correct"] / c["samples"]
    return out


def outcomes(samples: list[dict]) -> dict[str, bool]:
    """sample id -> correct, from ``tasks.run_task``'s samples."""
    return {s["id"]: bool(s["correct"]) for s in samples}
