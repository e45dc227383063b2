"""What a variant job is built from: the shared reference set-up (parity checks, then the reference transcripts:
``setup_reference``), the original's own runtime baseline (``runtime_baseline``), and each variant's result file
(``result_path``, ``load_result``). The job itself is ``pipeline.commands.variant_job``."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config.schema import Config, VariantConfig
from pipeline.infra.errors import ConfigError, Interrupted
from pipeline.infra.files import read_json

log = logging.getLogger(__name__)


def result_path(cfg: Config, variant: str) -> Path:
    return cfg.model_dir / "runs" / cfg.run.name / f"{variant}.result.json"


def setup_reference(cfg: Config, original, renderer, suites: dict) -> tuple[dict, dict, dict | None]:
    """Parity checks, then the reference transcripts. Returns (references, producer, parity)."""
    from pipeline.infra.errors import Skip
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.parity import check_parity, folder_tokenizer_divergence, parity_error, parity_texts
    from pipeline.stages.reference import build_reference, f16_variant

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

    from pipeline.compose import load_variant
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


def load_result(cfg: Config, variant: str) -> dict | None:
    path = result_path(cfg, variant)
    return read_json(path) if path.is_file() else None
