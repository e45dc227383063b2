"""The decision: the variant to ship by an objective among those meeting every constraint, the Pareto front over
(mean KLD, decode tokens/s, peak memory), and for every other variant why it lost."""

from __future__ import annotations

from pipeline.config.summary_contract import BY_NAME
from pipeline.config.commands import DecisionConfig

# objective -> the catalogue metric it optimises (its direction says which way is better)
OBJECTIVES = {"decode_speed": "decode_tokens_per_s", "memory": "peak_rss_mb", "size": "artifact_bytes"}
# objectives read from the load sweep (pipeline.stages.load, ``v["load"]``), not the catalogue: name -> (label, better)
LOAD_OBJECTIVES = {"throughput_at_slo": ("aggregate output tokens/s at the workload's targets", "higher")}


def peak_memory_mb(v: dict) -> float | None:
    """The memory a variant needs where it runs: its device peak on a GPU, else the host's peak RSS."""
    device = (v.get("device_memory") or {}).get("peak_mb")
    return device if device is not None else v["memory"]["peak_rss_mb"]


def objective_value(v: dict, objective: str) -> float | None:
    if objective in LOAD_OBJECTIVES:
        return (v.get("load") or {}).get(objective)
    if objective == "memory":
        return peak_memory_mb(v)
    m = BY_NAME[OBJECTIVES[objective]]
    return v[m.section][m.name]


def _rank_key(v: dict, objective: str) -> float:
    """Lower ranks first, whatever the metric's direction; an unmeasured value ranks last."""
    x = objective_value(v, objective)
    if x is None:
        return float("inf")
    return -x if _better(objective) == "higher" else x


def _better(objective: str) -> str:
    return LOAD_OBJECTIVES[objective][1] if objective in LOAD_OBJECTIVES else BY_NAME[OBJECTIVES[objective]].better


def _fmt_objective(objective: str, v: dict) -> str:
    x = objective_value(v, objective)
    if x is None:
        return "not measured"
    if objective in LOAD_OBJECTIVES:
        load = v["load"]
        return (f"{x:.1f} tok/s at {load['throughput_at_slo_concurrency']} concurrent requests, workload "
                f"{load['workload']}")
    if objective == "decode_speed":
        return f"{x:.1f} tok/s"
    if objective == "memory":
        return f"{x:.0f} MB"
    return f"{x / 2**20:.1f} MiB"


# constraint -> (catalogue metric, "max" | "min", message format, the interval key used under confidence=upper)
CONSTRAINTS = (
    ("max_kld_mean", "kld_mean", "max", "mean KLD {x}", "kld_mean"),
    ("max_kld_p99", "kld_p99", "max", "p99 KLD {x}", None),
    ("max_flip_rate", "flip_rate", "max", "flip rate {x}", "flip_rate"),
    ("min_pass_rate_ratio", "pass_rate_ratio", "min", "pass rate {x} of the original's", "pass_rate_ratio"),
    ("min_decode_tokens_per_s", "decode_tokens_per_s", "min", "decode {x} tok/s", "decode_tokens_per_s"),
    ("max_peak_rss_mb", "peak_rss_mb", "max", "peak RSS {x} MB", "peak_rss_mb"),
    ("max_artifact_bytes", "artifact_bytes", "max", "artifact {x} bytes", None),
)
_FMT = {"kld_mean": ".4f", "kld_p99": ".4f", "flip_rate": ".1%", "pass_rate_ratio": ".0%",
        "decode_tokens_per_s": ".1f", "peak_rss_mb": ".0f", "artifact_bytes": "d"}


def _constraint_value(v: dict, metric: str):
    if metric == "pass_rate_ratio":
        return ((v.get("intervals") or {}).get("pass_rate_ratio") or {}).get("estimate")
    return v[BY_NAME[metric].section][metric]


def _f(metric: str, x) -> str:
    return format(int(x) if _FMT[metric] == "d" else x, _FMT[metric])


def judge_constraints(v: dict, d: DecisionConfig) -> list[dict]:
    """Every configured constraint the variant does not clearly meet: {"constraint", "verdict": fail | undecided |
    not measurable, "message", "violation"} in the configured order.

    confidence=point judges the point estimate. confidence=upper judges the 95 % interval where the figure has
    one: a limit inside the interval is "undecided" (neither passes nor fails; the variant is not recommended),
    the whole interval on the wrong side fails. "not measurable" (a pass-rate ratio when the original passes no
    check) is reported, never judged. A variant whose checks drop significantly below the original's in the
    conversation-level sign-flip test (p < decision.max_pass_drop_p) fails too."""
    out = []
    intervals = v.get("intervals") or {}
    for key, metric, kind, msg, iv_key in CONSTRAINTS:
        limit = getattr(d, key)
        if limit is None:
            continue
        x = _constraint_value(v, metric)
        over = (lambda a: a > limit) if kind == "max" else (lambda a: a < limit)
        sign = ">" if kind == "max" else "<"
        lim_s = _f(metric, limit) if metric not in ("flip_rate", "pass_rate_ratio") else format(limit, ".0%")
        if x is None:
            if metric == "pass_rate_ratio":
                out.append({"constraint": key, "verdict": "not measurable", "violation": 0.0,
                            "message": "pass-rate ratio not measurable: the original passes none of the checks"})
            else:
                out.append({"constraint": key, "verdict": "fail", "violation": float("inf"),
                            "message": msg.format(x="").replace("  ", " ").strip() + " not measured"})
            continue
        iv = intervals.get(iv_key) if (iv_key and d.confidence == "upper") else None
        if iv and iv.get("low") is not None and iv.get("high") is not None:
            bad_side, good_side = (iv["low"], iv["high"]) if kind == "max" else (iv["high"], iv["low"])
            shown = f"{_f(metric, x)} [{_f(metric, iv['low'])}, {_f(metric, iv['high'])}]"
            if over(bad_side):
                verdict = "fail"
            elif over(good_side):
                verdict = "undecided"
            else:
                continue
            text = (msg.format(x=shown) + f" {sign} {lim_s}" if verdict == "fail"
                    else msg.format(x=shown) + f": its 95 % interval straddles the limit {lim_s}")
        elif over(x):
            verdict, text = "fail", msg.format(x=_f(metric, x)) + f" {sign} {lim_s}"
        else:
            continue
        out.append({"constraint": key, "verdict": verdict, "message": text,
                    "violation": abs(x - limit) / max(abs(limit), 1e-12)})
    test = (v.get("free_running") or {}).get("conversation_test")
    if d.max_pass_drop_p is not None and test and test["p"] is not None and test["mean_difference"] < 0 \
            and test["p"] < d.max_pass_drop_p:
        out.append({"constraint": "max_pass_drop_p", "verdict": "fail", "violation": -test["mean_difference"],
                    "message": f"checks significantly worse than the original's (per-conversation pass rate "
                               f"{test['mean_difference']:+.0%}, sign-flip p={test['p']:.3f} < {d.max_pass_drop_p})"})
    return out


def failed_constraints(v: dict, original: dict | None, d: DecisionConfig) -> list[tuple[str, float]]:
    """The constraints the variant fails or leaves undecided: (message, relative violation)."""
    return [(("undecided: " if c["verdict"] == "undecided" else "") + c["message"], c["violation"])
            for c in judge_constraints(v, d) if c["verdict"] in ("fail", "undecided")]


def first_failed_constraint(v: dict, original: dict | None, d: DecisionConfig) -> str | None:
    failed = failed_constraints(v, original, d)
    return failed[0][0] if failed else None


def pareto_point(v: dict) -> tuple[float, float, float] | None:
    """(drift, -decode tokens/s, memory): all lower-is-better, for the Pareto front."""
    k, tps, mem = v["drift"]["kld_mean"], v["speed"]["decode_tokens_per_s"], peak_memory_mb(v)
    if k is None or tps is None or mem is None:
        return None
    return (k, -tps, mem)


def pareto_front(points: dict[str, tuple[float, ...]]) -> list[str]:
    """Names not dominated by any other point; every coordinate is 'lower is better'."""
    front = []
    for name, p in points.items():
        dominated = any(all(q_i <= p_i for q_i, p_i in zip(q, p)) and any(q_i < p_i for q_i, p_i in zip(q, p))
                        for other, q in points.items() if other != name)
        if not dominated:
            front.append(name)
    return front


def dominator(name: str, points: dict[str, tuple[float, ...]]) -> str | None:
    """A variant that is at least as good on every coordinate and better on one (the best such by the sum of
    relative improvements), or None."""
    p = points[name]
    best, best_gain = None, -1.0
    for other, q in points.items():
        if other == name:
            continue
        if all(q_i <= p_i for q_i, p_i in zip(q, p)) and any(q_i < p_i for q_i, p_i in zip(q, p)):
            gain = sum((p_i - q_i) / max(abs(p_i), 1e-12) for q_i, p_i in zip(q, p))
            if gain > best_gain:
                best, best_gain = other, gain
    return best


def speed_tie(a: dict, b: dict, objective: str, d: DecisionConfig) -> dict | None:
    """Whether b ties a on a measured (noisy) objective: the paired sign-flip test over their interleaved speed
    trials finds no significant difference (p >= decision.alpha), or the difference is under
    decision.tie_tolerance. None when the objective is not measured in trials (artifact size)."""
    from pipeline.measure.stats import paired_ratio

    if objective in LOAD_OBJECTIVES:
        return _load_tie(a, b, d)
    metric = OBJECTIVES[objective]
    if objective == "memory" and (a.get("device_memory") or {}).get("peak_mb") is not None:
        metric = "device_peak_mb"        # trials record both; on a GPU the device's is the one that binds
    ta = ((a.get("speed_trials") or {}).get("values") or {}).get(metric)
    tb = ((b.get("speed_trials") or {}).get("values") or {}).get(metric)
    if not ta or not tb:
        return None
    test = paired_ratio(tb, ta)
    if test is None:
        return None
    return {**test, "tied": bool(test["p"] >= d.alpha or abs(test["ratio"] - 1) <= d.tie_tolerance)}


def _load_tie(a: dict, b: dict, d: DecisionConfig) -> dict | None:
    """throughput_at_slo ties when the two variants' ranges over the load sweep's rounds overlap (a difference
    inside the noise decides nothing) or differ by under decision.tie_tolerance."""
    ia, ib = (a.get("load") or {}).get("throughput_at_slo_interval"), (b.get("load") or {}).get("throughput_at_slo_interval")
    if not ia or not ib:
        return None
    ratio = ib["estimate"] / ia["estimate"] if ia["estimate"] else float("nan")
    overlap = ib["high"] >= ia["low"] and ia["high"] >= ib["low"]
    return {"ratio": ratio, "low": ib["low"] / ia["high"] if ia["high"] else float("nan"),
            "high": ib["high"] / ia["low"] if ia["low"] else float("nan"), "rounds": ia.get("units"),
            "p": 1.0 if overlap else 0.0, "tied": bool(overlap or abs(ratio - 1) <= d.tie_tolerance),
            "method": "overlap of the load sweep's ranges over rounds"}


def decide(variants: dict[str, dict], d: DecisionConfig) -> dict:
    """The recommended variant by the objective among those meeting every constraint, the Pareto front over
    (mean KLD, decode tokens/s, peak memory), and for every other variant why it lost: the first constraint it
    failed (or left undecided), else the variant that dominates it, else that it ranks behind on the objective.

    Ties on the objective: a speed or memory figure measured in interleaved trials ties the best when the paired
    test over the trials finds no significant difference or the difference is under decision.tie_tolerance; a
    figure without trials ties within decision.tie_tolerance. Among tied variants the lowest mean KLD wins."""
    label = LOAD_OBJECTIVES[d.objective][0] if d.objective in LOAD_OBJECTIVES else BY_NAME[OBJECTIVES[d.objective]].label
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    original = ok.get("original")
    points = {n: p for n, v in ok.items() if (p := pareto_point(v)) is not None}
    front = pareto_front(points)
    reasons: dict[str, str] = {}
    failed_by: dict[str, str] = {}
    passing, undecided, not_measurable = [], [], {}
    for name, v in ok.items():
        judged = judge_constraints(v, d)
        fails = [c for c in judged if c["verdict"] == "fail"]
        open_ = [c for c in judged if c["verdict"] == "undecided"]
        notes = [c["message"] for c in judged if c["verdict"] == "not measurable"]
        if notes:
            not_measurable[name] = notes
        if fails:
            failed_by[name] = fails[0]["message"]
            reasons[name] = f"fails constraint: {fails[0]['message']}"
        elif open_:
            failed_by[name] = "undecided: " + open_[0]["message"]
            undecided.append(name)
            reasons[name] = ("undecided: " + "; ".join(c["message"] for c in open_)
                             + " (decision.confidence=upper: only a variant whose interval clears the limit passes)")
        else:
            passing.append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            reasons[name] = f"{v['status']}: {v.get('reason')}"
    base = {"objective": d.objective, "decision": d.name, "confidence": d.confidence, "pareto_front": front,
            "pareto_axes": ["mean KLD (lower)", "decode tokens/s (higher)", "peak RSS MB (lower)"],
            "undecided": undecided, "not_measurable": not_measurable, "ties": {}}

    def with_notes(text: str, name: str) -> str:
        return text + "".join(f"; {m}" for m in not_measurable.get(name, []))

    if not passing:
        # closest: the fewest constraints failed, then the smallest relative violation of them
        def distance(n: str) -> tuple[int, float]:
            f = failed_constraints(ok[n], original, d)
            return len(f), sum(x for _, x in f)

        closest = min(ok, key=lambda n: (*distance(n), n)) if ok else None
        return {**base, "variant": None,
                "summary": f"no variant meets every constraint of decision '{d.name}'"
                           + (f" ({len(undecided)} undecided: {', '.join(undecided)})" if undecided else "")
                           + (f"; closest: {closest} ({failed_by.get(closest, '')})" if closest else ""),
                "closest": closest, "reasons": {n: with_notes(r, n) for n, r in reasons.items()}}
    if d.objective in LOAD_OBJECTIVES and all(objective_value(ok[n], d.objective) is None for n in passing):
        return {**base, "variant": None, "closest": None,
                "summary": f"objective {d.objective} needs the load sweep of this run (make load, or quantdrift "
                           "command=load), and no variant meeting every constraint has a level meeting the "
                           "workload's targets in it",
                "reasons": {n: with_notes(r, n) for n, r in reasons.items()}}
    passing.sort(key=lambda n: (_rank_key(ok[n], d.objective), n))
    lead_name = passing[0]
    lead = _rank_key(ok[lead_name], d.objective)
    ties: dict[str, dict] = {}
    tied = [lead_name]
    for n in passing[1:]:
        test = speed_tie(ok[lead_name], ok[n], d.objective, d)
        if test is not None:
            ties[n] = test
            if test["tied"]:
                tied.append(n)
        elif abs(_rank_key(ok[n], d.objective) - lead) <= d.tie_tolerance * abs(lead):
            tied.append(n)
    best = min(tied, key=lambda n: (ok[n]["drift"]["kld_mean"] if ok[n]["drift"]["kld_mean"] is not None
                                    else float("inf"), n))
    passing = [best] + [n for n in passing if n != best]
    worse_word = "lower" if _better(d.objective) == "higher" else "higher"

    def tie_words(n: str) -> str:
        t = ties.get(n)
        if t is None:
            return f"within {d.tie_tolerance:.0%} of the best"
        return (f"{t['ratio']:.2f}× {lead_name}'s [{t['low']:.2f}, {t['high']:.2f}] over {t['rounds']} interleaved "
                f"trials, sign-flip p={t['p']:.2f}" + (f" ≥ {d.alpha}" if t["p"] >= d.alpha
                                                      else f", within {d.tie_tolerance:.0%}"))

    for name in passing[1:]:
        dom = dominator(name, points) if name in points else None
        if name in tied:
            reasons[name] = f"meets every constraint and its {label} ties the best ({tie_words(name)}), but {best} drifts less"
        elif dom:
            reasons[name] = (f"meets every constraint but is dominated by {dom} (at least as low drift, as fast "
                             "and as small, better on one)")
        else:
            t = ties.get(name)
            sig = (f"; {t['ratio']:.2f}× {lead_name}'s over {t['rounds']} interleaved trials, sign-flip "
                   f"p={t['p']:.3f}" if t else "")
            reasons[name] = (f"meets every constraint and is on the Pareto front, but its {label} "
                             f"({_fmt_objective(d.objective, ok[name])}) is {worse_word} than {best}'s "
                             f"({_fmt_objective(d.objective, ok[best])}){sig}")
    b = ok[best]
    tie_note = (f" (ties: {', '.join(n for n in tied if n != best)}; lowest drift wins)" if len(tied) > 1 else "")
    reasons[best] = (f"best {label} ({_fmt_objective(d.objective, b)}){tie_note} among variants meeting every "
                     f"constraint; mean KLD {b['drift']['kld_mean']:.4f}, flip rate {(b['drift']['flip_rate'] or 0):.1%}")
    return {**base, "variant": best, "summary": with_notes(reasons[best], best), "ties": ties,
            "reasons": {n: with_notes(r, n) for n, r in reasons.items()}}
