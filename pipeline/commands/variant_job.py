"""One comparison job, top to bottom: prepare -> quantize -> reference -> teacher-forced scoring -> (the screen)
-> free-running -> checks -> benchmark tasks (run.suites' bench:TASK entries) -> per-variant result.

The screen (``decision.screen``): a variant whose mean-KLD 95 % interval, from its teacher-forced scoring, lies
wholly above ``decision.max_kld_mean`` fails that limit whatever else is measured; its result records the figure and
it is not run further (no free-running, checks, benchmarks, speed trials or load sweep).

``evaluate_job(cfg)`` is what one Hydra job runs (one variant). Every stage it calls is cached, so a sweep of
variants shares the prepared original, the F16 conversion, the parity check and the reference transcripts.
"""

from __future__ import annotations

import logging
import time
import traceback

from pipeline.config.summary_contract import SCHEMA_VERSION
from pipeline.config.schema import Config
from pipeline.infra.errors import ConfigError, Interrupted
from pipeline.infra.files import write_json
from pipeline.stages.suite_files import load_suites
from pipeline.stages.variant_setup import result_path, runtime_baseline, setup_reference
from pipeline.suites.records import probe_prompt

log = logging.getLogger(__name__)


def evaluate_job(cfg: Config) -> dict:
    """Evaluate cfg.variant; always leaves a result file (ok, skipped or failed) for the report."""
    from pipeline.suites.conversation import ChatRenderer
    from pipeline.stages.prepare import prepare
    from pipeline.infra.errors import Skip
    from pipeline.stages.quantize import build_artifact

    from pipeline.plan.estimate import refuse_unless_fits

    started = time.time()
    variant = cfg.variant
    base = {"variant": variant.name, "runtime": variant.runtime, "quantizer": variant.quantizer,
            "description": variant.description, "schema_version": SCHEMA_VERSION}
    try:
        refuse_unless_fits(cfg)   # before any work: disk or memory that cannot fit stops here (plan.check=false)
        original = prepare(cfg.model, cfg.model_dir, force=cfg.force)
        from pipeline.instruments.bandwidth import resolve_device, run_bandwidth

        run_bandwidth(cfg, resolve_device(cfg.runtime.device))   # once per run, before any model is loaded
        renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
        suites = load_suites(cfg, original, renderer)
        refs, producer, parity = setup_reference(cfg, original, renderer, suites)
        from pipeline.stages.lmeval_tasks import run_bench
        from pipeline.stages.outcomes import check_variant
        from pipeline.stages.deployment import deployment_path, deployment_suites
        from pipeline.stages.evaluate import evaluate_variant
        from pipeline.stages.score import score_variant
        from pipeline.instruments.probe import probe_spec

        try:
            artifact = build_artifact(variant, original, cfg)
            scores = score_variant(cfg, original, renderer, artifact, suites, refs)
            screened = screen(cfg, scores)
            if screened:
                log.info("%s screened out: %s", variant.name, screened["reason"])
                result = {**base, **screened_result(scores, screened),
                          **shared_result(cfg, artifact, original, producer, refs, parity, suites, started)}
                write_json(result_path(cfg, variant.name), result)
                return result
            free = evaluate_variant(cfg, original, renderer, artifact, suites, refs, producer)
            served_suites = deployment_suites(cfg, parity, suites)
            served = (deployment_path(cfg, original, renderer, artifact, suites, served_suites)
                      if served_suites else None)
            baseline = runtime_baseline(cfg, original, renderer, suites, refs, producer, free["generated_on"])
            checked = check_variant(cfg, suites, refs, free, served, baseline)
            benched = run_bench(cfg, original, renderer, artifact) if cfg.run.bench_tasks else {}
        except Skip as exc:
            result = {**base, "status": "skipped", "reason": str(exc)}
            write_json(result_path(cfg, variant.name), result)
            log.warning("%s skipped: %s", variant.name, exc)
            return result
        result = {
            **base,
            "status": "ok",
            "reason": None,
            # dir: the checks stage's folder (samples.jsonl, served.jsonl); the free-running and scoring stages'
            # folders beside it
            "evaluation": {"dir": checked["dir"], "free_running_dir": free["dir"], "manifest_hash": free["key_hash"],
                           "generated_on": free["generated_on"],
                           "baseline": ({"runtime": baseline["generated_on"], "dir": baseline["dir"],
                                         "manifest_hash": baseline["key_hash"]} if baseline else None),
                           "checks_manifest_hash": checked["key_hash"],
                           "scores_dir": scores["dir"],
                           "scores_manifest_hash": scores["key_hash"],
                           "runtime_info": scores.get("runtime_info") or free.get("runtime_info"),
                           "free_running_source": free.get("free_running_source"),
                           "dequantized_check": free.get("dequantized_check"),
                           "kld_exactness": scores.get("kld_exactness"),
                           "exact_rows": scores.get("exact_rows"),
                           "wall_s": sum(m.get("wall_s") or 0 for m in (free, scores, checked))},
            "deployment": served,
            # per bench:TASK of run.suites: its stage folder (samples.jsonl, metrics.json), or why it was skipped
            "benchmarks": benched,
            # what a speed trial of this variant runs (pipeline.stages.speed measures all variants, interleaved)
            "probe": probe_spec(cfg, variant, artifact,
                                probe_prompt(renderer, suites, cfg.profile.speed.prompt_tokens)),
            **shared_result(cfg, artifact, original, producer, refs, parity, suites, started),
        }
    except Interrupted:       # stopped from outside: no verdict on the variant; the same command resumes
        raise
    except Skip as exc:       # the shared reference set-up found this variant's format unusable on the model
        result = {**base, "status": "skipped", "reason": str(exc)}
        log.warning("%s skipped: %s", variant.name, exc)
    except ConfigError as exc:   # bad input: the CLI stops (exit 2), and the report names the cause, not "not run"
        write_json(result_path(cfg, variant.name), {**base, "status": "failed",
                                                    "reason": f"stopped on bad input: {exc}"})
        raise
    except Exception as exc:  # a variant that fails is reported, and the other variants still run
        log.error("%s failed: %s", variant.name, exc)
        result = {**base, "status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=8)}
    write_json(result_path(cfg, variant.name), result)
    return result


def screen(cfg: Config, scores: dict) -> dict | None:
    """The screen's verdict on a scored variant: {"reason", "kld_mean": its interval, "limit"} where the mean-KLD
    95 % interval (conversations as units, as the summary computes it) lies wholly above ``decision.max_kld_mean``;
    None where it does not, where screening is off or no KLD limit is set, and for the original (every variant's
    flips are counted against its replies)."""
    from pathlib import Path

    from pipeline.figures.stats import conversation_intervals
    from pipeline.infra.files import read_json

    limit = cfg.decision.max_kld_mean
    if not cfg.decision.screen or limit is None or cfg.variant.name == "original":    # the original: the baseline
        return None
    iv = conversation_intervals(read_json(Path(scores["dir"]) / "teacher_forced.json"), [], cfg.seed).get("kld_mean")
    if not iv or iv.get("low") is None or not iv["low"] > limit:
        return None
    return {"reason": (f"mean KLD {iv['estimate']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] over {iv['units']} "
                       f"conversations lies wholly above decision.max_kld_mean={limit:g}: not run further "
                       "(free-running, checks, speed, load; decision.screen=false measures it)"),
            "kld_mean": iv, "limit": limit}


def shared_result(cfg: Config, artifact, original, producer: dict, refs: dict, parity, suites: dict,
                  started: float) -> dict:
    """What every evaluated variant's result file holds, screened or not: its artifact, the reference and checks it
    was measured against, the parity check, the model and the job's wall time."""
    from pipeline.stages.quantize import bits_per_weight
    from pipeline.suites.records import checks_fingerprint

    return {
        "artifact": {"path": str(artifact.path), "bytes": artifact.bytes, "hash": artifact.hash, "info": artifact.info,
                     "bits_per_weight": bits_per_weight(artifact.path, original.facts.get("params"))},
        "reference": {"producer": producer["name"], "suites": {s: r.hash for s, r in refs.items()}},
        "checks": {s: checks_fingerprint(convs) for s, convs in suites.items()},
        "parity": parity,
        "model": {"name": cfg.model.name, "source": cfg.model.source, "facts": original.facts},
        "wall_s": time.time() - started,
    }


def screened_result(scores: dict, screened: dict) -> dict:
    """The rest of a screened variant's result file: ok, with its scoring alone, and what screened it."""
    return {
        "status": "ok",
        "reason": None,
        "screened": screened,
        "evaluation": {"dir": None, "scores_dir": scores["dir"], "scores_manifest_hash": scores["key_hash"],
                       "runtime_info": scores.get("runtime_info"), "kld_exactness": scores.get("kld_exactness"),
                       "exact_rows": scores.get("exact_rows"), "wall_s": scores.get("wall_s") or 0},
        "deployment": None,
        "benchmarks": {},
        "probe": None,
    }
