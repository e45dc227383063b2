"""The speed figures of a run's interleaved trials (pure: the trials file's content in, figures out): a variant's
medians with their 95 % intervals and per-round values, and the A/A noise floor of the control against its own
second measurement. The trials themselves are measured by ``pipeline.stages.speed``."""

from __future__ import annotations

from pipeline.figures.stats import median_interval, paired_ratio

# the trial figures that get a median and an interval (catalogue metrics of the speed and memory sections)
TRIAL_FIGURES = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s", "itl_p99_s", "peak_rss_mb",
                 "device_peak_mb", "load_peak_rss_mb", "steady_rss_mb")
AA_SUFFIX = "#A/A"
# figures a process reads once however many rounds it serves (resident and device memory)
MEMORY_FIGURES = ("peak_rss_mb", "device_peak_mb", "load_peak_rss_mb", "steady_rss_mb")
# how the trials were run (trials.json and summary.speed_protocol "workers")
WORKERS_KEPT = "one per label for the stage"
WORKERS_FRESH = "one per trial"
WORKERS_MIXED = "one per label for the stage where memory allowed, else one per trial"


def trial_figures(trials: list[dict] | None) -> dict:
    """A variant's speed from its trials: medians, 95 % intervals, the per-round values (None for a failed
    round, so rounds stay paired across variants) and the trials' bookkeeping."""
    trials = trials or []
    good = [t for t in trials if "error" not in t]
    values = {f: [t.get(f) if "error" not in t else None for t in trials] for f in TRIAL_FIGURES}
    intervals = {f: iv for f in TRIAL_FIGURES if (iv := median_interval([x for x in values[f] if x is not None]))}
    first = good[0] if good else {}
    noise = [t["cpu_noise"] for t in good if t.get("cpu_noise") is not None]
    return {
        "medians": {f: (intervals[f]["estimate"] if f in intervals else None) for f in TRIAL_FIGURES},
        "intervals": intervals,
        "values": values,
        "trials": len(good),
        "failed_trials": [t["error"] for t in trials if "error" in t],
        "noisy_trials": sum(1 for t in good if t.get("noisy")),
        "cpu_noise": float(sorted(noise)[len(noise) // 2]) if noise else None,
        "load_s": float(sorted(t["load_s"] for t in good)[len(good) // 2]) if good else None,
        "prompt_tokens": first.get("prompt_tokens"), "decode_tokens": first.get("decode_tokens"),
        "repeats": first.get("repeats"), "kv_reported": first.get("kv_reported"),
        "runtime_info": first.get("runtime_info"),
        "device_memory": first.get("device_memory"),     # how the device peak was read (None off CUDA)
    }


def noise_floor(run: dict | None, alpha: float = 0.05) -> dict | None:
    """The A/A comparison: the control against its own second measurement, per figure: the median ratio, its
    interval, the sign-flip p-value, whether they tie (p >= alpha) and the floor (the interval's largest
    distance from 1: two variants closer than this are inside this run's noise). Memory measured in one process
    per label is one reading: its ratio with no test (``single_reading``)."""
    if not run or not run.get("control"):
        return None
    control = run["control"]
    a = trial_figures(run["trials"].get(control))["values"]
    b = trial_figures(run["trials"].get(control + AA_SUFFIX))["values"]
    figures = {}
    one_process = run.get("workers", WORKERS_FRESH) != WORKERS_FRESH
    for f in TRIAL_FIGURES:
        pairs = [(x, y) for x, y in zip(a[f], b[f]) if x is not None and y is not None]
        test = paired_ratio([y for _, y in pairs], [x for x, _ in pairs])
        if test and one_process and f in MEMORY_FIGURES:
            # one process per label for all rounds: its memory is one reading repeated, not a sample of trials;
            # a p-value over its copies would test nothing
            figures[f] = {"ratio": test["ratio"], "low": test["ratio"], "high": test["ratio"], "rounds": 1,
                          "p": None, "tied": None, "floor": abs(test["ratio"] - 1), "single_reading": True}
        elif test:
            figures[f] = {**test, "tied": bool(test["p"] >= alpha),
                          "floor": max(1 - test["low"], test["high"] - 1, abs(test["ratio"] - 1))}
    return {"control": control, "rounds": run["rounds"], "alpha": alpha, "figures": figures,
            "test": "paired sign-flip permutation test on log ratios over interleaved rounds"}


def smallest_p(rounds: int) -> float:
    """The smallest two-sided p an exact sign-flip test over ``rounds`` paired units can give."""
    return 2 / 2 ** rounds if rounds else 1.0


def rounds_to_rank(comparisons: int, alpha: float, correction: str) -> int:
    """The fewest interleaved rounds whose smallest sign-flip p, times the comparisons under a family-wise
    ``correction`` (holm, bonferroni; none: one), is under ``alpha``."""
    m = comparisons if correction != "none" else 1
    return next(n for n in range(1, 64) if smallest_p(n) * m < alpha)
