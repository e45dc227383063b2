"""The report's recommendation: the choice and why every other variant lost, each reason a statement of a test
that ran, with the tables those reasons quote: the settings and limits, the A/A noise floor, every ranking step's
tests and the family-wise test of the checks against the original. Every number a reason states is in one of
these tables or the figures' tables (a test checks the committed report)."""

from __future__ import annotations

from pipeline.config.summary_contract import BY_NAME
from pipeline.decide.constraints import CONSTRAINTS, fmt
from pipeline.decide.ranking import FALLBACKS, show
from pipeline.report.cells import _fmt


def _limits_table(summary: dict) -> tuple:
    d, rec = summary["decision_config"], summary["recommendation"]
    rows = [["objective", f"{rec['objective']} (steps: {' → '.join(FALLBACKS[rec['objective']])})"],
            ["limits judged on", "95 % intervals" if rec.get("confidence") == "upper" else "point estimates"],
            ["significance level (alpha)", f"{d['alpha']}"],
            ["family-wise correction", str(rec.get("multiple_comparisons"))],
            ["tie tolerance", f"±{d['tie_tolerance']:.0%}"]]
    for key, metric, kind, _, _ in CONSTRAINTS:
        limit = d.get(key)
        if limit is not None:
            shown = fmt(metric, limit) if metric not in ("flip_rate", "pass_rate_ratio") else format(limit, ".0%")
            rows.append([f"{key} ({'at most' if kind == 'max' else 'at least'})", shown])
    if d.get("max_pass_drop") is not None:
        rows.append(["max_pass_drop (the pass-rate change's 95 % interval must lie above minus this)",
                     f"{d['max_pass_drop'] * 100:.0f} points"])
    if d.get("max_pass_drop_p") is not None:       # a summary decided before non-inferiority
        rows.append(["max_pass_drop_p (checks worse than the original, adjusted p under)", f"{d['max_pass_drop_p']}"])
    if d.get("max_degenerate_increase") is not None:
        rows.append(["max_degenerate_increase (share of looping replies over the original's)",
                     f"{d['max_degenerate_increase'] * 100:.0f} points; mean repeated-4-gram rate at most "
                     f"{(d.get('degeneration') or {}).get('max_repeated_4gram_rate')}"])
    t = rec.get("target")
    if t:
        rows.append(["deployment target", f"workload {t['workload']}: {t['context_tokens']:,} tokens of context × "
                                          f"{t['concurrency']} concurrent sequence(s)"])
        host = (f" ({t['host_bytes'] / 2**30:.1f} GiB here)" if t.get("budget_bytes") is None and t.get("host_bytes")
                else "")
        rows.append(["memory budget", f"{t['budget_source']}{host}, less {t['headroom']:.0%} headroom"])
        # in the units the recommendation states them in (seconds to first token, milliseconds between tokens)
        targets = [x for x in (f"time to first token ≤ {t['max_ttft_p99_s']:g} s" if t.get("max_ttft_p99_s") else "",
                               f"inter-token p99 ≤ {t['max_itl_p99_s'] * 1000:.0f} ms" if t.get("max_itl_p99_s")
                               else "") if x]
        rows.append(["latency targets", f"{t['latency_targets']} ({', '.join(targets)})" if targets
                     else f"none (workload {t['workload']} sets none)"])
    if d.get("min_recovery") is not None:
        rows.append(["min_recovery (every bench:TASK's recovery, lower 95 % bound at least)",
                     format(d["min_recovery"], ".0%")])
    return ["setting", "value"], rows


def _aa_table(summary: dict) -> tuple | None:
    noise = summary.get("speed_noise") or {}
    if not noise.get("figures"):
        return None
    from pipeline.decide.recommendation import aa_negligible

    tolerance = (summary.get("decision_config") or {}).get("tie_tolerance") or 0.0
    rows = []
    from pipeline.figures.speed_trials import MEMORY_FIGURES, WORKERS_FRESH

    one_process = (summary.get("speed_protocol") or {}).get("workers", WORKERS_FRESH) != WORKERS_FRESH
    for k, x in noise["figures"].items():
        label = BY_NAME[k].label if k in BY_NAME else k
        if one_process and k in MEMORY_FIGURES:
            x = {**x, "single_reading": True, "p": None, "rounds": 1}
        verdict = ("one reading per process: compared as a difference, no test" if x.get("single_reading") else
                   "tied" if x["tied"] else
                   f"differs, within the ±{tolerance:.0%} tie tolerance: ranks" if aa_negligible(x, tolerance) else
                   f"NOT tied: the floor widens to ±{x['floor']:.0%}")
        rows.append([label, f"{x['ratio']:.2f}× [{x['low']:.2f}, {x['high']:.2f}]", str(x["rounds"]),
                     _fmt(x.get("p"), ".3f"), verdict,
                     f"±{x['floor']:.0%}"])
    return (["figure", f"{noise['control']} against itself [interval]", "rounds", "sign-flip p", "A/A verdict",
             "floor"], rows)


def _steps_table(summary: dict) -> tuple | None:
    rec = summary["recommendation"]
    rows = []
    for i, step in enumerate(rec.get("steps") or [], 1):
        obj = step["objective"]
        if step["status"] != "ranked":
            rows.append([str(i), step["label"], "–", "–", "–", "–", "–", "–", "–", step["why"]])
            continue
        lead = step["lead"]
        floor = step.get("tolerance") if obj != "drift" else None
        var = summary["variants"]
        rows.append([str(i), step["label"], f"{lead} (best)", show(obj, step["values"][lead], var[lead]), "–", "–", "–",
                     "–",
                     f"±{floor:.0%}" if floor is not None else "–", "best"])
        for n, t in step["tests"].items():
            ratio = (f"{t['ratio']:.2f}× [{t['low']:.2f}, {t['high']:.2f}]" if t.get("low") is not None
                     else (f"{t['ratio']:.2f}×" if t.get("ratio") is not None else "–"))
            floor = step.get("tolerance") if obj != "drift" else None
            rows.append([str(i), step["label"], n, show(obj, step["values"][n], var[n]), ratio,
                         str(t.get("rounds") or t.get("units") or "–"), _fmt(t.get("p"), ".3f"),
                         _fmt(t.get("p_adjusted"), ".3f"), f"±{floor:.0%}" if floor is not None else "–",
                         "ties the best" if t["tied"] else "behind the best"])
        for n, why in step.get("excluded", {}).items():
            rows.append([str(i), step["label"], n, "–", "–", "–", "–", "–", "–", f"not ranked: {why}"])
    if not rows:
        return None
    return (["step", "figure", "variant", "value", "against the best [interval]", "paired units", "sign-flip p",
             f"{rec.get('multiple_comparisons')}-adjusted p", "noise floor", "verdict"], rows)


def _pass_drop_table(summary: dict) -> tuple | None:
    rec = summary["recommendation"]
    drops = rec.get("pass_drop") or {}
    if not drops:
        return None
    rows = []
    for n, t in drops.items():
        if "low" not in t:          # a summary decided before non-inferiority: its test as it was
            rows.append([n, t["against"], f"{t['mean_difference']:+.0%}", "–", str(t.get("conversations")),
                         _fmt(t.get("p"), ".3f"), "fails" if t["fails"] else "passes"])
            continue
        rows.append([n, t["against"], f"{t['mean_difference']:+.1%} [{t['low']:+.1%}, {t['high']:+.1%}]",
                     "–" if t.get("margin") is None else f"-{t['margin'] * 100:.0f} points",
                     str(t.get("conversations")), _fmt(t.get("p"), ".3f"), t["verdict"]])
    return (["variant", "checked against", "pass-rate change [95 % interval]", "margin", "conversations",
             "sign-flip p (shown, not judged)", "verdict"], rows)


def _target_table(summary: dict) -> tuple | None:
    rec = summary["recommendation"]
    t, rows = rec.get("target"), []
    if not t:
        return None
    yes = {True: "yes", False: "NO", None: "–"}
    for n, a in (rec.get("at_target") or {}).items():
        rows.append([n, _fmt(a["served_mb"], ".0f"), _fmt(a["budget_mb"], ".0f"), yes[a["fits"]],
                     "–" if a["sequences"] is None else str(a["sequences"]),
                     _fmt(a["ttft_s"], ".2f"), "–" if a["itl_p99_s"] is None else f"{a['itl_p99_s'] * 1000:.0f}",
                     yes[a["meets_latency"]]])
    return (["variant", "memory as served MB", "budget MB (less headroom)", "fits",
             f"sequences of {t['context_tokens']:,} tokens in the budget",
             f"time to first token at {t['context_tokens']:,} tokens, s (prompt ÷ the probe's prefill rate)",
             "inter-token p99 ms (the probe's)", "meets the latency targets"], rows)


def decision_section(summary: dict) -> tuple:
    rec = summary["recommendation"]
    confidence = rec.get("confidence", "point")
    if rec["variant"]:
        lead = (f"**Ship `{rec['variant']}`** (decision `{rec['decision']}`, objective `{rec['objective']}`, limits "
                f"judged on {'95 % upper/lower bounds' if confidence == 'upper' else 'point estimates'}): "
                f"{rec['summary']}.")
    else:
        lead = f"**No recommendation**: {rec['summary']}."
    blocks: list = [lead]
    if rec.get("undecided"):
        blocks.append("**Undecided** (a limit lies inside the 95 % interval, so this run cannot say whether the "
                      "variant meets it; more conversations narrow the interval): "
                      + ", ".join(f"`{n}`" for n in rec["undecided"]) + ".")
    others = [f"`{n}`: {r}" for n, r in rec["reasons"].items() if n != rec["variant"]]
    blocks += ["Why the others lost:", others]
    blocks += ["Settings and limits of the decision:", _limits_table(summary)]
    for title, table in (("The run's noise floor (A/A: the control measured twice per round, interleaved):",
                          _aa_table(summary)),
                         ("The ranking, step by step: each variant against the step's best (on speed a variant ties "
                          "unless the family-wise adjusted p over the interleaved trials is under alpha and the "
                          "difference exceeds the noise floor; memory, capacity and size are one reading each, "
                          "compared against the tie tolerance; drift is tested paired per conversation):",
                          _steps_table(summary)),
                         ("Checks against the original: non-inferiority, per variant (the whole 95 % interval of "
                          "the pass-rate change must lie above minus the margin; straddling it is undecided):",
                          _pass_drop_table(summary)),
                         ("Each variant as served at the deployment target (weights + runtime + KV cache of the "
                          "workload's sequences):", _target_table(summary))):
        if table:
            blocks += [title, table]
    front = ", ".join(f"`{n}`" for n in rec.get("pareto_front") or [])
    blocks.append(f"Pareto front over (mean KLD, decode tokens/s, peak RSS): {front}.")
    return ("decision", "Recommendation", blocks)
