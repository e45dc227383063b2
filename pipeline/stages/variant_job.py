"""One comparison job, top to bottom: prepare -> quantize -> reference -> evaluate -> benchmark tasks (run.suites'
bench:TASK entries) -> per-variant result.

``evaluate_job(cfg)`` is what one Hydra job runs (one variant). Every stage it calls is cached, so a sweep of
variants shares the prepared original, the F16 conversion, the parity check and the reference transcripts.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

from pipeline.config.summary_contract import SCHEMA_VERSION
from pipeline.config.schema import Config, VariantConfig
from pipeline.infra.errors import ConfigError, Interrupted
from pipeline.infra.files import read_json, write_json
from pipeline.stages.suite_files import load_suites

log = logging.getLogger(__name__)


def result_path(cfg: Config, variant: str) -> Path:
    return cfg.model_dir / "runs" / cfg.run.name / f"{variant}.result.json"


def probe_prompt(renderer, suites: dict, n_tokens: int) -> list[int]:
    """A fixed business prompt of exactly n_tokens for the speed probe (same ids for every variant)."""
    texts = [t.user for convs in suites.values() for c in convs for t in c.turns]
    ids: list[int] = []
    while len(ids) < n_tokens:
        for text in texts:
            ids += renderer.encode(text + "\n\n")
            if len(ids) >= n_tokens:
                break
    return ids[:n_tokens]


def setup_reference(cfg: Config, original, renderer, suites: dict) -> tuple[dict, dict, dict | None]:
    """Parity checks, then the reference transcripts. Returns (references, producer, parity)."""
    from pipeline.infra.errors import Skip
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import (build_reference, check_parity, f16_variant, folder_tokenizer_divergence,
                                           parity_error, parity_texts)

    # every suite text as the runtimes see it: the GGUF tokenizer and the folder's tokenizer.json are checked on it
    texts = {name: parity_texts(convs, renderer) for name, convs in suites.items()}
    parity = None
    f16 = None
    f16v = f16_variant()
    try:
        f16 = build_artifact(f16v, original, cfg)
    except Skip as exc:
        log.warning("no GGUF for this model (%s): the reference is generated on the hf runtime", exc)
        parity = {"ok": False, "skipped": str(exc)}
    is_gguf = cfg.variant.quantizer == f16v.quantizer
    if f16 is not None:
        try:
            parity = check_parity(cfg, original, f16.path, f16.hash, renderer, texts)
        except Interrupted:
            raise
        except Exception as exc:      # llama.cpp refusing the converted file costs the GGUF variants only
            why = f"llama.cpp could not load the F16 GGUF converted from this model ({type(exc).__name__}: {exc})"
            if is_gguf:
                raise Skip(why + ": no GGUF variant can be measured") from exc
            log.error("%s: the reference is generated on the hf runtime", why)
            parity, f16 = {"ok": False, "skipped": why}, None
    if f16 is not None:
        problem = parity_error(parity)
        if problem and is_gguf:
            raise Skip(problem)
        if problem:
            log.error("parity check failed: %s", problem)
        tok = parity["tokenizer"]
        if tok["diverging_texts"]:
            log.warning("the GGUF tokenizer (pre-tokenizer %r) splits %d of %d suite texts differently from the HF "
                        "tokenizer (%d of %d tokens); every runtime is fed the HF ids, and the deployment path "
                        "measures what a server tokenizing text itself would do", tok["gguf_pre_tokenizer"],
                        tok["diverging_texts"], tok["texts"], tok["diverging_tokens"], tok["hf_tokens"])
    folder = folder_tokenizer_divergence(original.checkpoint, renderer, texts)
    if folder.get("diverging_texts"):
        log.warning("transformers loaded %s for %s, which splits %d of %d suite texts differently from the "
                    "folder's own tokenizer.json (what a server reading that file applies)", folder["loaded"],
                    original.checkpoint, folder["diverging_texts"], folder["texts"])
    parity = {**(parity or {}), "folder_tokenizer": folder}
    use_gguf = cfg.reference.runtime == "gguf_f16" or (cfg.reference.runtime == "auto" and parity and parity.get("ok"))
    if cfg.reference.runtime == "gguf_f16" and not (parity and parity.get("ok")):
        raise ConfigError("reference.runtime=gguf_f16 needs a passing F16 parity check: " + str(parity))
    if use_gguf:
        producer = {"name": f"{f16v.name}@{f16v.runtime}", "variant": f16v, "path": f16.path, "hash": f16.hash}
    else:
        orig = VariantConfig(name="original")
        producer = {"name": f"{orig.name}@{orig.runtime}", "variant": orig,
                    "path": original.checkpoint, "hash": original.hash}
    refs = {name: build_reference(cfg, original, renderer, name, convs, producer) for name, convs in suites.items()}
    return refs, producer, parity


def runtime_baseline(cfg: Config, original, renderer, suites: dict, refs: dict, producer: dict,
                     runtime: str) -> dict | None:
    """The original's own free-running on ``runtime``, where a variant's replies were generated on a runtime other
    than the reference's producer: its flips against this baseline are the variant's own, without the runtime
    switch's (llama.cpp -> transformers: other kernels, other rounding, other greedy picks), and this baseline's
    flips against the reference are the runtime switch's own floor. A stage shared by every variant on that
    runtime; None where the replies came from the producer's runtime."""
    import dataclasses

    from pipeline.config.compose import load_variant
    from pipeline.stages.evaluate import evaluate_variant
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import f16_variant

    if runtime == producer["variant"].runtime:
        return None
    candidates = [v for v in (load_variant("original"), f16_variant()) if v.runtime == runtime]
    if not candidates:
        log.warning("no baseline of the original on runtime %r: flips of variants generated there include the "
                    "runtime switch", runtime)
        return None
    variant = candidates[0]
    artifact = build_artifact(variant, original, cfg)
    return evaluate_variant(dataclasses.replace(cfg, variant=variant), original, renderer, artifact, suites, refs,
                            producer, folder=f"original@{runtime}", reuse=False)


def evaluate_job(cfg: Config) -> dict:
    """Evaluate cfg.variant; always leaves a result file (ok, skipped or failed) for the report."""
    from pipeline.suites.conversation import ChatRenderer
    from pipeline.stages.prepare import prepare
    from pipeline.infra.errors import Skip
    from pipeline.stages.quantize import build_artifact

    from pipeline.stages.plan import refuse_unless_fits

    started = time.time()
    variant = cfg.variant
    base = {"variant": variant.name, "runtime": variant.runtime, "quantizer": variant.quantizer,
            "description": variant.description, "schema_version": SCHEMA_VERSION}
    try:
        refuse_unless_fits(cfg)   # before any work: disk or memory that cannot fit stops here (plan.check=false)
        original = prepare(cfg.model, cfg.model_dir, force=cfg.force)
        from pipeline.measure.bandwidth import resolve_device, run_bandwidth

        run_bandwidth(cfg, resolve_device(cfg.runtime.device))   # once per run, before any model is loaded
        renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
        suites = load_suites(cfg, original, renderer)
        refs, producer, parity = setup_reference(cfg, original, renderer, suites)
        from pipeline.stages.bench import run_bench
        from pipeline.stages.checks import check_variant
        from pipeline.stages.deployment import deployment_path, deployment_suites
        from pipeline.stages.evaluate import evaluate_variant
        from pipeline.stages.score import score_variant
        from pipeline.stages.quantize import bits_per_weight
        from pipeline.suites.records import checks_fingerprint
        from pipeline.measure.probe import probe_spec

        try:
            artifact = build_artifact(variant, original, cfg)
            free = evaluate_variant(cfg, original, renderer, artifact, suites, refs, producer)
            scores = score_variant(cfg, original, renderer, artifact, suites, refs)
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
            "artifact": {"path": str(artifact.path), "bytes": artifact.bytes, "hash": artifact.hash,
                         "info": artifact.info,
                         "bits_per_weight": bits_per_weight(artifact.path, original.facts.get("params"))},
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
            "reference": {"producer": producer["name"], "suites": {s: r.hash for s, r in refs.items()}},
            "checks": {s: checks_fingerprint(convs) for s, convs in suites.items()},
            "parity": parity,
            "model": {"name": cfg.model.name, "source": cfg.model.source, "facts": original.facts},
            "wall_s": time.time() - started,
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


def load_result(cfg: Config, variant: str) -> dict | None:
    path = result_path(cfg, variant)
    return read_json(path) if path.is_file() else None
