"""Paired statistics for the decision: confidence intervals whose unit is the conversation.

Tokens and checks within one conversation are not independent (a variant that derails early stays derailed), so
the unit is the conversation. The drift and checks intervals of a run (8-16 conversations per suite) are Student-t
intervals of the ratio estimators (sum over conversations / count over conversations), their variance by
linearization, stratified by suite (``ratio_t_interval``): a percentile bootstrap over so few units is
anti-conservative (it covered 0.90 where 0.95 was stated in a simulation of 16 lognormal conversations; the t
interval 0.93). The bootstrap (``bootstrap_ratio``: each replicate draws conversations with replacement, fixed
seed) stays for benchmark tasks, whose units are hundreds of samples. Differences against the original are
paired: both sides of a unit enter together.
"""

from __future__ import annotations

import numpy as np

REPLICATES = 2000
LEVEL = 0.95


def bootstrap_ratio(numerators, denominators, seed: int = 0, replicates: int = REPLICATES,
                    level: float = LEVEL, strata=None) -> dict | None:
    """CI of sum(num) / sum(den) when the (num, den) pairs (one per conversation) are resampled.

    ``numerators`` may be 2-D (k statistics per conversation sharing the denominators): returns arrays then.
    ``strata`` (one label per conversation, e.g. its suite): each replicate draws within every stratum as many
    conversations as it holds, so a replicate keeps the run's mix of suites (a pooled draw would let one suite's
    conversations crowd out another's and widen or narrow the interval by chance).
    """
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if den.size == 0 or den.sum() <= 0:
        return None
    rng = np.random.default_rng(seed)
    if strata is None:
        idx = rng.integers(0, len(den), size=(replicates, len(den)))
    else:
        labels = np.asarray([str(x) for x in strata])
        if labels.shape != (len(den),):
            raise ValueError(f"bootstrap_ratio: {labels.size} strata labels for {len(den)} units")
        groups = [np.flatnonzero(labels == g) for g in sorted(set(labels.tolist()))]
        idx = np.concatenate([g[rng.integers(0, len(g), size=(replicates, len(g)))] for g in groups], axis=1)
    d = den[idx].sum(axis=1)
    ok = d > 0
    est = num.sum(axis=0) / den.sum()
    with np.errstate(divide="ignore", invalid="ignore"):      # replicates drawing only empty units are dropped
        reps = (num[idx].sum(axis=1) / (d[:, None] if num.ndim == 2 else d))[ok]
    lo, hi = np.percentile(reps, [100 * (1 - level) / 2, 100 * (1 + level) / 2], axis=0)
    return {"estimate": est.tolist() if num.ndim == 2 else float(est),
            "low": lo.tolist() if num.ndim == 2 else float(lo), "high": hi.tolist() if num.ndim == 2 else float(hi),
            "level": level, "units": int(len(den)), "replicates": replicates,
            **({"strata": len(groups)} if strata is not None else {})}


def ratio_t_interval(numerators, denominators, level: float = LEVEL, strata=None,
                     bounds: tuple[float, float] | None = None) -> dict | None:
    """CI of R = sum(num) / sum(den) over units (conversations): R ± t(n - H) × se, where se comes from the
    linearized residuals u = num - R × den, their variance summed over the strata (n_h × s_h² each, the sample
    variance with n_h - 1), divided by sum(den). ``numerators`` may be 2-D (k statistics sharing the
    denominators). ``bounds``: the estimator's feasible range, the interval clipped to it (a rate in [0, 1])."""
    from scipy.stats import t as student_t

    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if den.size == 0 or den.sum() <= 0:
        return None
    est = num.sum(axis=0) / den.sum()
    u = num - np.multiply.outer(den, est) if num.ndim == 2 else num - den * est
    labels = np.asarray(["all"] * len(den) if strata is None else [str(x) for x in strata])
    if labels.shape != (len(den),):
        raise ValueError(f"ratio_t_interval: {labels.size} strata labels for {len(den)} units")
    # a stratum of one unit has no variance of its own: such strata are pooled into one
    single = {g for g in set(labels.tolist()) if int((labels == g).sum()) == 1}
    labels = np.asarray(["(single units)" if x in single else x for x in labels.tolist()])
    var, groups = 0.0, sorted(set(labels.tolist()))
    for g in groups:
        ug = u[labels == g]
        if len(ug) > 1:
            var = var + len(ug) * ug.var(axis=0, ddof=1)
    df = len(den) - len(groups)
    # no degrees of freedom left (one unit per stratum): the interval is unbounded, never a point
    half = (student_t.ppf((1 + level) / 2, df) * np.sqrt(var) / den.sum() if df >= 1
            else np.full_like(np.asarray(est, dtype=np.float64), np.inf))
    lo, hi = est - half, est + half
    if bounds is not None:
        lo, hi = np.clip(lo, *bounds), np.clip(hi, *bounds)
    listed = num.ndim == 2
    return {"estimate": est.tolist() if listed else float(est), "low": np.asarray(lo).tolist() if listed else float(lo),
            "high": np.asarray(hi).tolist() if listed else float(hi), "level": level, "units": int(len(den)),
            "method": f"t interval (df {max(df, 0)}) of the ratio estimator, linearized, stratified by suite"}


def interval(estimate, low, high, level: float = LEVEL, units: int = 0, method: str | None = None) -> dict:
    return {"estimate": estimate, "low": low, "high": high, "level": level, "units": units,
            **({"method": method} if method else {})}


def per_conversation_checks(samples: list[dict], before: str = "checks_reference",
                            after: str = "checks_variant") -> dict[tuple[str, str], list[int]]:
    """Per (suite, conversation), in order of appearance: [``after`` passes, ``before`` passes, checks, flips]
    (by default the variant's against the original's reference replies)."""
    out: dict = {}
    for s in samples:
        p = out.setdefault((s["suite"], s["conversation"]), [0, 0, 0, 0])
        p[0] += sum(s[after])
        p[1] += sum(s[before])
        p[2] += len(s[after])
        p[3] += sum(1 for a, b in zip(s[before], s[after]) if a != b)
    return out


def conversation_intervals(tf: dict, samples: list[dict], seed: int = 0) -> dict:
    """95 % t intervals (``ratio_t_interval``, conversations as units, stratified by suite) for mean KLD, top-1
    agreement, ΔNLL (per token), pass rate and the paired pass-rate difference against the original (per check)."""
    rows, row_suites = [], []
    for suite, convs in tf.items():
        for cid, c in convs.items():
            k = np.asarray(c["kld"], dtype=np.float64)
            if k.size:
                rows.append((np.sum(k), np.sum(c["top1"]),
                             float(np.sum(np.asarray(c["nll_variant"]) - np.asarray(c["nll_reference"]))), k.size))
                row_suites.append(suite)
    out: dict = {}
    if rows:
        arr = np.asarray(rows)
        ci = ratio_t_interval(arr[:, :3], arr[:, 3], strata=row_suites)
        for i, (name, bounds) in enumerate((("kld_mean", (0.0, np.inf)), ("top1_agreement", (0.0, 1.0)),
                                            ("delta_nll", (-np.inf, np.inf)))):
            out[name] = interval(ci["estimate"][i], float(np.clip(ci["low"][i], *bounds)),
                                 float(np.clip(ci["high"][i], *bounds)), ci["level"], ci["units"], ci["method"])
    out.update(checks_intervals(samples, seed))
    return out


def checks_intervals(samples: list[dict], seed: int = 0, before: str = "checks_reference",
                     after: str = "checks_variant") -> dict:
    """95 % t intervals (``ratio_t_interval``, stratified by suite) of ``after``'s pass rate, its paired
    difference from ``before``'s, the flip rate between them and the ratio of their passes (absent when ``before``
    passes none)."""
    out: dict = {}
    per = {k: v for k, v in per_conversation_checks(samples, before, after).items() if v[2] > 0}
    checks = np.asarray(list(per.values()), dtype=np.float64)
    suites = [suite for suite, _ in per]
    if len(checks):
        ci = ratio_t_interval(np.stack([checks[:, 0], checks[:, 0] - checks[:, 1], checks[:, 3]], axis=1),
                              checks[:, 2], strata=suites)
        for i, (name, bounds) in enumerate((("pass_rate", (0.0, 1.0)), ("pass_rate_delta", (-1.0, 1.0)),
                                            ("flip_rate", (0.0, 1.0)))):
            out[name] = interval(ci["estimate"][i], float(np.clip(ci["low"][i], *bounds)),
                                 float(np.clip(ci["high"][i], *bounds)), ci["level"], ci["units"], ci["method"])
        ratio = ratio_t_interval(checks[:, 0], checks[:, 1], strata=suites, bounds=(0.0, np.inf))
        if ratio is not None:
            out["pass_rate_ratio"] = interval(ratio["estimate"], ratio["low"], ratio["high"], ratio["level"],
                                              ratio["units"], ratio["method"])
    return out


# ------------------------------------------------------------------ paired tests, order-statistic intervals, power

ALPHA = 0.05
NO_SIGNAL_PASS_RATE = 0.20       # a suite whose checks the original passes less often carries no signal for flips
Z_975, Z_80 = 1.959964, 0.841621     # two-sided 5 % and 80 % power (normal approximation)


def sign_flip_p(diffs, seed: int = 0, exact_max: int = 16, samples: int = 20000) -> float | None:
    """Two-sided p-value of a paired sign-flip permutation test on the mean of ``diffs`` (one per unit: a
    conversation, a trial round). Under the null each difference is as likely negated: every one of the 2^n sign
    patterns when n <= exact_max, else ``samples`` random ones (fixed seed) with the observed pattern counted among
    them. Zeros carry no sign and count as such. None without a unit."""
    d = np.asarray([x for x in diffs if x is not None], dtype=np.float64)
    n = d.size
    if n == 0:
        return None
    observed = abs(d.mean())
    if observed == 0:
        return 1.0
    tol = 1e-12 * max(observed, 1.0)
    if n <= exact_max:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
        return float(np.mean(np.abs((signs * d).mean(axis=1)) >= observed - tol))
    # Monte-Carlo: the observed sign pattern counts as one of the draws (+1 above and below), so the estimate is a
    # valid p-value and never 0 (Phipson & Smyth 2010)
    signs = np.random.default_rng(seed).choice((-1, 1), size=(samples, n))
    hits = int(np.sum(np.abs((signs * d).mean(axis=1)) >= observed - tol))
    return (hits + 1) / (samples + 1)


def median_interval(values, level: float = LEVEL) -> dict | None:
    """The median with a distribution-free interval from order statistics: the narrowest symmetric pair
    (x_(k), x_(n+1-k)) whose binomial coverage is at least ``level`` (the extremes when n is too small to reach
    it; the coverage actually held is returned)."""
    from math import comb

    x = np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64))
    n = x.size
    if n == 0:
        return None
    k, coverage = 1, 1.0 - 2 * 0.5 ** n
    for j in range(1, n // 2 + 1):
        cov = 1.0 - 2 * sum(comb(n, i) for i in range(j)) / 2 ** n
        if cov >= level:
            k, coverage = j, cov
        else:
            break
    return {"estimate": float(np.median(x)), "low": float(x[k - 1]), "high": float(x[n - k]),
            "level": float(coverage), "units": int(n), "method": "order statistics of trials"}


def paired_ratio(a, b, seed: int = 0) -> dict | None:
    """Trial-paired comparison of two positive figures (round r of a against round r of b): the median ratio
    a/b, the order-statistic interval of the per-round ratios and the sign-flip p-value on their logs."""
    pairs = [(x, y) for x, y in zip(a, b) if x and y and x > 0 and y > 0]
    if not pairs:
        return None
    ratios = [x / y for x, y in pairs]
    iv = median_interval(ratios)
    return {"ratio": iv["estimate"], "low": iv["low"], "high": iv["high"], "rounds": len(pairs),
            "p": sign_flip_p(np.log(ratios), seed)}


def conversation_test(samples: list[dict], seed: int = 0, before: str = "checks_reference",
                      after: str = "checks_variant") -> dict | None:
    """Conversation-level paired test of the variant's checks against the original's: per conversation the
    difference of pass rates (variant - original), a sign-flip permutation test on their mean. Unlike the
    check-level McNemar it does not assume the checks of one conversation are independent."""
    diffs = [(v - r) / n for v, r, n, _ in per_conversation_checks(samples, before, after).values() if n]
    if not diffs:
        return None
    return {"conversations": len(diffs), "mean_difference": float(np.mean(diffs)),
            "p": sign_flip_p(diffs, seed), "test": "sign-flip permutation on per-conversation pass-rate differences"}


def minimum_detectable(samples: list[dict], tf: dict) -> dict:
    """Per suite, what "no difference" is worth: the smallest pass-rate change and mean-KLD ratio that this
    many conversations detect at 80 % power and 5 % two-sided (normal approximation, conversations as units).

    Pass rate: SD of a per-conversation difference taken as sqrt(2) x the SD of the original's per-conversation
    pass rates, floored by the binomial SD of a conversation's checks at the pooled rate. Mean-KLD ratio: the SD
    of log per-conversation mean KLD of this variant, for a comparison of two variants (sqrt(2/n))."""
    out: dict = {}
    per: dict = {}
    for (suite, _), (_, ref, n, _) in per_conversation_checks(samples).items():
        per.setdefault(suite, []).append((ref, n))
    z = Z_975 + Z_80
    for suite, convs in per.items():
        rows = [(p, n) for p, n in convs if n]
        if not rows:
            continue
        n_conv = len(rows)
        rates = np.asarray([p / n for p, n in rows])
        pooled = sum(p for p, _ in rows) / sum(n for _, n in rows)
        pooled_c = min(max(pooled, 0.5 / sum(n for _, n in rows)), 1 - 0.5 / sum(n for _, n in rows))
        binom = np.sqrt(pooled_c * (1 - pooled_c) / np.mean([n for _, n in rows]))
        sd = max(np.sqrt(2) * (rates.std(ddof=1) if n_conv > 1 else 0.0), binom)
        out[suite] = {"conversations": n_conv, "checks": int(sum(n for _, n in rows)),
                      "reference_pass_rate": float(pooled), "mde_pass_rate": float(min(1.0, z * sd / np.sqrt(n_conv))),
                      # a flip needs checks the original passes: under this rate flips are mostly lucky passes
                      "no_signal_for_flips": bool(pooled < NO_SIGNAL_PASS_RATE)}
    for suite, convs in tf.items():
        means = [float(np.mean(c["kld"])) for c in convs.values() if len(c["kld"])]
        means = [m for m in means if m > 0]
        if len(means) > 1:
            s = float(np.std(np.log(means), ddof=1))
            out.setdefault(suite, {"conversations": len(means)})["mde_kld_ratio"] = float(
                np.exp(z * s * np.sqrt(2 / len(means))))
        elif suite in out:
            out[suite]["mde_kld_ratio"] = None
    return out


# ------------------------------------------------------------------ family-wise error

MULTIPLE_COMPARISONS = ("holm", "bonferroni", "none")


def adjust_p(pvalues: dict[str, float | None], method: str = "holm") -> dict[str, float | None]:
    """Family-wise adjusted p-values of one family of tests (one per variant: "is it worse than the original?"),
    so that "significant at alpha" holds for the family, not for each test alone. holm: Holm's step-down (the i-th
    smallest of m p-values times m - i + 1, made monotone, capped at 1; uniformly more powerful than Bonferroni and
    valid under any dependence); bonferroni: each times m; none: unadjusted. A None p-value (no test) stays None
    and is not counted in the family."""
    if method not in MULTIPLE_COMPARISONS:
        raise ValueError(f"unknown multiple-comparison method {method!r}: expected one of {MULTIPLE_COMPARISONS}")
    tested = sorted(((p, name) for name, p in pvalues.items() if p is not None), key=lambda t: (t[0], t[1]))
    out: dict[str, float | None] = {name: None for name in pvalues}
    m = len(tested)
    running = 0.0
    for i, (p, name) in enumerate(tested):
        if method == "none":
            adj = p
        elif method == "bonferroni":
            adj = p * m
        else:
            running = max(running, (m - i) * p)
            adj = running
        out[name] = min(1.0, adj)
    return out
