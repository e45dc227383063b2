"""One step of the ranking: the best of the candidates on one figure and, for every other candidate, the test that
ties it with the best or puts it behind.

- Trial figures (decode tok/s, measured in interleaved rounds): a candidate is behind only when the paired
  sign-flip test over the rounds finds it worse after the family-wise correction (a ranking is a claim that the
  best is better) *and* the difference exceeds the run's noise floor: the A/A pair's largest distance from 1, never
  less than ``decision.tie_tolerance``. A noisy A/A pair widens the floor; it never skips the step, so two
  variants 7× apart still rank. Before testing, a power check: with N rounds the smallest sign-flip p is 2/2^N;
  where that (times the comparisons under the correction) cannot reach alpha the step says "cannot rank".
- Memory as served (one process, one reading: no test), capacity and size: a difference against the tie
  tolerance.
- Drift (mean KLD) ends every chain, paired per conversation: the sign-flip test on the per-conversation
  differences of mean KLD, corrected across the comparisons, and the tie tolerance on the ratio.

A format measured on no native kernel of this device takes no part in a speed or memory step (its figures are
another model's).
"""

from __future__ import annotations

import math

from pipeline.config.commands import DecisionConfig
from pipeline.config.summary_contract import BY_NAME
from pipeline.figures.speed_trials import rounds_to_rank, smallest_p

# objective -> the catalogue metric it optimises (its direction says which way is better)
OBJECTIVES = {"decode_speed": "decode_tokens_per_s", "size": "artifact_bytes", "drift": "kld_mean"}
# objectives computed at the deployment target or read from the load sweep: name -> (label, better)
TARGET_OBJECTIVES = {"memory": ("memory as served", "lower"), "capacity": ("sequences in the budget", "higher")}
LOAD_OBJECTIVES = {"throughput_at_slo": ("aggregate output tokens/s at the workload's targets", "higher")}
# the steps per objective: the objective, then drift among the variants it ties
FALLBACKS = {o: (o, "drift") for o in ("decode_speed", "memory", "capacity", "size", "throughput_at_slo")}
TRIAL_OBJECTIVES = ("decode_speed",)              # measured in interleaved trials, judged against the A/A floor
NATIVE_ONLY = ("decode_speed", "memory", "capacity", "throughput_at_slo")   # need the format's own kernel


def aa_negligible(aa: dict, tolerance: float) -> bool:
    """The A/A pair differs, but its whole interval lies within ``tolerance`` of 1: a systematic difference too
    small to matter, which the ranking's floor (at least the tolerance) already absorbs."""
    return bool(tolerance > 0 and aa.get("low") is not None and aa.get("high") is not None
                and 1 - tolerance <= aa["low"] and aa["high"] <= 1 + tolerance)


def peak_memory_mb(v: dict) -> float | None:
    """The probe's peak where the variant ran: its device peak on a GPU, else the host's peak RSS."""
    device = (v.get("device_memory") or {}).get("peak_mb")
    return device if device is not None else v["memory"]["peak_rss_mb"]


def objective_value(v: dict, objective: str, target: dict | None = None) -> float | None:
    if objective in LOAD_OBJECTIVES:
        return (v.get("load") or {}).get(objective)
    if objective in TARGET_OBJECTIVES:
        if target is None:
            return peak_memory_mb(v) if objective == "memory" else None
        from pipeline.decide.target import at_target

        a = at_target(v, target)
        return a["served_mb"] if objective == "memory" else a["sequences"]
    m = BY_NAME[OBJECTIVES[objective]]
    return v[m.section][m.name]


def better(objective: str) -> str:
    for table in (LOAD_OBJECTIVES, TARGET_OBJECTIVES):
        if objective in table:
            return table[objective][1]
    return BY_NAME[OBJECTIVES[objective]].better


def label(objective: str) -> str:
    for table in (LOAD_OBJECTIVES, TARGET_OBJECTIVES):
        if objective in table:
            return table[objective][0]
    return BY_NAME[OBJECTIVES[objective]].label


def show(objective: str, x: float | None, v: dict | None = None) -> str:
    """An objective's value as the report's tables print it (``v``: the variant, for the load sweep's operating
    point)."""
    if x is None:
        return "not measured"
    if objective in LOAD_OBJECTIVES and v and v.get("load"):
        return (f"{x:.1f} tok/s at {v['load']['throughput_at_slo_concurrency']} concurrent requests, workload "
                f"{v['load']['workload']}")
    if objective == "decode_speed" or objective in LOAD_OBJECTIVES:
        return f"{x:.1f} tok/s"
    if objective == "memory":
        return f"{x:.0f} MB"
    if objective == "capacity":
        return f"{x:.0f} sequences"
    if objective == "drift":
        return f"mean KLD {x:.4f}" if x == 0 or x >= 1e-3 else f"mean KLD {x:.1e}"
    return f"{x / 2**20:.1f} MiB"


def rounds_needed(comparisons: int, d: DecisionConfig) -> int:
    """The fewest rounds whose smallest sign-flip p, times the comparisons under the correction, is under alpha."""
    return rounds_to_rank(comparisons, d.alpha, d.multiple_comparisons)


def _power(rounds: int, comparisons: int, d: DecisionConfig) -> str | None:
    """Why a trial step cannot rank with this many rounds, or None when it can."""
    m = comparisons if d.multiple_comparisons != "none" else 1
    floor_p = min(1.0, smallest_p(rounds) * m)
    if floor_p < d.alpha:
        return None
    return (f"cannot rank with {rounds} rounds: the smallest sign-flip p over {rounds} rounds is "
            f"{smallest_p(rounds):.3f}" + (f", {floor_p:.3f} after the {d.multiple_comparisons} correction over "
                                           f"{m} comparisons" if m > 1 else "") + f", never under alpha {d.alpha} "
            f"(at least {rounds_needed(comparisons, d)} rounds are needed: profile.speed.trials)")


def _trials(v: dict, metric: str) -> list:
    return ((v.get("speed_trials") or {}).get("values") or {}).get(metric) or []


def _conversation_klds(v: dict) -> dict[str, float]:
    per = ((v.get("drift_detail") or {}).get("kld_by_conversation") or {})
    return {c: s / n for c, (s, n) in per.items() if n}


def _drift_tests(ok: dict, eligible: list[str], lead: str, values: dict, d: DecisionConfig) -> dict:
    from pipeline.figures.stats import adjust_p, sign_flip_p

    tests = {}
    base = _conversation_klds(ok[lead])
    for n in eligible[1:]:
        ratio = values[n] / values[lead] if values[lead] else math.inf
        own = _conversation_klds(ok[n])
        common = sorted(set(base) & set(own))
        if common:
            diffs = [own[c] - base[c] for c in common]
            tests[n] = {"ratio": ratio, "p": sign_flip_p(diffs), "units": len(common),
                        "method": "sign-flip test on per-conversation mean KLD differences"}
        else:
            ia, ib = (ok[lead].get("intervals") or {}).get("kld_mean"), (ok[n].get("intervals") or {}).get("kld_mean")
            overlap = bool(ia and ib and ib["low"] <= ia["high"])
            tests[n] = {"ratio": ratio, "p": None, "units": 0, "overlap": overlap,
                        "method": "95 % intervals compared" if ia and ib else "point estimates compared"}
    adjusted = adjust_p({n: t["p"] for n, t in tests.items()}, d.multiple_comparisons)
    for n, t in tests.items():
        t["p_adjusted"] = adjusted[n]
        close = values[n] == values[lead] or (math.isfinite(t["ratio"]) and abs(t["ratio"] - 1) <= d.tie_tolerance)
        if t["p"] is not None:
            t["tied"] = bool(close or t["p_adjusted"] >= d.alpha)
        else:
            t["tied"] = bool(close or t.get("overlap"))
    return tests


def _trial_tests(ok: dict, eligible: list[str], lead: str, metric: str, values: dict, d: DecisionConfig,
                 tolerance: float) -> dict:
    from pipeline.figures.stats import adjust_p, paired_ratio

    tests = {}
    for n in eligible[1:]:
        t = paired_ratio(_trials(ok[n], metric), _trials(ok[lead], metric))
        # without paired trials (a speed stage that did not run for one of them) only the medians compare
        ratio = values[n] / values[lead] if values[lead] else (1.0 if values[n] == values[lead] else math.inf)
        tests[n] = t or {"ratio": ratio, "p": None, "rounds": 0}
    adjusted = adjust_p({n: t["p"] for n, t in tests.items()}, d.multiple_comparisons)
    for n, t in tests.items():
        t["p_adjusted"] = adjusted[n]
        t["method"] = d.multiple_comparisons
        close = abs(t["ratio"] - 1) <= tolerance
        t["tied"] = bool(close if t["p"] is None else (close or t["p_adjusted"] >= d.alpha))
    return tests


def rank_step(ok: dict[str, dict], names: list[str], objective: str, d: DecisionConfig, noise: dict | None,
              target: dict | None = None) -> dict:
    """One step of the ranking over ``names``. Returns {"objective", "label", "status": ranked | cannot rank |
    not measured, "lead", "values", "tests", "tied", "behind", "excluded", "floor", "tolerance", "aa", "why"}."""
    step: dict = {"objective": objective, "label": label(objective), "values": {}, "tests": {}, "excluded": {},
                  "floor": None, "aa": None, "why": None, "tolerance": d.tie_tolerance}
    eligible = []
    for n in names:
        v = ok[n]
        if objective in NATIVE_ONLY and v.get("no_native_kernel"):
            step["excluded"][n] = v["no_native_kernel"]
        elif (x := objective_value(v, objective, target)) is None or (isinstance(x, float) and not math.isfinite(x)):
            step["excluded"][n] = "not measured"
        else:
            eligible.append(n)
            step["values"][n] = x
    if not eligible:
        return {**step, "status": "not measured", "lead": None, "tied": list(names), "behind": [],
                "why": f"{step['label']} is not measured for any of them"}
    sign = -1 if better(objective) == "higher" else 1
    eligible.sort(key=lambda n: (sign * step["values"][n], n))
    lead = eligible[0]
    values = step["values"]
    if objective in TRIAL_OBJECTIVES:
        metric = OBJECTIVES[objective]
        aa = ((noise or {}).get("figures") or {}).get(metric)
        step["aa"] = aa
        step["floor"] = aa["floor"] if aa else 0.0
        step["tolerance"] = tolerance = max(step["floor"], d.tie_tolerance)
        # the power check over the variants measured in rounds (one without trials compares on its median only)
        rounds = [r for n in eligible if (r := len([x for x in _trials(ok[n], metric) if x]))]
        if len(eligible) > 1 and rounds and (why := _power(min(rounds), len(eligible) - 1, d)):
            return {**step, "status": "cannot rank", "lead": None, "tied": list(names), "behind": [],
                    "rounds": min(rounds), "why": f"{step['label']} {why}"}
        tests = _trial_tests(ok, eligible, lead, metric, values, d, tolerance)
    elif objective == "drift":
        tests = _drift_tests(ok, eligible, lead, values, d)
    elif objective in LOAD_OBJECTIVES:
        tests = {}
        ia = (ok[lead].get("load") or {}).get("throughput_at_slo_interval")
        for n in eligible[1:]:
            ib = (ok[n].get("load") or {}).get("throughput_at_slo_interval")
            ratio = values[n] / values[lead] if values[lead] else float("nan")
            overlap = bool(ia and ib and ib["high"] >= ia["low"] and ia["high"] >= ib["low"])
            tests[n] = {"ratio": ratio, "overlap": overlap, "method": "overlap of the load sweep's ranges over rounds",
                        "tied": bool(overlap or abs(ratio - 1) <= d.tie_tolerance)}
    else:            # one reading each (memory as served, capacity, size): the difference against the tolerance
        tests = {}
        for n in eligible[1:]:
            ratio = values[n] / values[lead] if values[lead] else (1.0 if values[n] == values[lead] else math.inf)
            tests[n] = {"ratio": ratio, "method": "one reading each: the difference against the tie tolerance",
                        "tied": bool(abs(ratio - 1) <= d.tie_tolerance)}
    tied = [lead] + [n for n in eligible[1:] if tests[n]["tied"]]
    behind = [n for n in eligible[1:] if not tests[n]["tied"]]
    return {**step, "status": "ranked", "lead": lead, "tests": tests, "tied": tied, "behind": behind}


def verdict_words(step: dict, n: str, d: DecisionConfig, ok: dict) -> str:
    """What the test of ``n`` against the step's best says, in the numbers the report's tables print."""
    t, lead, obj = step["tests"][n], step["lead"], step["objective"]
    head = f"{show(obj, step['values'][n], ok[n])} against {lead}'s {show(obj, step['values'][lead], ok[lead])}"
    ratio = f"{t['ratio']:.2f}×" if math.isfinite(t.get("ratio", math.nan)) else "no ratio (the best's is 0)"
    if obj in TRIAL_OBJECTIVES:
        if t.get("p") is None:
            return (f"{head}: {ratio}, no paired trials: medians compared "
                    + (f"within ±{step['tolerance']:.0%}" if t["tied"] else f"beyond ±{step['tolerance']:.0%}"))
        words = (f"{head}: {ratio} [{t['low']:.2f}, {t['high']:.2f}] over {t['rounds']} interleaved "
                 f"trials, sign-flip p={t['p']:.3f}, {t['method']}-adjusted p={t['p_adjusted']:.3f}")
        floor = f"the noise floor ±{step['tolerance']:.0%}"
        if not t["tied"]:
            return words + f" < {d.alpha}, outside {floor}"
        if t["p_adjusted"] >= d.alpha:
            return words + f" ≥ {d.alpha}"
        return words + f", inside {floor}"
    if obj == "drift":
        if t.get("p") is None:
            return f"{head}: {ratio}, {t['method']}" + (", overlapping" if t.get("overlap") else "")
        verdict = ("within the tie tolerance" if t["tied"] and abs(t["ratio"] - 1) <= d.tie_tolerance
                   else f"≥ {d.alpha}" if t["tied"] else f"< {d.alpha}")
        return (f"{head}: {ratio}, paired over {t['units']} conversations: sign-flip p={t['p']:.3f}, "
                f"{d.multiple_comparisons}-adjusted p={t['p_adjusted']:.3f} {verdict}")
    if obj in LOAD_OBJECTIVES:
        return f"{head}: {ratio}, the load sweep's ranges {'overlap' if t['overlap'] else 'do not overlap'}"
    return f"{head}: {ratio}" + (f", within ±{d.tie_tolerance:.0%}" if t["tied"] else
                                 f", beyond ±{d.tie_tolerance:.0%}")
