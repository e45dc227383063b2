"""The `quantdrift` console script: a thin Hydra wrapper around ``run(cfg)``.

    quantdrift compare run.variants=[a,b,c] [overrides]   a whole comparison, stage by stage (make compare)
    quantdrift [overrides]                      evaluate one variant (default command)
    quantdrift -m variant=a,b,c [overrides]     a sweep, one Hydra job per variant
    quantdrift report [overrides]               render the run's finished stages (measures nothing)
    quantdrift bench|prepare [overrides]
    quantdrift redecide [decision=...] [workload=...]   the decision of a finished run's summary.json taken again
    quantdrift regress [baseline=PATH] [overrides]   nightly gate: exit 0 ok, 1 regression, 2 the run failed
    quantdrift baseline promote RUN [overrides]      make results/<model>/RUN the baseline (old one kept)
    quantdrift corpus variant=NAME file=PATH ctx=512 [json=true]
    quantdrift calibration [calibration_sweep.variants=[...]] [calibration_sweep.samples=[...]]
    quantdrift load run.variants=[...] [load=short|full] [workload=chat|batch]   served load sweep
    quantdrift plan [model=...|model.source=...] [run.variants=[...]] [plan.compare=true]   cost before any work
    quantdrift stage_costs run.variants=[...]   a finished run's llama.cpp stages beside llama.cpp's own tools

Exit codes: 0 done; 2 bad input or configuration (the message says which and what was expected);
3 the run finished but at least one variant failed (the report lists it).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from pipeline.config.schema import PROJECT_ROOT, Config
from pipeline.infra.errors import EXIT_BAD_INPUT, EXIT_VARIANT_FAILED, ConfigError, Interrupted
from pipeline.compose import register_resolvers

log = logging.getLogger("quantdrift")

_CORPUS_SHORTHAND = ("file", "ctx", "json", "max_chunks", "baseline")

_exit_code = 0


def _evaluate(cfg: Config) -> int:
    from pipeline.commands.variant_job import evaluate_job

    result = evaluate_job(cfg)
    log.info("%s: %s%s", result["variant"], result["status"], f" ({result['reason']})" if result.get("reason") else "")
    return EXIT_VARIANT_FAILED if result["status"] == "failed" else 0


def _compare(cfg: Config) -> int:
    from pipeline.commands.compare import run_compare

    code, summary = run_compare(cfg)
    _print_headline(cfg, summary)
    return max(code, _failed(summary))


def _report(cfg: Config) -> int:
    from pipeline.report.write import write_report

    summary = write_report(cfg)
    _print_headline(cfg, summary)
    missing = summary.get("stages_missing") or {}
    for stage, why in missing.items():
        print(f"not in this report: {stage} ({why}); `quantdrift compare` measures it", file=sys.stderr)
    return _failed(summary)


def _redecide(cfg: Config) -> int:
    from pipeline.decide.summary import redecide_summary
    from pipeline.report.write import render_report

    summary = redecide_summary(cfg)
    render_report(cfg, summary)
    _print_headline(cfg, summary)
    return 0


def _print_headline(cfg: Config, summary: dict) -> None:
    rec = summary["recommendation"]
    print(f"report: {cfg.results_dir / 'report.md'}")
    print(f"recommendation: {rec['variant'] or 'none'} — {rec['summary']}")


def _failed(summary: dict) -> int:
    """EXIT_VARIANT_FAILED, naming them, where a variant of the summary failed; else 0."""
    failed = [n for n, v in summary["variants"].items() if v["status"] == "failed"]
    if failed:
        print(f"failed variants: {', '.join(failed)}", file=sys.stderr)
        return EXIT_VARIANT_FAILED
    return 0


def _regress(cfg: Config) -> int:
    from pipeline.decide.nightly_gate import run_regress

    return run_regress(cfg)


def _baseline(cfg: Config) -> int:
    from pipeline.decide.nightly_gate import promote

    if not cfg.regress.promote:
        raise ConfigError("baseline: expected `quantdrift baseline promote RUN` (RUN: a folder under "
                          f"{cfg.paths.results}/{cfg.model.name}/)")
    return promote(cfg, cfg.regress.promote)


def _corpus(cfg: Config) -> int:
    from pipeline.commands.corpus import run_corpus

    return run_corpus(cfg)


def _bench(cfg: Config) -> int:
    from pipeline.commands.llama_bench import run_bench

    return run_bench(cfg)


def _stage_costs(cfg: Config) -> int:
    from pipeline.commands.stage_costs import run_stage_costs

    run_stage_costs(cfg)
    return 0


def _calibration(cfg: Config) -> int:
    from pipeline.commands.calibration import run_sweep

    sweep = run_sweep(cfg)
    for r in sweep["rows"]:
        print(f"{r['variant']} at {r['samples']} calibration texts: mean KLD {r['kld_mean']:.4f} "
              f"[{r['kld_low']:.4f}, {r['kld_high']:.4f}]")
    for s in sweep["skipped"]:
        print(f"{s['variant']} at {s['samples']} calibration texts: skipped ({s['reason']})")
    print(f"calibration sweep: {cfg.results_dir / 'calibration_sweep.json'}")
    return 0


def _prepare(cfg: Config) -> int:
    from pipeline.stages.prepare import prepare

    original = prepare(cfg.model, cfg.model_dir, force=cfg.force)
    print(f"original: {original.checkpoint}")
    return 0


def _preflight(cfg: Config) -> int:
    from pipeline.stages.preflight import run_preflight

    return run_preflight(cfg)


def _plan(cfg: Config) -> int:
    if cfg.plan.compare:
        from pipeline.plan.compare import compare_run

        print(compare_run(cfg))
        return 0
    from pipeline.plan.budget import fit_line
    from pipeline.plan.estimate import run_plan

    code = run_plan(cfg)
    line = fit_line(cfg)        # what `make compare` will cut to keep run.budget, or why it cannot
    if line:
        print(line)
    return code


def _load(cfg: Config) -> int:
    from pipeline.commands.compare import load_stage

    load_stage(cfg)
    return 0


# command -> what runs it (Config.COMMANDS lists the same names; a test checks they agree)
COMMANDS = {"evaluate": _evaluate, "compare": _compare, "report": _report, "redecide": _redecide, "regress": _regress,
            "baseline": _baseline,
            "corpus": _corpus, "bench": _bench, "prepare": _prepare, "calibration": _calibration,
            "load": _load, "plan": _plan, "preflight": _preflight, "stage_costs": _stage_costs}


def run(cfg: Config) -> int:
    """Run one command on a typed config; returns the exit code. Tests call this directly."""
    from pipeline.infra.offline import configure
    from pipeline.infra.model_source import classify_source

    kind, _ = classify_source(cfg.model.source)
    configure(needs_hub=kind == "hub")
    return COMMANDS[cfg.command](cfg)


def _translate(argv: list[str]) -> list[str]:
    if argv and argv[0] in Config.COMMANDS:
        cmd, rest = argv[0], argv[1:]
        if cmd == "corpus":
            rest = [f"corpus.{a}" if a.split("=", 1)[0] in _CORPUS_SHORTHAND else a for a in rest]
        if cmd == "regress":
            rest = [f"regress.{a}" if a.split("=", 1)[0] in ("baseline", "junit", "compare_all") else a for a in rest]
        if cmd == "baseline":
            if len(rest) < 2 or rest[0] != "promote" or "=" in rest[1]:
                rest = ["regress.promote="] + rest      # validated in run(): names the expected form
            else:
                rest = [f"regress.promote={rest[1]}"] + rest[2:]
        return [f"command={cmd}"] + rest
    return argv


def _task(dcfg) -> None:
    global _exit_code
    from pipeline.compose import from_omegaconf

    try:
        cfg = from_omegaconf(dcfg)
        code = run(cfg)
    except ConfigError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except Interrupted as exc:      # stopped from outside: said in the job's own log, then the job ends with it
        log.error("interrupted: %s", exc)
        raise
    _exit_code = max(_exit_code, code)


def main() -> None:
    import hydra

    register_resolvers()
    from pipeline.infra.stage_cache import INVOCATION_ENV

    os.environ.setdefault(INVOCATION_ENV, repr(time.time()))     # force=true redoes a stage once per invocation
    sys.argv = [sys.argv[0]] + _translate(sys.argv[1:])
    entry = hydra.main(config_path=str(PROJECT_ROOT / "conf"), config_name="config", version_base="1.3")(_task)
    try:
        entry()
    except SystemExit as exc:
        # Hydra reports composition errors itself (an unknown group option comes with the list of known ones)
        # and exits 1; our own task never exits, so any such exit is a configuration problem.
        if exc.code not in (0, None):
            sys.exit(EXIT_BAD_INPUT)
        raise
    sys.exit(_exit_code)


if __name__ == "__main__":
    main()
