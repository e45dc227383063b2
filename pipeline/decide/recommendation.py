"""The decision: the variant to ship, and for every other variant why it lost, each reason a statement of a test
that ran.

1. Constraints, per variant (``pipeline.decide.constraints``): finite figures, drift limits on their 95 %
   intervals, the checks' non-inferiority, degeneration, and the deployment target (memory as served at the
   workload; latency targets where enforced). A variant that does not show it meets them is not shipped.
2. The objective ranks the rest (``pipeline.decide.ranking``) with the run's noise floor as its tolerance.
3. Ties go to quality: among the variants the objective ties, the lowest drift (mean KLD, tested paired per
   conversation) is shipped; where nothing separates them on drift either, the lower point estimate, and the
   headline says so. Memory decides only through the budget (a variant that does not fit fails) or as the
   objective.
4. The headline names the figure that decided, its value for the pick and the runner-up, and whether any eligible
   variant meets the workload's latency targets.
"""

from __future__ import annotations

from pipeline.config.commands import DecisionConfig
from pipeline.decide.constraints import judge_constraints, pass_drop_tests
from pipeline.decide.ranking import (FALLBACKS, LOAD_OBJECTIVES, NATIVE_ONLY, label, objective_value, rank_step,
                                     show, verdict_words)
from pipeline.decide.ranking import aa_negligible, peak_memory_mb  # noqa: F401  (the report's names for them)


def pareto_point(v: dict) -> tuple[float, float, float] | None:
    """(drift, -decode tokens/s, memory): all lower-is-better, for the Pareto front (a variant measured on no
    native kernel has no speed or memory of its format, so no point)."""
    if v.get("no_native_kernel"):
        return None
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


def _judge(variants: dict, d: DecisionConfig, target: dict | None) -> dict:
    """Every variant's constraints: {"passing", "undecided", "failed" {name: (count, violation)}, "reasons",
    "not_measurable", "drops"}."""
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    drops = pass_drop_tests(ok, d)
    out = {"passing": [], "undecided": [], "failed": {}, "reasons": {}, "not_measurable": {}, "drops": drops}
    for name, v in ok.items():
        judged = judge_constraints(v, d, drops.get(name), ok.get("original"), target)
        fails = [c for c in judged if c["verdict"] == "fail"]
        open_ = [c for c in judged if c["verdict"] == "undecided"]
        notes = [c["message"] for c in judged if c["verdict"] == "not measurable"]
        if notes:
            out["not_measurable"][name] = notes
        if fails:
            out["failed"][name] = (len(fails), sum(min(c["violation"], 1e9) for c in fails))
            out["reasons"][name] = f"fails constraint: {fails[0]['message']}"
        elif open_:
            out["failed"][name] = (len(open_), sum(c["violation"] for c in open_))
            out["undecided"].append(name)
            out["reasons"][name] = ("undecided: " + "; ".join(c["message"] for c in open_)
                                    + " (only a variant whose interval clears the limit passes)")
        else:
            out["passing"].append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            out["reasons"][name] = f"{v['status']}: {v.get('reason')}"
    return out


def _runner_up(steps: list[dict], best: str) -> tuple[dict | None, str | None]:
    """The step that decided and the variant closest behind the pick there."""
    for step in reversed(steps):
        if step["status"] == "ranked" and step["lead"] == best and len(step["values"]) > 1:
            others = [n for n in step["tests"]]
            return step, (others[0] if others else None)
    return None, None


def decide(variants: dict[str, dict], d: DecisionConfig, noise: dict | None = None,
           target: dict | None = None) -> dict:
    """The recommended variant, the steps of its ranking with every test they ran, the Pareto front over (mean KLD,
    decode tokens/s, peak memory), and for every other variant why it lost: the first constraint it failed (or left
    undecided), else the step that put it behind the best, with the test. ``noise``: the speed stage's A/A result
    (``pipeline.figures.speed_trials.noise_floor``); ``target``: the deployment target (``pipeline.decide.target``)."""
    from pipeline.decide.target import at_target, latency_statement, where

    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    points = {n: p for n, v in ok.items() if (p := pareto_point(v)) is not None}
    j = _judge(variants, d, target)
    reasons, passing, undecided, failed = j["reasons"], list(j["passing"]), j["undecided"], j["failed"]
    base = {"objective": d.objective, "decision": d.name, "confidence": d.confidence,
            "multiple_comparisons": d.multiple_comparisons, "alpha": d.alpha,
            "pareto_front": pareto_front(points),
            "pareto_axes": ["mean KLD (lower)", "decode tokens/s (higher)", "peak RSS MB (lower)"],
            "undecided": undecided, "not_measurable": j["not_measurable"], "pass_drop": j["drops"], "steps": [],
            "target": target, "decided_by": None, "latency": None,
            "at_target": {n: at_target(v, target) for n, v in ok.items()} if target else {}}

    def finish(out: dict) -> dict:
        out["reasons"] = {n: r + "".join(f"; {m}" for m in j["not_measurable"].get(n, []))
                          for n, r in reasons.items()}
        if out["variant"]:
            out["summary"] = out["reasons"][out["variant"]]
        return out

    if not passing:
        closest = min(failed, key=lambda n: (*failed[n], n)) if failed else None
        return finish({**base, "variant": None, "closest": closest,
                       "summary": f"no variant meets every constraint of decision '{d.name}'"
                                  + (f" ({len(undecided)} undecided: {', '.join(undecided)})" if undecided else "")
                                  + (f"; closest: {closest} ({reasons[closest]})" if closest else "")})
    if d.objective in LOAD_OBJECTIVES and all(objective_value(ok[n], d.objective) is None for n in passing):
        return finish({**base, "variant": None, "closest": None,
                       "summary": f"objective {d.objective} needs the load sweep of this run (make load, or "
                                  "quantdrift command=load), and no variant meeting every constraint has a level "
                                  "meeting the workload's targets in it"})
    if d.objective in NATIVE_ONLY:
        for n in [n for n in passing if ok[n].get("no_native_kernel")]:
            reasons[n] = (f"meets every constraint, but {ok[n]['no_native_kernel']}: its speed and memory are not "
                          f"the format's, so it is not ranked on {label(d.objective)}")
            passing.remove(n)
        if not passing:
            return finish({**base, "variant": None, "closest": None,
                           "summary": f"no variant meeting every constraint of decision '{d.name}' ran on a native "
                                      f"kernel of this device, so none can be ranked on {label(d.objective)}"})
    eligible = list(passing)
    candidates, history = list(passing), {n: [] for n in passing}
    for objective in FALLBACKS[d.objective]:
        if len(candidates) <= 1:
            break
        step = rank_step(ok, candidates, objective, d, noise, target)
        base["steps"].append(step)
        if step["status"] == "cannot rank":
            # the run cannot answer the objective's question: no pick on it, the highest fidelity named beside
            by_drift = sorted(candidates, key=lambda n: (ok[n]["drift"]["kld_mean"], n))
            for n in candidates:
                reasons[n] = f"meets every constraint; {step['why']}"
            return finish({**base, "variant": None, "closest": by_drift[0],
                           "summary": f"{step['why']}; of the {len(candidates)} variants ranked on "
                                      f"{label(d.objective)} the highest fidelity is {by_drift[0]} (mean KLD "
                                      f"{ok[by_drift[0]]['drift']['kld_mean']:.2g})"})
        if step["status"] != "ranked":
            for n in candidates:
                history[n].append(step["why"])
            continue
        for n in step["behind"]:
            reasons[n] = ("meets every constraint" + "".join(f"; {h}" for h in history[n])
                          + f"; {step['label']}: {verdict_words(step, n, d, ok)}")
        for n, why in step["excluded"].items():
            reasons[n] = "meets every constraint" + "".join(f"; {h}" for h in history[n]) + \
                f"; {step['label']} {why}"
        for n in step["tied"][1:]:
            history[n].append(f"{step['label']} ties {step['lead']}'s ({verdict_words(step, n, d, ok)})")
        candidates = step["tied"]
    best = candidates[0]
    drift = next((s for s in base["steps"] if s["objective"] == "drift" and s["status"] == "ranked"), None)
    for n in candidates[1:]:        # tied on every step: the higher fidelity (lower point estimate) is shipped
        why = (f"nothing separates it from {best} on mean KLD ({verdict_words(drift, n, d, ok)}), and {best}'s "
               "point estimate is the lower: the higher-fidelity variant is shipped"
               if drift is not None and n in drift["tests"] and drift["values"][n] != drift["values"][best]
               else f"nothing separates it from {best} on any step (equal figures); {best} is the first by name")
        reasons[n] = "meets every constraint" + "".join(f"; {h}" for h in history[n]) + f"; {why}"
    b = ok[best]
    clauses = [h for h in history.get(best, []) if " ties " not in h]      # a step that could not rank
    decided, runner = _runner_up(base["steps"], best)
    if decided is not None:
        t = decided["tests"][runner]
        who = (f"{decided['label']} decided: {show(decided['objective'], decided['values'][best], b)} against "
               f"the runner-up {runner}'s {show(decided['objective'], decided['values'][runner], ok[runner])}")
        base["decided_by"] = {"objective": decided["objective"], "figure": decided["label"], "variant": best,
                              "value": decided["values"][best], "runner_up": runner,
                              "runner_up_value": decided["values"][runner], "tied": bool(t["tied"])}
        earlier = [s for s in base["steps"] if s is not decided and s["status"] == "ranked" and best in s["tied"]]
        for s in earlier:
            if s["lead"] == best:               # every other tied variant was tested against the pick itself
                clauses += [f"{s['label']} ties {n} ({verdict_words(s, n, d, ok)})" for n in s["tied"][1:]]
            else:                               # tested against the step's best, not against each other
                clauses.append(f"{s['label']} ties the step's best, {s['lead']}'s "
                               f"({verdict_words(s, best, d, ok)})")
        if t["tied"] and decided["objective"] == "drift" and decided["values"][runner] != decided["values"][best]:
            clauses.append(f"{who}: nothing separates them ({verdict_words(decided, runner, d, ok)}), so the one "
                           "with the lower mean KLD point estimate (the higher fidelity) is shipped")
        elif t["tied"]:
            clauses.append(f"{who}: tied ({verdict_words(decided, runner, d, ok)}); nothing separates them on "
                           f"any step, {best} is the first by name")
        else:
            clauses.append(f"{who} ({verdict_words(decided, runner, d, ok).split(': ', 1)[-1]})")
    elif len(j["passing"]) == 1:
        clauses.append(f"the only variant meeting every constraint ({label(d.objective)} "
                       f"{show(d.objective, objective_value(b, d.objective, target), b)})")
    else:
        others = [n for n in j["passing"] if n != best]
        clauses.append(f"the only variant ranked on {label(d.objective)} "
                       f"({show(d.objective, objective_value(b, d.objective, target), b)}); "
                       f"{len(others)} other(s) meet every constraint but were not ranked: " + ", ".join(others))
    flip = b["drift"].get("flip_rate")
    tail = f"meets every constraint: mean KLD {b['drift']['kld_mean']:.4f}" + (
        f", flip rate {flip:.1%}" if flip is not None else "")
    if target:
        a = base["at_target"][best]
        if a["served_mb"] is not None and a["budget_mb"] is not None:
            tail += (f"; as served ({where(target)}) it needs {a['served_mb']:.0f} MB of {a['budget_mb']:.0f} MB "
                     f"({a['budget_source']} less {target['headroom']:.0%} headroom)")
        base["latency"] = latency_statement(ok, eligible, target)
        if base["latency"]:
            tail += f"; {base['latency']}"
    reasons[best] = "; ".join(clauses + [tail])
    return finish({**base, "variant": best, "summary": reasons[best]})
