"""A finished run's plan beside what it measured: ``quantdrift plan plan.compare=true`` (the run named by
run.name, or plan.measured=results/<model>/<run>). Per stage and variant: time, peak host memory (each stage's
manifest records its own and its children's; a speed probe's row is that probe alone), and the artifact's bytes.

Times are never taken from the run being compared: from another finished run when there is one, else each
variant's stages from its nearest sibling variant of this run (the same weight kind, scaled by bytes), which is
what the plan does for a variant it has no measurement of. Shared stages (prepare, conversion, references) then
have no source but the run itself and are marked in-sample.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import MIB
from pipeline.plan.stage_plan import PIPELINE_PROCESS_B


def _err(plan: float | None, measured: float | None) -> str:
    if plan is None or not measured or measured < 1:       # under 1 MB or 1 s: nothing to plan
        return ""
    return f"{(plan - measured) / measured:+.0%}"


def _cell(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "" if x is None else fmt.format(x)


def compare_rows(cfg) -> dict:
    """The plan of the measured run's own variants with its measurements beside each stage."""
    import dataclasses

    from pipeline.compose import variant_of
    from pipeline.infra.files import read_json
    from pipeline.plan.measured_runs import find_runs, read_run
    from pipeline.plan.estimate import build_plan

    folder = Path(cfg.plan.measured) if cfg.plan.measured else cfg.results_dir
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        raise ConfigError(f"plan.measured={str(folder)!r} holds no summary.json: expected a finished run's folder "
                          f"(results/<model>/<run>)")
    summary = read_json(summary_path)
    mr = read_run(summary_path, Path(cfg.paths.artifacts))
    if mr is None:
        raise ConfigError(f"{summary_path} has no stage times or model facts: expected a summary of schema 4 or later")
    if summary["model"]["name"] != cfg.model.name:
        raise ConfigError(f"model.name={cfg.model.name!r} but {summary_path} is a run of {summary['model']['name']!r}: "
                          f"pass the run's own model (model=... / model.source=...)")
    if summary["run"].get("profile") != cfg.profile.name:
        raise ConfigError(f"profile={cfg.profile.name!r} but {summary_path} ran profile {summary['run'].get('profile')!r}: "
                          "pass the run's own profile")
    names = [n for n, v in summary["variants"].items() if v.get("status") == "ok"]
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=summary["run"]["name"],
                                                            suites=list(summary["run"]["suites"]), variants=names))
    budget = summary["run"].get("budget") or {}
    if budget.get("allocation"):        # a run cut to its budget is planned as it ran
        from pipeline.plan.budget import allocation_of

        cfg = allocation_of(budget).apply(cfg)
    others = find_runs(Path(cfg.paths.results), Path(cfg.paths.artifacts), exclude=mr.label)
    # another run is rescaled by the bandwidth (and compute) this run recorded when it ran, not by readings taken now
    plan = build_plan(cfg, variants=[variant_of(cfg, n) for n in names], exclude_run=mr.label if others else None,
                      leave_out=not others, bandwidth_here=mr.bandwidth_bytes_per_s,
                      compute_here=mr.compute_flops_per_s)
    in_sample = ("prepare", "convert_f16", "parity", "reference", "standin", "baseline") if not others else ()
    rows = []
    for fp in plan["rows"]:
        key = fp.time_args.get("key") or fp.variant
        measured_s = mr.walls.get((fp.stage, key))
        if fp.stage in ("speed", "load"):       # measured for all variants together: compared as one row below
            measured_s = None
        peak = mr.peaks_mb.get((fp.stage, key))
        disk = None
        v = summary["variants"].get(fp.variant) or {}
        if fp.stage == "quantize" and fp.disk_bytes:      # an F16 file is the conversion's, hard-linked
            disk = (v.get("memory") or {}).get("artifact_bytes")
        if fp.stage == "convert_f16":
            disk = ((summary["variants"].get("gguf_f16") or {}).get("memory") or {}).get("artifact_bytes")
        if fp.stage == "prepare":
            disk = _prepared_bytes(cfg, summary)
        rows.append({"stage": fp.stage, "variant": fp.variant, "plan_s": fp.time_s, "measured_s": measured_s,
                     "basis": fp.time_basis, "in_sample": fp.stage in in_sample, "plan_host_mb": fp.host_bytes / MIB, "measured_host_mb": peak,
                     "plan_disk_mb": fp.disk_bytes / MIB, "measured_disk_mb": disk / MIB if disk else None})
    control = next((label.split("#", 1)[0] for label in (summary.get("speed_protocol") or {}).get("order", [[]])[0]
                    if "#" in label), None)
    for stage in ("speed", "load"):
        mine = [r for r in rows if r["stage"] == stage]
        if mine and (stage, "*") in mr.walls:
            # the speed stage keeps every probe loaded that memory allows (all, on a small model; the A/A
            # control's second probe too) beside the pipeline's process; the load sweep serves one at a time
            host = (sum(r["plan_host_mb"] * (2 if r["variant"] == control else 1) for r in mine)
                    + PIPELINE_PROCESS_B / MIB) if stage == "speed" else max(r["plan_host_mb"] for r in mine)
            rows.append({"stage": f"{stage} (all variants)", "variant": "-", "measured_s": mr.walls[(stage, "*")],
                         "plan_s": sum(r["plan_s"] or 0 for r in mine), "basis": "sum of the rows above",
                         "in_sample": False,
                         "plan_host_mb": host,
                         "measured_host_mb": mr.peaks_mb.get((stage, "*")),
                         "plan_disk_mb": sum(r["plan_disk_mb"] for r in mine), "measured_disk_mb": None})
    return {"run": mr, "plan": plan, "rows": rows, "in_sample": not others}


def _abs_errors(rows: list[dict], plan_key: str, meas_key: str) -> list[float]:
    return [abs(r[plan_key] - r[meas_key]) / r[meas_key] for r in rows
            if r[plan_key] is not None and r[meas_key] and r[meas_key] >= 1]


def compare_run(cfg) -> str:
    out = compare_rows(cfg)
    mr, rows = out["run"], out["rows"]
    basis = ("no other finished run: each variant's time from its nearest sibling variant of this run; shared "
             "stages in-sample (their own measurement)") if out["in_sample"] else f"times from {out['plan']['time_basis']}"
    lines = [f"plan vs measured: {mr.label} ({mr.cpu}, {mr.params / 1e6:.0f} M parameters); {basis}", "",
             "| stage | variant | time plan | time measured | error | peak host MB plan | measured | error | "
             "disk MB plan | measured | error | time from |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['variant']} | {_cell(r['plan_s'], '{:.0f} s')} | "
                     f"{_cell(r['measured_s'], '{:.0f} s')} | "
                     f"{'in-sample' if r['in_sample'] else _err(r['plan_s'], r['measured_s'])} | "
                     f"{_cell(r['plan_host_mb'])} | {_cell(r['measured_host_mb'])} | "
                     f"{_err(r['plan_host_mb'], r['measured_host_mb'])} | {_cell(r['plan_disk_mb'], '{:,.1f}')} | "
                     f"{_cell(r['measured_disk_mb'], '{:,.1f}')} | {_err(r['plan_disk_mb'], r['measured_disk_mb'])} | "
                     f"{r['basis']} |")
    summary = []
    for label, p, m in (("time", "plan_s", "measured_s"), ("peak host memory", "plan_host_mb", "measured_host_mb"),
                        ("disk", "plan_disk_mb", "measured_disk_mb")):
        errs = sorted(_abs_errors([r for r in rows if not (label == "time" and (r["measured_s"] == 0 or r["in_sample"]))],
                                  p, m))
        if errs:
            summary.append(f"{label}: median absolute error {errs[len(errs) // 2]:.0%}, largest {errs[-1]:.0%} "
                           f"over {len(errs)} stages")
    timed = [r for r in rows if r["plan_s"] is not None and r["measured_s"] is not None and not r["in_sample"]]
    measured = sum(r["measured_s"] for r in timed)
    if measured >= 1:
        planned = sum(r["plan_s"] for r in timed)
        summary.append(f"time of the {len(timed)} stages both have, in all: plan {planned / 60:.1f} min, measured "
                       f"{measured / 60:.1f} min ({(planned - measured) / measured:+.0%})")
    return "\n".join(lines + [""] + summary)


def _prepared_bytes(cfg, summary: dict) -> float | None:
    """What the prepare stage wrote: the files its manifest lists where the stage is on disk (a folder source is
    used in place: only its facts are written), else the original's size (a converted GGUF source)."""
    from pipeline.infra.files import read_json
    from pipeline.infra.model_source import classify_source

    manifest = cfg.model_dir / "original" / "manifest.json"
    if manifest.is_file():
        return float(sum((read_json(manifest).get("files") or {}).values()))
    if classify_source(cfg.model.source)[0] in ("folder", "hub"):
        return None
    return ((summary["variants"].get("original") or {}).get("memory") or {}).get("artifact_bytes")
