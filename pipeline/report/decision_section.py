"""The report's recommendation: the choice and why every other variant lost, each reason a statement of a test
that ran, with the tables those reasons quote: the settings and limits, the A/A noise floor, every ranking step's
tests and the family-wise test of the checks against the original. Every number a reason states is in one of
these tables or the figures' tables (a test checks the committed report)."""

from __future__ import annotations

from pipeline.config.summary_contract import BY_NAME
from pipeline.decide.constraints import CONSTRAINTS, fmt
from pipeline.decide.recommendation import FALLBACKS, show
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
    if d.get("max_pass_drop_p") is not None:
        rows.append(["max_pass_drop_p (checks worse than the original, adjusted p under)", f"{d['max_pass_drop_p']}"])
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
    for k, x in noise["figures"].items():
        label = BY_NAME[k].label if k in BY_NAME else k
        verdict = ("tied" if x["tied"] else
                   f"differs, within the ±{tolerance:.0%} tie tolerance: ranks" if aa_negligible(x, tolerance) else
                   "NOT tied: too noisy to rank on it")
        rows.append([label, f"{x['ratio']:.2f}× [{x['low']:.2f}, {x['high']:.2f}]", str(x["rounds"]),
                     f"{x['p']:.3f}", verdict,
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
        floor = step.get("floor")
        var = summary["variants"]
        rows.append([str(i), step["label"], f"{lead} (best)", show(obj, step["values"][lead], var[lead]), "–", "–", "–",
                     "–",
                     f"±{floor:.0%}" if floor is not None else "–", "best"])
        for n, t in step["tests"].items():
            ratio = (f"{t['ratio']:.2f}× [{t['low']:.2f}, {t['high']:.2f}]" if t.get("low") is not None
                     else (f"{t['ratio']:.2f}×" if t.get("ratio") is not None else "–"))
            rows.append([str(i), step["label"], n, show(obj, step["values"][n], var[n]), ratio,
                         str(t["rounds"]) if t.get("rounds") else "–", _fmt(t.get("p"), ".3f"),
                         _fmt(t.get("p_adjusted"), ".3f"), f"±{floor:.0%}" if floor is not None else "–",
                         "ties the best" if t["tied"] else "behind the best"])
        for n, why in step.get("excluded", {}).items():
            rows.append([str(i), step["label"], n, "–", "–", "–", "–", "–", "–", f"not ranked: {why}"])
    if not rows:
        return None
    return (["step", "figure", "variant", "value", "against the best [interval]", "trials", "sign-flip p",
             f"{rec.get('multiple_comparisons')}-adjusted p", "A/A floor", "verdict"], rows)


def _pass_drop_table(summary: dict) -> tuple | None:
    rec, d = summary["recommendation"], summary["decision_config"]
    drops = rec.get("pass_drop") or {}
    if not drops:
        return None
    rows = [[n, t["against"], f"{t['mean_difference']:+.0%}", str(t.get("conversations")), f"{t['p']:.3f}",
             _fmt(t.get("p_adjusted"), ".3f"), str(t.get("family")),
             "fails" if t["fails"] else ("not tested" if d.get("max_pass_drop_p") is None else "passes")]
            for n, t in drops.items()]
    return (["variant", "checked against", "per-conversation pass-rate difference", "conversations", "sign-flip p",
             f"{rec.get('multiple_comparisons')}-adjusted p", "variants in the family", "verdict"], rows)


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
                         ("The ranking, step by step: each variant against the step's best over the interleaved "
                          "trials (a variant ties unless the family-wise adjusted p is under alpha and the difference "
                          "exceeds the A/A floor and the tie tolerance):", _steps_table(summary)),
                         ("Checks against the original: the conversation-level sign-flip test, adjusted across the "
                          "variants:", _pass_drop_table(summary))):
        if table:
            blocks += [title, table]
    front = ", ".join(f"`{n}`" for n in rec.get("pareto_front") or [])
    blocks.append(f"Pareto front over (mean KLD, decode tokens/s, peak RSS): {front}.")
    return ("decision", "Recommendation", blocks)
