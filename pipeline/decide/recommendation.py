"""The decision: the variant to ship by an objective among those meeting every constraint, and for every other
variant why it lost, each reason a statement of a test that ran.

The objective ranks in steps (``FALLBACKS``: decode speed, then memory, then drift for ``decode_speed``). A step
on a figure measured in interleaved trials (decode tok/s, peak memory) ranks only outside this run's noise:

- the run's A/A pair (the control variant measured twice per round) must itself tie on that figure, else the run is
  too noisy to rank on it and the step is skipped, saying so; an A/A difference that the test finds but whose whole
  interval lies within ``decision.tie_tolerance`` (two processes of one variant that differ by a fraction of a per
  cent in resident memory, every round) is a negligible systematic effect, not noise: the step ranks, with the
  tolerance as its floor;
- a variant ties the step's best unless the paired sign-flip test over the trials finds it worse after the
  family-wise correction across the variants compared (``decision.multiple_comparisons``) *and* it differs by more
  than the A/A floor (the A/A ratio's largest distance from 1) and ``decision.tie_tolerance``.

The variants that tie go on to the next step; drift (mean KLD) ends every chain. A format measured on no native
kernel of this device takes no part in a speed or memory step (its figures are another model's).
"""

from __future__ import annotations

from pipeline.config.commands import DecisionConfig
from pipeline.config.summary_contract import BY_NAME
from pipeline.decide.constraints import judge_constraints, pass_drop_family

# objective -> the catalogue metric it optimises (its direction says which way is better)
OBJECTIVES = {"decode_speed": "decode_tokens_per_s", "memory": "peak_rss_mb", "size": "artifact_bytes",
              "drift": "kld_mean"}
# objectives read from the load sweep (pipeline.stages.load, ``v["load"]``), not the catalogue: name -> (label, better)
LOAD_OBJECTIVES = {"throughput_at_slo": ("aggregate output tokens/s at the workload's targets", "higher")}
# the order of the steps per objective: a tie (or a run too noisy to rank) on one goes to the next
FALLBACKS = {"decode_speed": ("decode_speed", "memory", "drift"), "memory": ("memory", "size", "drift"),
             "size": ("size", "drift"), "throughput_at_slo": ("throughput_at_slo", "drift")}
TRIAL_OBJECTIVES = ("decode_speed", "memory")     # measured in interleaved trials, judged against the A/A floor


def aa_negligible(aa: dict, tolerance: float) -> bool:
    """The A/A pair differs, but its whole interval lies within ``tolerance`` of 1: a systematic difference too
    small to matter, which the ranking's floor (at least the tolerance) already absorbs."""
    return bool(tolerance > 0 and aa.get("low") is not None and aa.get("high") is not None
                and 1 - tolerance <= aa["low"] and aa["high"] <= 1 + tolerance)


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


def _better(objective: str) -> str:
    return LOAD_OBJECTIVES[objective][1] if objective in LOAD_OBJECTIVES else BY_NAME[OBJECTIVES[objective]].better


def _label(objective: str) -> str:
    return LOAD_OBJECTIVES[objective][0] if objective in LOAD_OBJECTIVES else BY_NAME[OBJECTIVES[objective]].label


def _trial_metric(v: dict, objective: str) -> str:
    """The trial figure of a trial objective (on a GPU the device's memory is the one that binds)."""
    if objective == "memory" and (v.get("device_memory") or {}).get("peak_mb") is not None:
        return "device_peak_mb"
    return OBJECTIVES[objective]


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
    if objective == "drift":
        return f"mean KLD {x:.4f}"
    return f"{x / 2**20:.1f} MiB"


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


def rank_step(ok: dict[str, dict], names: list[str], objective: str, d: DecisionConfig,
              noise: dict | None) -> dict:
    """One step of the ranking: the best of ``names`` on ``objective`` and, for every other, the test that ties it
    with the best or puts it behind. Returns {"objective", "label", "status": ranked | too noisy | not measured,
    "lead", "values", "tests", "tied", "behind", "excluded", "floor", "aa", "why"}."""
    from pipeline.measure.stats import adjust_p, paired_ratio

    step: dict = {"objective": objective, "label": _label(objective), "values": {}, "tests": {}, "excluded": {},
                  "floor": None, "aa": None, "why": None}
    eligible = []
    for n in names:
        v = ok[n]
        if objective in TRIAL_OBJECTIVES and v.get("no_native_kernel"):
            step["excluded"][n] = v["no_native_kernel"]
        elif objective_value(v, objective) is None:
            step["excluded"][n] = "not measured"
        else:
            eligible.append(n)
            step["values"][n] = objective_value(v, objective)
    if not eligible:
        return {**step, "status": "not measured", "lead": None, "tied": list(names), "behind": [],
                "why": f"{step['label']} is not measured for any of them"}
    if objective in TRIAL_OBJECTIVES:
        aa = ((noise or {}).get("figures") or {}).get(_trial_metric(ok[eligible[0]], objective))
        step["aa"] = aa
        if aa and not aa["tied"] and not aa_negligible(aa, d.tie_tolerance):
            return {**step, "status": "too noisy", "lead": None, "tied": list(names), "behind": [],
                    "why": (f"{step['label']} not ranked: this run's A/A pair differs ({aa['ratio']:.2f}× "
                            f"[{aa['low']:.2f}, {aa['high']:.2f}], sign-flip p={aa['p']:.3f} < {d.alpha}), so the "
                            "run is too noisy to rank on it")}
        step["floor"] = aa["floor"] if aa else 0.0
    sign = -1 if _better(objective) == "higher" else 1
    eligible.sort(key=lambda n: (sign * step["values"][n], n))
    lead = eligible[0]
    tolerance = max(step["floor"] or 0.0, d.tie_tolerance)
    tests: dict[str, dict] = {}
    if objective in TRIAL_OBJECTIVES:
        trials = {n: ((ok[n].get("speed_trials") or {}).get("values") or {}).get(_trial_metric(ok[n], objective))
                  for n in eligible}
        for n in eligible[1:]:
            t = paired_ratio(trials[n] or [], trials[lead] or [])
            # without paired trials (a speed stage that did not run for one of them) only the medians compare
            tests[n] = t or {"ratio": step["values"][n] / step["values"][lead], "p": None, "rounds": 0}
        adjusted = adjust_p({n: t["p"] for n, t in tests.items()}, d.multiple_comparisons)
        for n, t in tests.items():
            t["p_adjusted"] = adjusted[n]
            t["method"] = d.multiple_comparisons
            close = abs(t["ratio"] - 1) <= tolerance
            if t["p"] is None:
                t["tied"] = bool(close)
            else:
                t["tied"] = bool(close or t["p_adjusted"] is None or t["p_adjusted"] >= d.alpha)
    elif objective in LOAD_OBJECTIVES:
        ia = (ok[lead].get("load") or {}).get("throughput_at_slo_interval")
        for n in eligible[1:]:
            ib = (ok[n].get("load") or {}).get("throughput_at_slo_interval")
            ratio = step["values"][n] / step["values"][lead] if step["values"][lead] else float("nan")
            overlap = bool(ia and ib and ib["high"] >= ia["low"] and ia["high"] >= ib["low"])
            tests[n] = {"ratio": ratio, "overlap": overlap, "method": "overlap of the load sweep's ranges over rounds",
                        "tied": bool(overlap or abs(ratio - 1) <= d.tie_tolerance)}
    elif objective == "size":
        for n in eligible[1:]:
            ratio = step["values"][n] / step["values"][lead] if step["values"][lead] else float("nan")
            tests[n] = {"ratio": ratio, "tied": bool(abs(ratio - 1) <= d.tie_tolerance)}
    else:       # drift: the point estimate orders; its interval is printed beside it
        for n in eligible[1:]:
            tests[n] = {"tied": step["values"][n] == step["values"][lead]}
    tied = [lead] + [n for n in eligible[1:] if tests[n]["tied"]]
    behind = [n for n in eligible[1:] if not tests[n]["tied"]]
    return {**step, "status": "ranked", "lead": lead, "tests": tests, "tied": tied, "behind": behind,
            "tolerance": tolerance}


def _test_words(step: dict, n: str, d: DecisionConfig, ok: dict) -> str:
    """What the test of ``n`` against the step's best says, in the numbers the report's tables print."""
    t, lead, obj = step["tests"][n], step["lead"], step["objective"]
    head = f"{show(obj, step['values'][n], ok[n])} against {lead}'s {show(obj, step['values'][lead], ok[lead])}"
    if obj in TRIAL_OBJECTIVES:
        if t.get("p") is None:
            return (f"{head}: {t['ratio']:.2f}×, no paired trials: medians compared "
                    + (f"within ±{step['tolerance']:.0%}" if t["tied"] else f"beyond ±{step['tolerance']:.0%}"))
        floor = step["floor"] or 0.0
        words = (f"{head}: {t['ratio']:.2f}× [{t['low']:.2f}, {t['high']:.2f}] over {t['rounds']} interleaved "
                 f"trials, sign-flip p={t['p']:.3f}, {t['method']}-adjusted p={t['p_adjusted']:.3f}")
        if not t["tied"]:
            return words + f" < {d.alpha}, outside the A/A floor ±{floor:.0%}"
        if t["p_adjusted"] >= d.alpha:
            return words + f" ≥ {d.alpha}"
        return words + f", inside {'the A/A floor' if floor >= d.tie_tolerance else 'the tie tolerance'} " \
                       f"±{step['tolerance']:.0%}"
    if obj in LOAD_OBJECTIVES:
        return f"{head}: {t['ratio']:.2f}×, the load sweep's ranges {'overlap' if t['overlap'] else 'do not overlap'}"
    if obj == "size":
        return f"{head}: {t['ratio']:.2f}×" + (f", within {d.tie_tolerance:.0%}" if t["tied"] else "")
    return head


def decide(variants: dict[str, dict], d: DecisionConfig, noise: dict | None = None) -> dict:
    """The recommended variant, the steps of its ranking with every test they ran, the Pareto front over (mean KLD,
    decode tokens/s, peak memory), and for every other variant why it lost: the first constraint it failed (or left
    undecided), else the step that put it behind the best, with the test. ``noise``: the speed stage's A/A result
    (``pipeline.stages.speed.noise_floor``)."""
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    points = {n: p for n, v in ok.items() if (p := pareto_point(v)) is not None}
    drops = pass_drop_family(ok, d)
    reasons: dict[str, str] = {}
    passing, undecided, not_measurable, failed = [], [], {}, {}
    for name, v in ok.items():
        judged = judge_constraints(v, d, drops.get(name))
        fails = [c for c in judged if c["verdict"] == "fail"]
        open_ = [c for c in judged if c["verdict"] == "undecided"]
        notes = [c["message"] for c in judged if c["verdict"] == "not measurable"]
        if notes:
            not_measurable[name] = notes
        if fails:
            failed[name] = (len(fails), sum(c["violation"] for c in fails))
            reasons[name] = f"fails constraint: {fails[0]['message']}"
        elif open_:
            failed[name] = (len(open_), sum(c["violation"] for c in open_))
            undecided.append(name)
            reasons[name] = ("undecided: " + "; ".join(c["message"] for c in open_)
                             + " (decision.confidence=upper: only a variant whose interval clears the limit passes)")
        else:
            passing.append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            reasons[name] = f"{v['status']}: {v.get('reason')}"
    base = {"objective": d.objective, "decision": d.name, "confidence": d.confidence,
            "multiple_comparisons": d.multiple_comparisons, "alpha": d.alpha,
            "pareto_front": pareto_front(points),
            "pareto_axes": ["mean KLD (lower)", "decode tokens/s (higher)", "peak RSS MB (lower)"],
            "undecided": undecided, "not_measurable": not_measurable, "pass_drop": drops, "steps": []}

    def finish(out: dict) -> dict:
        out["reasons"] = {n: r + "".join(f"; {m}" for m in not_measurable.get(n, [])) for n, r in reasons.items()}
        if out["variant"]:
            out["summary"] = out["reasons"][out["variant"]]
        return out

    if not passing:
        closest = min(failed, key=lambda n: (*failed[n], n)) if failed else None
        return finish({**base, "variant": None, "closest": closest,
                       "summary": f"no variant meets every constraint of decision '{d.name}'"
                                  + (f" ({len(undecided)} undecided: {', '.join(undecided)})" if undecided else "")
                                  + (f"; closest: {closest} ({reasons[closest]})" if closest else "")})
    chain = FALLBACKS[d.objective]
    if d.objective in LOAD_OBJECTIVES and all(objective_value(ok[n], d.objective) is None for n in passing):
        return finish({**base, "variant": None, "closest": None,
                       "summary": f"objective {d.objective} needs the load sweep of this run (make load, or "
                                  "quantdrift command=load), and no variant meeting every constraint has a level "
                                  "meeting the workload's targets in it"})
    if d.objective in TRIAL_OBJECTIVES:
        for n in [n for n in passing if ok[n].get("no_native_kernel")]:
            reasons[n] = (f"meets every constraint, but {ok[n]['no_native_kernel']}: its speed and memory are not "
                          f"the format's, so it is not ranked on {_label(d.objective)}")
            passing.remove(n)
        if not passing:
            return finish({**base, "variant": None, "closest": None,
                           "summary": f"no variant meeting every constraint of decision '{d.name}' ran on a native "
                                      f"kernel of this device, so none can be ranked on {_label(d.objective)}"})
    candidates, history = list(passing), {n: [] for n in passing}
    for objective in chain:
        if len(candidates) <= 1:
            break
        step = rank_step(ok, candidates, objective, d, noise)
        base["steps"].append(step)
        if step["status"] != "ranked":
            for n in candidates:
                history[n].append(step["why"])
            continue
        for n in step["behind"]:
            reasons[n] = ("meets every constraint" + "".join(f"; {h}" for h in history[n])
                          + f"; {step['label']}: {_test_words(step, n, d, ok)}")
        for n, why in step["excluded"].items():
            reasons[n] = "meets every constraint" + "".join(f"; {h}" for h in history[n]) + \
                f"; {step['label']} {why}"
        for n in step["tied"][1:]:
            history[n].append(f"{step['label']} ties {step['lead']}'s ({_test_words(step, n, d, ok)})")
        if len(step["tied"]) > 1:
            history[step["lead"]].append(f"{step['label']} ties " + ", ".join(step["tied"][1:]))
        candidates = step["tied"]
    best = sorted(candidates)[0]
    b = ok[best]
    clauses = []
    for step in base["steps"]:
        if step["status"] != "ranked":
            clauses.append(step["why"])
        elif step["lead"] == best:
            behind = [n for n in step["behind"] if n in step["values"]]
            clauses.append(f"best {step['label']} ({show(step['objective'], step['values'][best], b)})"
                           + (f", ahead of {', '.join(behind)}" if behind else "")
                           + (f", tied with {', '.join(step['tied'][1:])}" if len(step["tied"]) > 1 else ""))
        elif best in step["tests"]:
            clauses.append(f"its {step['label']} ties the best, {step['lead']}'s ({_test_words(step, best, d, ok)})")
    if not clauses:
        clauses.append(f"the only variant meeting every constraint ({_label(chain[0])} "
                       f"{show(chain[0], objective_value(b, chain[0]), b)})")
    flip = b["drift"].get("flip_rate")
    reasons[best] = ("; ".join(clauses) + f"; meets every constraint: mean KLD {b['drift']['kld_mean']:.4f}"
                     + (f", flip rate {flip:.1%}" if flip is not None else ""))
    return finish({**base, "variant": best, "summary": reasons[best]})
