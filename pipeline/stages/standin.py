"""The dequantized stand-in: GPTQ/AWQ weights dequantized exactly and converted to an F16 GGUF, used for
free-running on llama.cpp only where it reproduces the real kernel on a teacher-forced sample."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pipeline.figures import drift as metrics
from pipeline.config.schema import Config
from pipeline.infra.model_source import Original
from pipeline.quantizers.base import Artifact
from pipeline.stages.reference import SuiteReference, n_ctx_for
from pipeline.runtimes import load_runtime
from pipeline.infra.stage_cache import run_stage
from pipeline.stages.score import longest_scored

log = logging.getLogger(__name__)


# Artifact formats whose weights ``pipeline.quantizers.dequant`` writes out exactly as a dense checkpoint (the
# stand-in for free-running): GPTQModel's GPTQ and AWQ, llm-compressor's compressed-tensors.
DEQUANTIZABLE = ("gptq", "awq", "compressed-tensors")
PROXY_MAX_KLD_GAP = 0.05       # relative gap of mean KLD, kernel vs dequantized stand-in
PROXY_MIN_TOP1_AGREEMENT = 0.90
PROXY_SAMPLE_TOKENS = 512


def proxy_check(kernel_rt, proxy_rt, ref: SuiteReference, top_k: int) -> dict:
    """Does the dequantized stand-in reproduce the real kernel? Teacher-forced on a sample of the reference."""
    tr = longest_scored(ref)
    s = ref.scores[tr["id"]]
    n = min(PROXY_SAMPLE_TOKENS, len(s["pos"]))
    pos = s["pos"][:n]
    cand = np.concatenate([s["topk_ids"][:n].astype(np.int64), np.asarray(tr["ids"])[pos + 1][:, None]], axis=1)
    sk, sp = kernel_rt.score(tr["ids"], pos.tolist(), cand), proxy_rt.score(tr["ids"], pos.tolist(), cand)
    lp_k, am_k, lp_p, am_p = sk.logprobs, sk.argmax, sp.logprobs, sp.argmax
    kld_k = float(metrics.kld_topk_tail(s["topk_lp"][:n], s["tail"][:n], lp_k[:, :top_k]).mean())
    kld_p = float(metrics.kld_topk_tail(s["topk_lp"][:n], s["tail"][:n], lp_p[:, :top_k]).mean())
    gap = abs(kld_p - kld_k) / max(kld_k, 1e-12)
    agree = float((am_k == am_p).mean())
    return {"sample": f"{ref.suite}/{tr['id']}", "tokens": int(n), "kld_kernel": kld_k, "kld_dequantized": kld_p,
            "kld_gap": gap, "top1_agreement": agree,
            "ok": gap <= PROXY_MAX_KLD_GAP and agree >= PROXY_MIN_TOP1_AGREEMENT,
            "limits": {"max_kld_gap": PROXY_MAX_KLD_GAP, "min_top1_agreement": PROXY_MIN_TOP1_AGREEMENT}}


def dequantized_proxy(cfg: Config, artifact: Artifact) -> Path:
    """An F16 GGUF of the quantized model's exact dequantized weights (cached beside the artifact)."""
    from pipeline.quantizers.dequant import write_dense_checkpoint
    from pipeline.quantizers.gguf import convert_checkpoint

    dense_dir = cfg.model_dir / "variants" / f"{cfg.variant.base}.dequantized"
    run_stage(f"dequantize:{cfg.variant.base}", dense_dir, {"artifact": artifact.hash},
              lambda tmp: write_dense_checkpoint(artifact.path, tmp / "checkpoint") or {"artifact": "checkpoint"},
              force=cfg.force)
    return convert_checkpoint(cfg, dense_dir / "checkpoint", artifact.hash, cfg.model.name,
                              cfg.model_dir / "variants" / f"{cfg.variant.base}.dequantized-f16")


def _choose_generator(cfg: Config, kernel_rt, artifact: Artifact, refs: dict, original: Original, need: int):
    """The dequantized stand-in for free-running when it reproduces the kernel on a sample, else the kernel."""
    from pipeline.infra.errors import Skip
    from pipeline.stages.reference import f16_variant

    try:
        proxy_path = dequantized_proxy(cfg, artifact)
    except Skip as exc:
        return kernel_rt, {"used": False, "reason": f"no GGUF stand-in: {exc}"}
    standin = f16_variant()
    proxy_rt = load_runtime(standin, proxy_path, cfg, n_ctx=n_ctx_for(need, original.facts.get("context_length")))
    check = {**proxy_check(kernel_rt, proxy_rt, next(iter(refs.values())), cfg.reference.top_k),
             "runtime": standin.runtime}
    log.info("%s: dequantized stand-in vs kernel on %s: KLD %.4g vs %.4g (gap %.1f%%), top-1 agreement %.1f%% -> %s",
             cfg.variant.name, check["sample"], check["kld_dequantized"], check["kld_kernel"], 100 * check["kld_gap"],
             100 * check["top1_agreement"], "use it for free-running" if check["ok"] else "use the kernel")
    if check["ok"]:
        return proxy_rt, {"used": True, **check}
    proxy_rt.close()
    return kernel_rt, {"used": False, **check}
