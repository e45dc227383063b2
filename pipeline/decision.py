"""The decision: the variant to ship by an objective among those meeting every constraint, the Pareto front over
(mean KLD, decode tokens/s, peak memory), and for every other variant why it lost."""

from __future__ import annotations

from pipeline.catalogue import BY_NAME
from pipeline.config import DecisionConfig

# objective -> the catalogue metric it optimises (its direction says which way is better)
OBJECTIVES = {"decode_speed": "decode_tokens_per_s", "memory": "peak_rss_mb", "size": "artifact_bytes"}


def objective_value(v: dict, objective: str) -> float | None:
    m = BY_NAME[OBJECTIVES[objective]]
    return v[m.section][m.name]


def _rank_key(v: dict, objective: str) -> float:
    """Lower ranks first, whatever the metric's direction; an unmeasured value ranks last."""
    x = objective_value(v, objective)
    if x is None:
        return float("inf")
    return -x if BY_NAME[OBJECTIVES[objective]].better == "higher" else x


def _fmt_objective(objective: str, v: dict) -> str:
    x = objective_value(v, objective)
    if objective == "decode_speed":
        return f"{x:.1f} tok/s"
    if objective == "memory":
        return f"{x:.0f} MB"
    return f"{x / 2**20:.1f} MiB"


def failed_constraints(v: dict, original: dict | None, d: DecisionConfig) -> list[tuple[str, float]]:
    """Every constraint the variant fails: (message, relative violation), in the configured order."""
    dr, sp, mem = v["drift"], v["speed"], v["memory"]
    checks = [
        (d.max_kld_mean, dr["kld_mean"], lambda lim, x: x <= lim, "mean KLD {x:.4f} > {lim}"),
        (d.max_kld_p99, dr["kld_p99"], lambda lim, x: x <= lim, "p99 KLD {x:.4f} > {lim}"),
        (d.max_flip_rate, dr["flip_rate"], lambda lim, x: x <= lim, "flip rate {x:.1%} > {lim:.0%}"),
        (d.min_decode_tokens_per_s, sp["decode_tokens_per_s"], lambda lim, x: x >= lim, "decode {x:.1f} tok/s < {lim}"),
        (d.max_peak_rss_mb, mem["peak_rss_mb"], lambda lim, x: x <= lim, "peak RSS {x:.0f} MB > {lim}"),
        (d.max_artifact_bytes, mem["artifact_bytes"], lambda lim, x: x <= lim, "artifact {x} bytes > {lim}"),
    ]
    if d.min_pass_rate_ratio is not None and original and original["drift"]["pass_rate"]:
        ratio = (dr["pass_rate"] or 0.0) / original["drift"]["pass_rate"]
        checks.append((d.min_pass_rate_ratio, ratio, lambda lim, x: x >= lim, "pass rate {x:.0%} of the original's < {lim:.0%}"))
    out = []
    for limit, value, ok, msg in checks:
        if limit is None:
            continue
        if value is None:
            out.append((msg.split(" {")[0] + " not measured", float("inf")))
        elif not ok(limit, value):
            out.append((msg.format(x=value, lim=limit), abs(value - limit) / max(abs(limit), 1e-12)))
    return out


def first_failed_constraint(v: dict, original: dict | None, d: DecisionConfig) -> str | None:
    failed = failed_constraints(v, original, d)
    return failed[0][0] if failed else None


def pareto_point(v: dict) -> tuple[float, float, float] | None:
    """(drift, -decode tokens/s, memory): all lower-is-better, for the Pareto front."""
    k, tps, mem = v["drift"]["kld_mean"], v["speed"]["decode_tokens_per_s"], v["memory"]["peak_rss_mb"]
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


def decide(variants: dict[str, dict], d: DecisionConfig) -> dict:
    """The recommended variant by the objective among those meeting every constraint, the Pareto front over
    (mean KLD, decode tokens/s, peak memory), and for every other variant why it lost: the first constraint it
    failed, else the variant that dominates it, else that it ranks behind on the objective."""
    metric = BY_NAME[OBJECTIVES[d.objective]]
    label = metric.label
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    original = ok.get("original")
    points = {n: p for n, v in ok.items() if (p := pareto_point(v)) is not None}
    front = pareto_front(points)
    reasons: dict[str, str] = {}
    failed_by: dict[str, str] = {}
    passing = []
    for name, v in ok.items():
        failed = first_failed_constraint(v, original, d)
        if failed:
            failed_by[name] = failed
            reasons[name] = f"fails constraint: {failed}"
        else:
            passing.append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            reasons[name] = f"{v['status']}: {v.get('reason')}"
    base = {"objective": d.objective, "decision": d.name, "pareto_front": front,
            "pareto_axes": ["mean KLD (lower)", "decode tokens/s (higher)", "peak RSS MB (lower)"]}
    if not passing:
        # closest: the fewest constraints failed, then the smallest relative violation of them
        def distance(n: str) -> tuple[int, float]:
            f = failed_constraints(ok[n], original, d)
            return len(f), sum(x for _, x in f)

        closest = min(ok, key=lambda n: (*distance(n), n)) if ok else None
        return {**base, "variant": None,
                "summary": f"no variant meets every constraint of decision '{d.name}'"
                           + (f"; closest: {closest} ({failed_by.get(closest, '')})" if closest else ""),
                "closest": closest, "reasons": reasons}
    passing.sort(key=lambda n: (_rank_key(ok[n], d.objective), n))
    lead = _rank_key(ok[passing[0]], d.objective)
    tied = [n for n in passing if abs(_rank_key(ok[n], d.objective) - lead) <= d.tie_tolerance * abs(lead)]
    best = min(tied, key=lambda n: (ok[n]["drift"]["kld_mean"] if ok[n]["drift"]["kld_mean"] is not None
                                    else float("inf"), n))
    passing = [best] + [n for n in passing if n != best]
    worse_word = "lower" if metric.better == "higher" else "higher"
    for name in passing[1:]:
        dom = dominator(name, points) if name in points else None
        if name in tied:
            reasons[name] = (f"meets every constraint and its {label} is within {d.tie_tolerance:.0%} of the best "
                             f"(a tie), but {best} drifts less")
        elif dom:
            reasons[name] = (f"meets every constraint but is dominated by {dom} (at least as low drift, as fast "
                             "and as small, better on one)")
        else:
            reasons[name] = (f"meets every constraint and is on the Pareto front, but its {label} "
                             f"({_fmt_objective(d.objective, ok[name])}) is {worse_word} than {best}'s "
                             f"({_fmt_objective(d.objective, ok[best])})")
    b = ok[best]
    tie_note = (f" (ties within {d.tie_tolerance:.0%}: {', '.join(n for n in tied if n != best)}; lowest drift wins)"
                if len(tied) > 1 else "")
    reasons[best] = (f"best {label} ({_fmt_objective(d.objective, b)}){tie_note} among variants meeting every "
                     f"constraint; mean KLD {b['drift']['kld_mean']:.4f}, flip rate {(b['drift']['flip_rate'] or 0):.1%}")
    return {**base, "variant": best, "summary": reasons[best], "reasons": reasons}
