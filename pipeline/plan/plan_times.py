"""The plan's times (``quantdrift plan``): each planned stage's seconds from the best comparable measured run
(``pipeline.plan.measured_runs``) through its time model (``pipeline.plan.stage_rates``), rescaled to this
machine's bandwidth and compute, with the work of each measured run as its profile set it."""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.errors import ConfigError


def add_times(cfg, plan: dict, sp, exclude_run: str | None, leave_out: bool = False,
              bandwidth_here: float | None = None, compute_here: float | None = None) -> None:
    """``bandwidth_here``: this machine's bandwidth as already measured (a compared run's own record), instead
    of the calibration's measurement now; with it, ``compute_here`` is that run's compute reading (None: it took
    none, and prompt work is rescaled by bandwidth like the rest). Sets each row's ``time_s`` and ``time_basis``
    and the plan's ``time_basis``."""
    from pipeline.infra.stage_cache import hardware
    import functools

    from pipeline.plan import measured_runs
    from pipeline.plan.measured_runs import calibration_factor, compute_factor, find_runs, rank_runs
    from pipeline.plan.stage_rates import TimeModel

    key = hardware().get("cpu_key")
    ranked = rank_runs(find_runs(Path(cfg.paths.results), Path(cfg.paths.artifacts), exclude=exclude_run),
                       cfg.model.name, key)
    if not ranked:
        plan["time_basis"] = ("no measured run under paths.results to scale from (the committed demo run "
                              "results/smollm2-135m-instruct/quick is one): times not estimated")
        return
    from pipeline.plan import prompt_rates
    from pipeline.plan.quant_rates import seconds_per_weight
    from pipeline.infra.llama_tools import tools_dir

    try:        # llama-quantize's own ggml build, where the tools are built
        quant_tools = str(tools_dir(cfg.bench.llama_tools))
    except ConfigError:
        quant_tools = ""
    # the local machine's bandwidth, measured at most once for all the runs that need it
    measure = functools.cache(functools.partial(measured_runs.bandwidth_here, cfg.runtime.n_threads))
    measure_compute = functools.cache(functools.partial(measured_runs.compute_here, cfg.runtime.n_threads))
    # each ggml type's prompt rate on the local machine; none on a GPU (the figures are of llama.cpp's CPU kernels:
    # a run on a GPU carries prompt work by parameters)
    prompt = None if sp.on_device else functools.partial(prompt_rates.seconds_per_weight,
                                                         threads=cfg.runtime.n_threads, tools=quant_tools)

    @functools.cache
    def model(i: int) -> TimeModel:
        """The time model on the i-th best run."""
        run = ranked[i]
        run.work = measured_work(cfg, run)
        run.reply_budget = {s: w["reply_tokens"] for s, w in run.work.items()}
        factor, basis = calibration_factor(run, key, cfg.runtime.n_threads, measure=measure,
                                           recorded_here=bandwidth_here)
        if bandwidth_here is None:
            cfactor, cbasis = compute_factor(run, measure=measure_compute)
        else:
            cfactor, cbasis = compute_factor(run, recorded_here=compute_here)
        basis = f"{basis}; {cbasis}" if cfactor else basis
        return TimeModel(run=run, factor=factor, basis=basis, leave_out=leave_out, compute_factor=cfactor,
                         plan_budget={s: w["reply_tokens"] for s, w in sp.work.per_suite.items()},
                         plan_work=sp.work.per_suite, plan_params=plan["params"],
                         plan_vocab=int((plan.get("facts") or {}).get("vocab_size") or 0) or None,
                         plan_original_bytes=sp.original_bytes(),
                         plan_speed=measured_runs.speed_protocol(cfg.profile.speed), others=ranked,
                         plan_parity_tokens=cfg.reference.parity_tokens, threads=cfg.runtime.n_threads,
                         quant_rates=functools.partial(seconds_per_weight, tools=quant_tools),
                         prompt_rates=prompt)

    planned_types = {t for fp in plan["rows"] for t in (fp.time_args.get("type_elements") or {})}
    measured_types = {t for r in ranked for e in r.quant_elements.values() for t in e}
    if prompt and planned_types and measured_types:     # every type of this plan measured at once; each ratio reads
        prompt(tuple(sorted(planned_types | measured_types)))
    plan["time_basis"] = model(0).basis
    for fp in plan["rows"]:
        a = fp.time_args
        if fp.time_basis == "reuses the reference transcripts":
            fp.time_s = 0.0
            continue
        name = a.get("key") or fp.variant
        # the best run first; a stage it has nothing comparable for from the next run that has
        for i in range(len(ranked)):
            t, basis = model(i).estimate(fp.stage, name, a["kind"], a["nbytes"], suites=a.get("suites"),
                                         params=a.get("params"), extra=a.get("extra", 1.0),
                                         load_levels=a.get("load_levels"), source=a.get("source"),
                                         builds_exact=a.get("builds_exact", False), labels=a.get("labels", 1),
                                         f16_bytes=a.get("f16_bytes"), type_elements=a.get("type_elements"))
            if i == 0 or t is not None:
                fp.time_s, fp.time_basis = t, basis
            if t is not None:
                break


def measured_work(cfg, mr) -> dict:
    """The measured run's token counts per suite (stage_plan.Workload.per_suite): its profile
    (conf/profile/NAME.yaml) on this catalogue's suites, with the workload settings the run recorded as it ran (a
    cap given on the command line); where the profile is not a file here, the planned run's own profile is
    assumed."""
    import dataclasses

    from pipeline.config.schema import PROJECT_ROOT, ProfileConfig
    from pipeline.config.settings import build_settings
    from pipeline.plan.stage_plan import Workload

    path = PROJECT_ROOT / "conf" / "profile" / f"{mr.profile}.yaml"
    profile = cfg.profile
    if path.is_file():
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        raw = {k: v for k, v in raw.items() if k != "defaults"}
        profile = build_settings(ProfileConfig, raw, f"profile {mr.profile}")
    if mr.workload:         # what the run recorded of its token counts' settings (its overrides included)
        profile = dataclasses.replace(profile, **{k: v for k, v in mr.workload.items() if hasattr(profile, k)})
    suites = [s for s in mr.suites if s in cfg.suites] or list(cfg.run.suites)
    other = dataclasses.replace(cfg, profile=profile, run=dataclasses.replace(cfg.run, suites=suites))
    return Workload.of(other).per_suite
