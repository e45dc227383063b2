"""`quantdrift compare` (`make compare`): one comparison, its stages in the order they run.

    budget      run.budget kept: the profile's work cut until the plan fits it, or the run refused (exit 2)
    preflight   what would stop every variant, found once before any work (exit 2)
    variants    each variant of run.variants prepared, quantized, evaluated and scored (one result file each)
    rebudget    a cut run's speed and load rounds given back as far as the variants the screen left allow
    speed       the interleaved speed trials of every evaluated variant, with their A/A noise floor
    load        the served-load sweep (conf/load/NAME.yaml; load=off skips it)
    decision    the summary of the finished stages, decided: summary.json
    report      report.md, report.html, plots and samples rendered from that summary

Every stage resumes from its cache, so a comparison that was stopped goes on where it stopped, and one whose variants
ran elsewhere (a Hydra multirun on a SLURM or joblib launcher: ``quantdrift -m variant=a,b``) goes on from there.
Exit: 0 done; 2 bad input; 3 done, with at least one variant failed (the report lists it).
"""

from __future__ import annotations

import dataclasses
import logging

from pipeline.config.schema import Config
from pipeline.infra.errors import EXIT_BAD_INPUT, EXIT_VARIANT_FAILED, ConfigError

log = logging.getLogger(__name__)


def run_compare(cfg: Config) -> tuple[int, dict]:
    """Every stage of the comparison in order; returns (0 or the variant stage's exit code, the summary)."""
    from pipeline.decide.summary import write_summary
    from pipeline.plan.budget import fit_budget
    from pipeline.report.write import render_report
    from pipeline.stages.preflight import run_preflight

    if not cfg.run.variants:
        raise ConfigError("run.variants: expected the variants to compare, e.g. run.variants=[original,gguf_q8_0]")
    cfg, allocation = fit_budget(cfg)
    run_preflight(cfg)
    code = evaluate_variants(cfg, allocation)
    cfg = rebudget(cfg)
    measure_speed_stage(cfg)
    if cfg.load.name != "off":
        load_stage(cfg)
    summary = write_summary(cfg)
    render_report(cfg, summary)
    return code, summary


def evaluate_variants(cfg: Config, allocation: list[str] = ()) -> int:
    """Each variant's job, one after another in this process (as Hydra's basic launcher runs a multirun), each on
    the config its own `quantdrift variant=NAME` would compose with this command's overrides and ``allocation``
    (the budget's, as overrides). A variant that fails leaves its result file and the others go on; returns 0, 2
    (a variant's configuration was refused) or 3."""
    from pipeline.commands.variant_job import evaluate_job

    code = 0
    for name in cfg.run.variants:
        try:
            result = evaluate_job(variant_config(cfg, name, allocation))
        except ConfigError as exc:
            log.error("%s: %s", name, exc)
            code = max(code, EXIT_BAD_INPUT)
            continue
        log.info("%s: %s%s", name, result["status"], f" ({result['reason']})" if result.get("reason") else "")
        if result["status"] == "failed":
            code = max(code, EXIT_VARIANT_FAILED)
    return code


def variant_config(cfg: Config, name: str, allocation: list[str] = ()) -> Config:
    """The config of variant ``name``'s job: inside a Hydra job, composed from conf/ with this command's own
    overrides (so ``kv_cache=…`` or ``variant.…=`` apply to each variant as they do in a multirun) and then
    ``allocation``'s; called directly (tests), ``cfg`` (which holds the allocation already) with that variant."""
    from pipeline.compose import from_omegaconf, variant_of

    overrides = _task_overrides()
    if overrides is None:
        return dataclasses.replace(cfg, command="evaluate", variant=variant_of(cfg, name))
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from omegaconf import open_dict

    raw = GlobalHydra.instance().hydra.compose_config(  # type: ignore[union-attr]
        "config", overrides + list(allocation) + [f"variant={name}", "command=evaluate"], run_mode=RunMode.RUN)
    with open_dict(raw):
        del raw["hydra"]          # Hydra's own node (its sweep paths resolve only inside a launched job)
    return from_omegaconf(raw)


def _task_overrides() -> list[str] | None:
    """This Hydra job's command-line overrides other than the command and the variant; None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    drop = ("command=", "variant=", "run.variants=")
    return [o for o in HydraConfig.get().overrides.task if not o.startswith(drop)]


def rebudget(cfg: Config) -> Config:
    """``cfg`` with the speed, load and extra rounds a budget's cut took given back as far as the variants the
    screen kept allow (``pipeline.plan.budget_screen``); ``cfg`` itself where nothing was cut or screened out."""
    from pipeline.plan.budget_screen import after_screen
    from pipeline.stages.variant_setup import load_result

    left = [n for n in cfg.run.variants if not (load_result(cfg, n) or {}).get("screened")]
    return after_screen(cfg, left)


def measure_speed_stage(cfg: Config) -> dict | None:
    """The run's bandwidth reading (once per run; a variant job takes it before loading a model) and the
    interleaved speed trials of every evaluated variant."""
    from pipeline.instruments.bandwidth import resolve_device, run_bandwidth
    from pipeline.stages.speed import measure_speed
    from pipeline.stages.variant_setup import load_result

    results = {n: r for n in cfg.run.variants if (r := load_result(cfg, n)) is not None}
    if not any(r.get("status") == "ok" for r in results.values()):
        return None
    run_bandwidth(cfg, resolve_device(cfg.runtime.device))
    return measure_speed(cfg, results)


def load_stage(cfg: Config) -> dict:
    from pipeline.stages.load import format_load
    from pipeline.stages.load import run_load

    result = run_load(cfg)
    print(format_load(result))
    print(f"load sweep: {cfg.results_dir / 'load.json'} (server logs: {result['logs']})")
    for name, v in result["variants"].items():      # reported in load.json and the report; the comparison goes on
        if v["status"] == "failed":
            log.error("load sweep: %s failed: %s", name, v["reason"])
    return result
