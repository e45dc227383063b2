"""Is a GPTQ/AWQ result limited by its recipe? Each variant of ``calibration_sweep.variants`` is quantized again
at every count of ``calibration_sweep.samples`` calibration texts (everything else of its recipe unchanged) and
scored teacher-forced on the run's own reference, exactly as `make compare` scores it: mean KLD over every reply
token with a 95 % bootstrap interval over conversations, and the paired change against the largest count (the
same token positions, so the interval is much narrower than either figure's own).

Written to results/<model>/<run>/calibration_sweep.json; the report of that run shows it. Artifacts and scores
are cached stages like every other (a count equal to the variant's own reuses its artifact), so a rerun costs
nothing and an interrupted sweep resumes."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from pipeline.config.schema import Config, VariantConfig
from pipeline.compose import load_variant
from pipeline.infra.errors import Skip
from pipeline.infra.files import read_json, write_json
from pipeline.decide.calibration_sweep import SWEEP_FILE

log = logging.getLogger(__name__)



def swept_variant(variant: VariantConfig, samples: int) -> VariantConfig:
    """``variant`` calibrated on ``samples`` texts: the variant itself when that is its own count, else a copy
    named NAME.calibN whose artifact lives beside (never over) the variant's own."""
    calibration = (variant.quantize or {}).get("calibration")
    if calibration is None:
        from pipeline.infra.errors import ConfigError

        raise ConfigError(f"calibration_sweep.variants: {variant.name!r} has no calibration settings "
                          "(quantize.calibration): expected a GPTQ/AWQ variant")
    if calibration.get("samples") == samples:
        return variant
    quantize = copy.deepcopy(variant.quantize)
    quantize["calibration"]["samples"] = samples
    name = f"{variant.name}.calib{samples}"
    return dataclasses.replace(variant, name=name, base=name, quantize=quantize,
                               description=f"{variant.description}, {samples} calibration texts")


def kld_by_conversation(tf: dict) -> dict[str, list]:
    """[sum of per-token KLD, tokens] per suite/conversation of a teacher_forced.json."""
    return {f"{suite}/{cid}": [float(np.sum(c["kld"], dtype=np.float64)), len(c["kld"])]
            for suite, convs in tf.items() for cid, c in convs.items()}


def sweep_rows(measured: list[dict], seed: int = 0) -> list[dict]:
    """Per measured point (variant, samples, per-conversation KLD): mean KLD with its bootstrap interval, and the
    paired change against the same variant's largest sample count (its interval; significant when it excludes 0)."""
    from pipeline.figures.stats import bootstrap_ratio

    rows = []
    for m in measured:
        per = m["kld_by_conversation"]
        convs = sorted(per)
        ci = bootstrap_ratio([per[c][0] for c in convs], [per[c][1] for c in convs], seed)
        row = {k: v for k, v in m.items() if k != "kld_by_conversation"}
        row.update({"kld_mean": ci["estimate"], "kld_low": ci["low"], "kld_high": ci["high"],
                    "conversations": len(convs), "tokens": int(sum(per[c][1] for c in convs))})
        top = max((o for o in measured if o["variant"] == m["variant"]), key=lambda o: o["samples"])
        row["compared_to"] = top["samples"]
        if top is not m:
            other = top["kld_by_conversation"]
            common = [c for c in convs if c in other and other[c][1] == per[c][1] and per[c][1] > 0]
            d = bootstrap_ratio([per[c][0] - other[c][0] for c in common], [per[c][1] for c in common], seed)
            row.update({"delta": d["estimate"], "delta_low": d["low"], "delta_high": d["high"],
                        "significant": bool(d["low"] > 0 or d["high"] < 0)})
        rows.append(row)
    return rows


def run_sweep(cfg: Config) -> dict:
    """Quantize and score every (variant, sample count); write and return the sweep."""
    from pipeline.suites.conversation import ChatRenderer
    from pipeline.stages.score import score_variant
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.quantize import bits_per_weight
    from pipeline.stages.suite_files import load_suites
    from pipeline.stages.variant_setup import setup_reference

    sc = cfg.calibration_sweep
    original = prepare(cfg.model, cfg.model_dir, force=cfg.force)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    suites = load_suites(cfg, original, renderer)
    refs, _, _ = setup_reference(cfg, original, renderer, suites)
    measured, skipped = [], []
    for name in sc.variants:
        base = load_variant(name)
        for samples in sc.samples:
            variant = swept_variant(base, samples)
            started = time.time()
            try:
                artifact = build_artifact(variant, original, cfg)
            except Skip as exc:
                log.warning("%s skipped: %s", variant.name, exc)
                skipped.append({"variant": name, "samples": samples, "reason": str(exc)})
                continue
            scores = score_variant(dataclasses.replace(cfg, variant=variant), original, renderer, artifact,
                                   suites, refs)
            tf = read_json(Path(scores["dir"]) / "teacher_forced.json")
            info = artifact.info
            measured.append({
                "variant": name, "samples": samples, "artifact_variant": variant.name,
                "calibration_samples": info.get("calibration_samples"),
                "calibration_tokens": info.get("calibration_tokens"),
                "quantize_wall_s": info.get("quantize_wall_s"),
                "producer": info.get("producer"),
                "bits_per_weight": bits_per_weight(artifact.path, original.facts.get("params")),
                "kld_by_conversation": kld_by_conversation(tf),
            })
            log.info("%s at %d calibration texts: scored in %.0f s", name, samples, time.time() - started)
    sweep = {"run": cfg.run.name, "suites": list(refs), "samples": list(sc.samples),
             "rows": sweep_rows(measured, cfg.seed), "skipped": skipped, "created_unix": time.time()}
    write_json(cfg.results_dir / SWEEP_FILE, sweep)
    return sweep
