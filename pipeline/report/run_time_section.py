"""The report's run-time section: minutes per stage of the run, and what run.budget cut."""

from __future__ import annotations


def _budget_block(summary: dict) -> list:
    """What run.budget did to the run, as its plan put it, and what the run it left can detect."""
    b = (summary.get("run") or {}).get("budget")
    if not b:
        return []
    head = f"Run budget {b.get('budget')} (`run.budget`, {b['budget_s'] / 60:.0f} min of planned stage time): "
    if b.get("no_time"):
        return [head + f"nothing was cut, as the plan had no time for the run ({b['no_time']})."]
    untimed = (f" ({b['untimed_stages']} stage(s) without a time estimate, not counted)"
               if b.get("untimed_stages") else "")
    whole = (f" The generated suite(s) {', '.join(b['whole_suites'])} ran whole." if b.get("whole_suites") else "")
    if not b.get("allocation"):
        return [head + f"the plan put the profile's work at {b['profile_planned_s'] / 60:.1f} min{untimed}, so "
                "nothing was cut."]
    out = [head + f"the plan put the profile's work at {b['profile_planned_s'] / 60:.1f} min, over the budget, so "
           f"the run was cut ({'; '.join(b['steps'])}) to {b['described']}, planned at {b['planned_s'] / 60:.1f} "
           f"min{untimed}.{whole}"]
    after = b.get("after_screen")
    if after:
        out.append(f"The screen took out {', '.join(after['screened_out'])} before free-running, so the speed and "
                   f"load stages were given back {'; '.join(after['given_back'])} (the run ran "
                   f"{after['described']}): planned at {after['planned_rest_s'] / 60:.1f} min for the variants "
                   f"left, within the {after['allowed_rest_s'] / 60:.1f} min the fit had given those stages for "
                   "every variant and left of the budget.")
    detect = [f"{suite}: {p['conversations']} conversations, a pass-rate change under {p['mde_pass_rate']:.0%}"
              + (f" or a mean-KLD ratio under {p['mde_kld_ratio']:.2f}×" if p.get("mde_kld_ratio") else "")
              + " is not distinguishable from none"
              for suite, p in (next((v.get("power") for v in summary["variants"].values()
                                     if v.get("status") == "ok" and v.get("power")), None) or {}).items()
              if p.get("mde_pass_rate") is not None]
    if detect:
        out.append("What the cut run can detect (80 % power, 5 % two-sided; the section \"What this run can detect\" "
                   "has every variant's figure): " + "; ".join(detect) + ".")
    return out


def run_time_section(summary: dict):
    """Minutes per stage of the run (each stage's own build time: a stage reused from an earlier run counts
    that build; quantizing, once per model, is in the artifacts table), and what run.budget cut."""
    t = summary.get("stage_times")
    if not t or not t.get("total_s"):
        budget = _budget_block(summary)
        return ("run-time", "Run time", budget) if budget else None
    m = lambda s: "-" if s is None else f"{s / 60:.1f}"  # noqa: E731
    tasks = sorted({k for r in t["variants_s"].values() for k in r if k.startswith("bench:")})
    pad = [""] * (2 + len(tasks))
    rows = [[f"references: {suite}", m(w), *pad] for suite, w in t["references_s"].items()]
    rows += [[f"`{n}`", m(r.get("free_running")), m(r.get("scoring")), m(r.get("deployment")),
              *(m(r.get(k)) for k in tasks)] for n, r in t["variants_s"].items()]
    label = {"load": "load stage: short sweep of `make compare` (all variants)"}
    rows += [[label.get(k, f"{k} stage (all variants)"), m(w), *pad] for k, w in t["run_s"].items()]
    rows.append(["**total**", f"**{m(t['total_s'])}**", *pad])
    covers = {"trials": "its trials, every sitting", "last sitting": "its last sitting only, from a resumed sweep "
              "that kept no trial times"}
    rows += [[f"load stage: {p} sweep of `make load` (all variants; not in the total; {covers[o['covers']]})",
              m(o["s"]), *pad] for p, o in (t.get("other_sweeps") or {}).items()]
    return ("run-time", "Run time", [
        "Minutes per stage, each stage's own build time from its manifest (a stage reused from an earlier run counts "
        "that build, so the total is what these results cost, not this invocation's wall time); quantizing, once "
        "per model, is in the artifacts table. Where the report's load section shows `make load`'s sweep instead "
        "of the short one, that sweep's time is listed below the total.", *_budget_block(summary),
        (["stage", "free-running (or the stage)", "teacher-forced scoring", "deployment path",
          *(f"`{k}`" for k in tasks)], rows)])
