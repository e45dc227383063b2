"""summary.json: the versioned summary of a run, assembled from its finished stages (the per-variant result files,
the bandwidth reading, the interleaved speed trials, the load sweep, the calibration sweep), decided, and checked
against the published JSON Schema before anything is written. Nothing here measures: a stage the run lacks is named
in ``stages_missing`` with why, and its figures are absent."""

from __future__ import annotations

import logging
import time

from pipeline.config.summary_contract import SCHEMA_VERSION
from pipeline.figures.capacity import capacity_plan
from pipeline.plan.measured_runs import WORKLOAD_KEYS
from pipeline.decide.bench_summary import attach_benchmarks
from pipeline.decide.variant_summary import imatrix_effects, variant_summary
from pipeline.runtimes import runtime_class
from pipeline.decide.calibration_sweep import load_sweep
from pipeline.decide.load_summary import attach_load
from pipeline.decide.load_summary import load_sweep as load_load
from pipeline.config.summary_contract import DECODING_KEYS, validate_summary
from pipeline.config.schema import Config
from pipeline.decide.recommendation import decide
from pipeline.decide.target import make_target
from pipeline.stages.variant_setup import load_result
from pipeline.decide.stage_times import run_stages
from pipeline.infra.stage_cache import hardware, library_versions

log = logging.getLogger(__name__)


def build_summary(cfg: Config) -> dict:
    from pipeline.plan.budget import kept_allocation, read_budget

    cfg = kept_allocation(cfg)          # a run cut to its budget is summarised with the allocation it ran
    names = cfg.run.variants or [cfg.variant.name]
    results = {}
    for name in names:
        r = load_result(cfg, name)
        results[name] = r or {"status": "skipped", "reason": "not evaluated in this run (no result file)"}
    from pipeline.instruments.bandwidth import load_bandwidth
    from pipeline.figures.speed_trials import WORKERS_FRESH, noise_floor
    from pipeline.stages.speed import finished_speed

    missing = {}
    bandwidth = load_bandwidth(cfg)
    if bandwidth is None and any(r.get("status") == "ok" for r in results.values()):
        missing["bandwidth"] = "no bandwidth reading for this run's thread count"
    speed_run, why = finished_speed(cfg, results)
    if why:
        missing["speed"] = why
    speed_noise = noise_floor(speed_run, cfg.decision.alpha)
    trials = (speed_run or {}).get("trials") or {}
    variants = {name: variant_summary(r, bandwidth, cfg.decision.degeneration, cfg.seed, trials.get(name),
                                     cfg.capacity.context_tokens)
                for name, r in results.items()}
    ok = [r for r in results.values() if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    facts = (first.get("model") or {}).get("facts", {})
    for v in variants.values():
        if v["status"] == "ok" and not v.get("no_native_kernel"):
            latent = runtime_class(v["runtime"]).latent_kv_cache
            v["capacity"] = capacity_plan(v, facts, cfg.capacity, latent)
    adjust_flip_tests(variants, cfg.decision.multiple_comparisons)
    benchmarks = attach_benchmarks(variants, results, cfg.run.bench_tasks, cfg.seed, cfg.decision.multiple_comparisons)
    load_sweep_, why = load_load(cfg, results)
    if why:
        missing["load"] = why
    attach_load(variants, load_sweep_)
    origin = facts.get("origin", "")
    machine = hardware()
    target = make_target(cfg.workload, cfg.decision, cfg.capacity.headroom, machine, facts, cfg.capacity.context_tokens)
    summary = {
        "schema_version": SCHEMA_VERSION,
        "created_unix": time.time(),
        "run": {"name": cfg.run.name, "profile": cfg.profile.name, "suites": cfg.run.suites,
                "threads": cfg.runtime.n_threads, "device": cfg.runtime.device,
                "decoding": {k: getattr(cfg.runtime, k) for k in DECODING_KEYS},
                "bench_tasks": cfg.run.bench_tasks, "bench_limit": cfg.profile.bench_limit,
                "bench_limits": {t: cfg.profile.bench_limit_for(t) for t in cfg.run.bench_tasks},
                # the profile keys that set its token counts as it ran (overrides included): what a plan from this
                # run takes its work to have been (plan.plan_times.measured_work)
                "workload": {k: getattr(cfg.profile, k) for k in WORKLOAD_KEYS},
                # run.budget's fit (pipeline.plan.budget), where the run had a budget
                "budget": read_budget(cfg)},
        "model": {"name": cfg.model.name, "source": cfg.model.source, "origin": origin,
                  **{k: v for k, v in facts.items() if k != "chat_template"}},
        "reference": {"runtime": (first.get("reference") or {}).get("producer"),
                      "top_k": cfg.reference.top_k, "parity": first.get("parity")},
        "variants": variants,
        "recommendation": decide(variants, cfg.decision, speed_noise, target),
        "speed_noise": speed_noise,
        # per runtime that generated some variant's replies other than the reference's: the original's own replies
        # there against the reference (what the runtime switch alone flips)
        "runtime_floor": {sr["runtime"]: sr["runtime_switch_floor"] for v in variants.values()
                          if (sr := (v.get("free_running") or {}).get("same_runtime"))},
        "imatrix_effects": imatrix_effects(variants, cfg.seed),
        # per bench:TASK of run.suites: the task's key, limit and decoding; each variant's row is in its entry
        "benchmarks": benchmarks,
        "calibration_sweep": load_sweep(cfg),     # `quantdrift calibration` of this run, when it has run
        "load": load_sweep_,                      # `quantdrift load` of this run, when it has run
        # per suite: the original's pass rate and whether flips carry signal there (from the first evaluated variant:
        # every variant is checked against the same reference replies)
        "suites": {suite: {**{k: p.get(k) for k in ("conversations", "checks", "reference_pass_rate",
                                                    "no_signal_for_flips")},
                           "checks_hash": (first.get("checks") or {}).get(suite)}
                   for suite, p in (next((v.get("power") for v in variants.values() if v.get("power")), None)
                                    or {}).items()},
        "speed_protocol": {"rounds": (speed_run or {}).get("rounds"), "order": (speed_run or {}).get("order"),
                           "workers": (speed_run or {}).get("workers", WORKERS_FRESH),
                           "kept_workers": (speed_run or {}).get("kept_workers"),
                           # the cheap runtimes' rounds after the interleaved ones, and why they stopped
                           "extra_rounds": len((speed_run or {}).get("extra_order") or []),
                           "extra_labels": sorted({n for r in (speed_run or {}).get("extra_order") or [] for n in r}),
                           "extra_stop": (speed_run or {}).get("extra_stop"),
                           "extra_seconds": (speed_run or {}).get("extra_seconds"),
                           **{k: getattr(cfg.profile.speed, k) for k in ("prompt_tokens", "decode_tokens", "repeats",
                                                                         "warmup", "max_cpu_noise")}},
        # what the run's results cost, stage by stage (each stage's own build time, from its manifest)
        "stage_times": run_stages(cfg, names),
        "decision_config": cfg.decision.__dict__,
        "capacity": cfg.capacity.__dict__,
        "bandwidth": bandwidth,
        # stages the run lacks (their figures are absent), with why: `quantdrift compare` measures them
        "stages_missing": missing,
        "versions": library_versions(),
        "hardware": machine,
    }
    validate_summary(summary)
    return summary


def write_summary(cfg: Config) -> dict:
    """The decision stage: the summary of the run's finished stages, written to summary.json; returns it."""
    from pipeline.infra.files import write_json

    log.info("decision: summarising %d variant(s) into %s", len(cfg.run.variants or [cfg.variant.name]),
             cfg.results_dir)
    summary = build_summary(cfg)
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    # in the order it was built (variants in run order, reasons in the decision's order): the report renders the
    # summary as it is read back, so report.md is reproducible from summary.json alone
    write_json(cfg.results_dir / "summary.json", summary, sort_keys=False)
    return summary


def redecide_summary(cfg: Config) -> dict:
    """The decision of a finished run taken again from its summary.json alone, with ``cfg.decision`` and the
    deployment target of ``cfg.workload`` (on the run's recorded hardware), and written back: every figure is the
    run's own; nothing is measured. The summary records that it was re-decided and when."""
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.files import read_json, write_json

    out_dir = cfg.results_dir
    path = out_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"run.name={cfg.run.name!r}: no summary.json in {out_dir}: expected a finished run "
                          "(make compare, then quantdrift report)")
    summary = read_json(path)
    headroom = (summary.get("capacity") or {}).get("headroom", cfg.capacity.headroom)     # the run's own
    target = make_target(cfg.workload, cfg.decision, headroom, summary.get("hardware"),
                         summary.get("model"), (summary.get("capacity") or {}).get("context_tokens"))
    summary["recommendation"] = decide(summary["variants"], cfg.decision, summary.get("speed_noise"), target)
    summary["decision_config"] = cfg.decision.__dict__
    summary["redecided_unix"] = time.time()
    validate_summary(summary)
    write_json(out_dir / "summary.json", summary, sort_keys=False)
    return summary


def adjust_flip_tests(variants: dict, method: str) -> None:
    """Each variant's exact McNemar p-value of its flips against the original, adjusted across the run's variants
    (the original itself, the reference, is not tested), beside the raw one: ``free_running.mcnemar_p_adjusted``;
    the same for its flips against the original on its own runtime, where it has them."""
    from pipeline.figures.stats import adjust_p

    for v in variants.values():
        if v.get("status") == "ok" and "free_running" in v:
            v["free_running"]["mcnemar_p_adjusted"] = None        # the original: the reference, never tested
    ok = {n: v for n, v in variants.items() if v.get("status") == "ok" and n != "original" and "free_running" in v}
    raw = {n: v["free_running"].get("mcnemar_p") for n, v in ok.items()}
    for n, p in adjust_p(raw, method).items():
        ok[n]["free_running"]["mcnemar_p_adjusted"] = p
    same = {n: sr["vs_original_same_runtime"].get("mcnemar_p") for n, v in ok.items()
            if (sr := v["free_running"].get("same_runtime"))}
    for n, p in adjust_p(same, method).items():
        ok[n]["free_running"]["same_runtime"]["vs_original_same_runtime"]["mcnemar_p_adjusted"] = p
