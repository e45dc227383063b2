"""Paired statistics for the decision: bootstrap confidence intervals that resample conversations.

Tokens and checks within one conversation are not independent (a variant that derails early stays derailed), so
the unit of resampling is the conversation: each replicate draws conversations with replacement and recomputes
the ratio estimators (sum over drawn conversations / count over drawn conversations). Differences against the
original are paired: the same draw is applied to both sides. Fixed seed, so reports are reproducible.
"""

from __future__ import annotations

import numpy as np

REPLICATES = 2000
LEVEL = 0.95


def bootstrap_ratio(numerators, denominators, seed: int = 0, replicates: int = REPLICATES,
                    level: float = LEVEL) -> dict | None:
    """CI of sum(num) / sum(den) when the (num, den) pairs (one per conversation) are resampled.

    ``numerators`` may be 2-D (k statistics per conversation sharing the denominators): returns arrays then.
    """
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if den.size == 0 or den.sum() <= 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(den), size=(replicates, len(den)))
    d = den[idx].sum(axis=1)
    ok = d > 0
    est = num.sum(axis=0) / den.sum()
    reps = (num[idx].sum(axis=1) / (d[:, None] if num.ndim == 2 else d))[ok]
    lo, hi = np.percentile(reps, [100 * (1 - level) / 2, 100 * (1 + level) / 2], axis=0)
    return {"estimate": est.tolist() if num.ndim == 2 else float(est),
            "low": lo.tolist() if num.ndim == 2 else float(lo), "high": hi.tolist() if num.ndim == 2 else float(hi),
            "level": level, "units": int(len(den)), "replicates": replicates}


def interval(estimate, low, high, level: float = LEVEL, units: int = 0) -> dict:
    return {"estimate": estimate, "low": low, "high": high, "level": level, "units": units}


def conversation_intervals(tf: dict, samples: list[dict], seed: int = 0) -> dict:
    """95 % bootstrap CIs for mean KLD, top-1 agreement, ΔNLL (per token, conversations resampled), pass rate and
    the paired pass-rate difference against the original (per check, conversations resampled)."""
    rows = []
    for suite, convs in tf.items():
        for cid, c in convs.items():
            k = np.asarray(c["kld"], dtype=np.float64)
            if k.size:
                rows.append((np.sum(k), np.sum(c["top1"]),
                             float(np.sum(np.asarray(c["nll_variant"]) - np.asarray(c["nll_reference"]))), k.size))
    out: dict = {}
    if rows:
        arr = np.asarray(rows)
        ci = bootstrap_ratio(arr[:, :3], arr[:, 3], seed)
        for i, name in enumerate(("kld_mean", "top1_agreement", "delta_nll")):
            out[name] = interval(ci["estimate"][i], ci["low"][i], ci["high"][i], ci["level"], ci["units"])
    per_conv: dict = {}
    for s in samples:
        key = (s["suite"], s["conversation"])
        p = per_conv.setdefault(key, [0, 0, 0, 0])
        p[0] += sum(s["checks_variant"])
        p[1] += sum(s["checks_reference"])
        p[2] += len(s["checks_variant"])
        p[3] += sum(1 for a, b in zip(s["checks_reference"], s["checks_variant"]) if a != b)
    checks = np.asarray([v for v in per_conv.values() if v[2] > 0], dtype=np.float64)
    if len(checks):
        ci = bootstrap_ratio(np.stack([checks[:, 0], checks[:, 0] - checks[:, 1], checks[:, 3]], axis=1),
                             checks[:, 2], seed)
        for i, name in enumerate(("pass_rate", "pass_rate_delta", "flip_rate")):
            out[name] = interval(ci["estimate"][i], ci["low"][i], ci["high"][i], ci["level"], ci["units"])
    return out
