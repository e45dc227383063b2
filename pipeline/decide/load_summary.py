"""The load sweep as the summary reads it: the run's ``load.json`` shown only beside the evaluation it served
(``load_sweep``, ``sweep_of_run``), judged against the run's workload, and each evaluated variant given its
served-load figures (``attach_load``). Nothing here measures."""

from __future__ import annotations

from pathlib import Path

from pipeline.figures.served_load import rejudge
from pipeline.infra.files import read_json
from pipeline.stages.load import evaluated_as, sweep_figures


def sweep_of_run(sweep: dict, results: dict[str, dict]) -> str | None:
    """Why the load sweep ``sweep`` (a load.json) is not this run's, whose variant results are ``results``; None
    where it is: every evaluated variant of the run it served was served from the artifact the run evaluated."""
    evaluated = sweep.get("evaluated")
    served = [n for n in results if n in sweep.get("variants", {})]
    if evaluated is None:
        return ("it does not record which evaluation it was measured beside (written by an earlier version); "
                "`quantdrift compare` writes it again")
    if not served:
        return f"it measured other variants ({', '.join(sweep.get('variants', {})) or 'none'})"
    other = [n for n in served if (mine := evaluated_as(results[n])) is not None and evaluated.get(n) != mine]
    if other:
        return (f"it served other artifacts of {', '.join(other)} than this run evaluated (an earlier run's sweep); "
                "`quantdrift compare` measures this run's")
    return None


def load_sweep(cfg, results: dict[str, dict]) -> tuple[dict | None, str | None]:
    """This run's load sweep (its load.json, written by `quantdrift compare` or `quantdrift command=load`) for the
    summary and report, judged against the workload of ``cfg`` (``make report ARGS="workload=batch"`` re-decides
    without measuring again) and holding only the variants of ``results`` (this run's results by variant):
    (the sweep, None); (None, why) where the results folder holds a sweep that is not this run's (``sweep_of_run``);
    (None, None) where there is none."""
    path = cfg.results_dir / "load.json"
    if not path.is_file():
        return None, None
    result = read_json(path)
    why = sweep_of_run(result, results)
    if why:
        return None, f"the load sweep in {path} is not shown: {why}"
    stage = Path(result["stage"]) if result.get("stage") else None
    if stage is not None and (stage / "trials.json").is_file():   # the figures from the trials, with this code
        sweep = {**sweep_figures(stage, cfg.workload), "logs": result.get("logs"), "stage": result["stage"]}
    else:
        sweep = rejudge(result, cfg.workload)
    sweep["variants"] = {n: v for n, v in sweep["variants"].items() if n in results}
    return sweep, None


def attach_load(variants: dict, sweep: dict | None) -> None:
    """Give each evaluated variant of the summary its served-load figures (``v["load"]``: throughput_at_slo with its
    interval, the concurrency it was reached at, the knee, the recommendation, the workload), or the reason it has
    none, so that the decision can rank by throughput_at_slo."""
    if not sweep:
        return
    for name, v in variants.items():
        if v.get("status") != "ok":
            continue
        lv = sweep["variants"].get(name)
        if lv is None:
            v["load"] = {"status": "skipped", "reason": "not in this run's load sweep", "workload": sweep["workload"]["name"]}
        elif lv["status"] != "ok":
            v["load"] = {"status": lv["status"], "reason": lv["reason"], "workload": sweep["workload"]["name"]}
        else:
            v["load"] = {"status": "ok", "workload": sweep["workload"]["name"], "engine": lv["engine"],
                         **{k: lv[k] for k in ("throughput_at_slo", "throughput_at_slo_interval",
                                               "throughput_at_slo_concurrency", "knee_concurrency", "knee_reached",
                                               "recommended_concurrency", "slo_depth")}}
