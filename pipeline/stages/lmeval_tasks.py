"""Stage 4b, the benchmark tasks of a run (``run.suites`` entries ``bench:TASK``) on one variant: each task through
lm-eval on the variant's own runtime (``pipeline.suites.lmeval``), its per-sample rows and metrics kept, one stage
per task and variant. The flips against the original are computed in the summary
(``pipeline.decide.bench_summary``), from the rows of both.

Decoding: plain greedy (``BENCH_DECODING``: repetition penalty 1.0), whatever ``runtime.repeat_penalty`` the
conversation suites use. A benchmark is scored as published (lm-eval's own models decode greedily without a
penalty), and a penalty would punish the repeated identifiers a completed function must use; the
conversation suites' penalty keeps the demo model out of loops in long business replies, which a task whose
replies are stopped at its stop strings (HumanEval) or never generated (multiple choice) does not need. The rule is
in every stage's key and manifest and in the summary.

Resume: a stage whose key matches is skipped; an interrupted one answers again only the requests it had not
reached (lm-eval's per-request SQLite cache, kept in the stage's journal folder under the key's hash, removed once
the stage completes).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.infra.code_version import code_version
from pipeline.infra.errors import Skip
from pipeline.infra.files import stable_hash, write_json, write_jsonl
from pipeline.infra.stage_cache import journal_path, run_stage
from pipeline.quantizers.base import Artifact
from pipeline.runtimes import runtime_key
from pipeline.infra.model_source import Original

log = logging.getLogger(__name__)

# the decoding every benchmark runs with (the runtime.* settings it overrides)
BENCH_DECODING = {"repeat_penalty": 1.0}
# prompt + reply tokens a request may hold (HumanEval: its longest prompt, 395 tokens in SmolLM2's vocabulary, and
# the 1024-token reply cap fit); never more than the model's own context
BENCH_CONTEXT_TOKENS = 2048


def bench_dir(cfg: Config, variant: str, task: str) -> Path:
    """The stage folder of ``task`` on ``variant`` in this run."""
    from pipeline.infra.stage_folders import bench_folder

    return bench_folder(cfg.model_dir / "runs" / cfg.run.name, variant, task)


def bench_config(cfg: Config) -> Config:
    """``cfg`` with the benchmarks' decoding rule in place of the conversation suites' (``BENCH_DECODING``)."""
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **BENCH_DECODING))


def bench_key(cfg: Config, original: Original, artifact: Artifact, task: str) -> dict:
    """What a task's answers on cfg.variant depend on: the task (its ``key``: name, version, data hash, lm-eval's
    version, a generating task's reply cap), the variant's runtime under the benchmark decoding (weights, runtime,
    options, threads, device, settings, runtime code), the tokenizer feeding it (the original's), the sample limit,
    the context and the adapter's code."""
    from pipeline.suites.lmeval.tasks import get_task

    runtime = runtime_key(bench_config(cfg), artifact)
    return {"task": get_task(task).key(), **runtime, "tokenizer": original.hash, "limit": cfg.profile.bench_limit_for(task),
            "context_tokens": min(BENCH_CONTEXT_TOKENS, original.facts.get("context_length") or BENCH_CONTEXT_TOKENS),
            # code run unconfined (accepted explicitly) is not the confined run's result
            **({"unconfined": True} if cfg.bench.allow_unconfined and get_task(task).unsafe_code else {}),
            "code": {**runtime["code"], **code_version("pipeline.suites.lmeval.adapter", "pipeline.suites.lmeval.tasks",
                                                       "pipeline.suites.lmeval.registry",
                                                       "pipeline.suites.lmeval.sandbox")}}


def bench_task(cfg: Config, original: Original, renderer, artifact: Artifact, task: str) -> dict:
    """``task`` on cfg.variant as a stage: ``samples.jsonl`` (one row per sample: id, correct, metrics, response,
    target) and ``metrics.json`` (the task's key, metrics, limit, decoding, runtime, HumanEval's sandbox record).
    Returns the manifest with ``dir``."""
    from pipeline.suites.lmeval.tasks import run_task

    out_dir = bench_dir(cfg, cfg.variant.name, task)
    key = bench_key(cfg, original, artifact, task)
    bcfg = bench_config(cfg)

    def build(tmp: Path) -> dict:
        from pipeline.suites.lmeval.adapter import RuntimeLM

        work = journal_path(out_dir)
        lm = RuntimeLM.for_variant(bcfg, artifact.path, renderer.tok, original.facts["eos_token_ids"],
                                   n_ctx=key["context_tokens"])
        try:
            res = run_task(lm, task, work / "datasets", cfg.profile.bench_limit_for(task),
                           use_cache=work / f"requests-{stable_hash(key)[:16]}",
                           allow_unconfined=cfg.bench.allow_unconfined)
            info = lm.info
        finally:
            lm.runtime.close()
        write_jsonl(tmp / "samples.jsonl", res["samples"])
        facts = {"task": res["task"], "metric": res["correct_metric"], "sample_id": res["sample_id"],
                 "metrics": res["metrics"], "limit": cfg.profile.bench_limit_for(task),
                 "samples": len(res["samples"]), "correct": sum(bool(s["correct"]) for s in res["samples"]),
                 "decoding": {**BENCH_DECODING, "rule": info["decoding"]}, "runtime_info": info,
                 "sandbox": res.get("sandbox")}
        write_json(tmp / "metrics.json", {**facts, "task_wall_s": res["wall_s"]})
        return facts

    manifest = run_stage(f"bench:{task}:{cfg.variant.name}", out_dir, key, build, force=cfg.force)
    return {**manifest, "dir": str(out_dir)}


def bench_problems(cfg: Config) -> list[str]:
    """Why each bench:TASK of the run cannot run anywhere (an unknown name, a registry task that is a group or has
    no right/wrong metric, data not found offline): the pre-flight's check, one line per task."""
    from pipeline.infra.errors import ConfigError
    from pipeline.suites.lmeval.tasks import get_task

    problems = []
    for task in cfg.run.bench_tasks:
        try:
            get_task(task)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def run_bench(cfg: Config, original: Original, renderer, artifact: Artifact) -> dict[str, dict]:
    """Every benchmark task of the run on cfg.variant: per task ``{"status": "ok", "dir", "manifest_hash",
    "metrics", "samples", "wall_s"}``, or ``{"status": "skipped", "reason"}`` where the variant's runtime cannot
    run the task here (the variant's other results stand). A task that cannot run anywhere (``bench_problems``)
    raises its ConfigError: bad input, not a skip."""
    from pipeline.suites.lmeval.sandbox import refusal
    from pipeline.suites.lmeval.tasks import get_task

    out = {}
    for task in cfg.run.bench_tasks:
        if get_task(task).unsafe_code and (why := refusal(cfg.bench.allow_unconfined)):
            log.error("bench:%s on %s refused: %s", task, cfg.variant.name, why)
            out[task] = {"status": "skipped", "reason": why}
            continue
        try:
            m = bench_task(cfg, original, renderer, artifact, task)
        except Skip as exc:
            log.warning("bench:%s on %s skipped: %s", task, cfg.variant.name, exc)
            out[task] = {"status": "skipped", "reason": str(exc)}
            continue
        out[task] = {"status": "ok", "dir": m["dir"], "manifest_hash": m["key_hash"], "metrics": m["metrics"],
                     "samples": m["samples"], "wall_s": m.get("wall_s")}
    return out
