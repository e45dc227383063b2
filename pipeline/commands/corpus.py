"""`quantdrift corpus`: KL divergence on a plain text file with llama.cpp perplexity's conventions.

As `llama-perplexity --kl-divergence`: the whole text is tokenized once, as llama.cpp's tools tokenize a file
(llama.cpp's own tokenizer from the model's F16 GGUF; BOS prepended where the GGUF's metadata says the model adds
it; special-token strings such as "<|im_start|>" kept as plain text, parse_special=false); it is cut into
consecutive chunks of ``ctx`` tokens (at least 2 x ctx tokens are required; a partial last chunk is dropped);
the first token of every chunk is replaced by BOS when the model adds one; and only the second half of each chunk
is scored (the logits at positions ctx/2 .. ctx-2 predicting tokens ctx/2+1 .. ctx-1), so every scored token has
at least ctx/2 tokens of context. KLD is over the full vocabulary, from the baseline's distribution to the
variant's. ``corpus.baseline``: ``original`` (the checkpoint on transformers) or ``f16`` (the F16 GGUF on
llama.cpp, as llama-perplexity's own base). The figures and their uncertainties are llama-perplexity's: mean
KLD ± its standard error, PPL of both and ln(PPL ratio) ± its standard error (from the per-token NLL
differences), KLD percentiles, Δp (mean, RMS, percentiles) and the same-top rate.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.figures import drift as metrics
from pipeline.config.schema import Config, VariantConfig
from pipeline.infra.errors import ConfigError

log = logging.getLogger(__name__)


def chunk_plan(n_tokens: int, ctx: int) -> tuple[int, int]:
    """(number of chunks, first scored position) for llama.cpp's perplexity convention."""
    if ctx < 4 or ctx % 2:
        raise ConfigError(f"corpus.ctx={ctx}: expected an even number of tokens >= 4")
    if n_tokens < 2 * ctx:
        raise ConfigError(f"corpus.file holds {n_tokens} tokens; llama.cpp's convention needs at least 2 x ctx = "
                          f"{2 * ctx} (use a longer text or a smaller ctx)")
    return n_tokens // ctx, ctx // 2


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, as llama.cpp's mean_and_uncertainty (sample variance / (n - 1))."""
    n = x.size
    mean = float(x.mean())
    return mean, (float(math.sqrt(max(float((x * x).mean()) - mean * mean, 0.0) / (n - 1))) if n > 1 else 0.0)


def _logprob_rows(rt, ids: list[int], positions: list[int]):
    """A runtime's log-prob rows as a stream of chunks (``logprob_blocks``); anything that offers only the whole
    matrix (``logprobs``) is read as one chunk."""
    blocks = getattr(rt, "logprob_blocks", None)
    return blocks(ids, positions) if blocks is not None else iter([rt.logprobs(ids, positions)])


def corpus_drift(base_rt, variant_rt, ids: list[int], ctx: int, bos_id: int | None,
                 max_chunks: int | None = None) -> dict:
    n_chunks, first = chunk_plan(len(ids), ctx)
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    kld, nll_o, nll_v, same = [], [], [], []
    for i in tqdm(range(n_chunks), desc="corpus chunks", unit="chunk"):
        chunk = list(ids[i * ctx:(i + 1) * ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        positions = list(range(first, ctx - 1))
        targets = np.asarray(chunk[first + 1:ctx])
        # both models' rows a chunk at a time: at a 256k vocabulary one float64 copy of a 512-token chunk's
        # scored rows is 0.5 GB per model
        cmp = metrics.compare_chunks(metrics.paired(_logprob_rows(base_rt, chunk, positions),
                                                    _logprob_rows(variant_rt, chunk, positions)), targets)
        kld += cmp["kld"].tolist()
        nll_o += (-cmp["target_a"]).tolist()
        nll_v += (-cmp["target_b"]).tolist()
        same += (cmp["argmax_a"] == cmp["argmax_b"]).tolist()
    k, no, nv = (np.asarray(x, dtype=np.float64) for x in (kld, nll_o, nll_v))
    kld_mean, kld_se = _mean_se(k)
    ln_ratio, ln_ratio_se = _mean_se(nv - no)
    dist = metrics.distribution(kld)
    return {
        "ppl_original": math.exp(float(no.mean())),
        "ppl_variant": math.exp(float(nv.mean())),
        "ln_ppl_ratio": ln_ratio, "ln_ppl_ratio_se": ln_ratio_se,
        "ppl_ratio": math.exp(ln_ratio), "ppl_ratio_se": math.exp(ln_ratio) * ln_ratio_se,
        "kld_mean": kld_mean, "kld_se": kld_se, "kld_median": dist["median"], "kld_p99": dist["p99"],
        "kld_max": dist["max"], "kld_percentiles": metrics.percentiles(kld, metrics.KLD_PERCENTILES),
        "delta_p": metrics.delta_p(nll_o, nll_v),
        "same_top1": float(np.mean(same)),
        "chunks": n_chunks, "ctx": ctx, "scored_tokens": len(kld), "bos_first": bos_id is not None,
    }


def document_tokens(cfg: Config, original, text: str) -> dict:
    """The text's ids as llama.cpp's tools make them (the F16 GGUF's tokenizer and metadata); a model without a
    GGUF conversion falls back to its HF tokenizer with special-token strings split as plain text and BOS as its
    tokenizer config says."""
    from pipeline.infra.errors import Skip
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import f16_variant
    from pipeline.runtimes import load_runtime

    try:
        f16 = build_artifact(f16_variant(), original, cfg)
    except Skip as exc:
        log.warning("no GGUF of this model (%s): tokenizing with the HF tokenizer", exc)
        f16 = None
    if f16 is not None:
        rt = load_runtime(f16_variant(), f16.path, cfg, n_ctx=256)
        try:
            ids, bos = rt.tokenize_document(text)
        finally:
            rt.close()
        return {"ids": ids, "bos_id": bos, "tokenizer": "llama.cpp (F16 GGUF; BOS from its metadata)"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint), trust_remote_code=cfg.model.trust_remote_code)
    ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    adds_bos = bool(getattr(tok, "add_bos_token", False)) and tok.bos_token_id is not None
    return {"ids": ([tok.bos_token_id] if adds_bos else []) + ids, "bos_id": tok.bos_token_id if adds_bos else None,
            "tokenizer": "transformers (special-token strings split)"}


def run_corpus(cfg: Config) -> int:
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import f16_variant
    from pipeline.runtimes import load_runtime

    path = Path(cfg.corpus.file).expanduser()
    if not cfg.corpus.file or not path.is_file():
        raise ConfigError(f"corpus.file={cfg.corpus.file!r}: expected an existing UTF-8 text file "
                          "(quantdrift corpus variant=NAME file=PATH ctx=512)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"corpus.file={str(path)!r} is not UTF-8 text ({exc})") from None
    original = prepare(cfg.model, cfg.model_dir, force=False)
    doc = document_tokens(cfg, original, text)
    artifact = build_artifact(cfg.variant, original, cfg)
    n_ctx = max(cfg.corpus.ctx + 8, 256)
    if cfg.corpus.baseline == "f16":
        f16v = f16_variant()
        base_rt = load_runtime(f16v, build_artifact(f16v, original, cfg).path, cfg, n_ctx=n_ctx)
        base_name = f"{f16v.name} on {f16v.runtime}"
    else:
        base_rt = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
        base_name = "original on transformers"
    variant_rt = load_runtime(cfg.variant, artifact.path, cfg, n_ctx=n_ctx)
    try:
        result = corpus_drift(base_rt, variant_rt, doc["ids"], cfg.corpus.ctx, doc["bos_id"], cfg.corpus.max_chunks)
    finally:
        base_rt.close()
        variant_rt.close()
    result = {"variant": cfg.variant.name, "baseline": base_name, "file": str(path), "tokenizer": doc["tokenizer"],
              **result}
    if cfg.corpus.json:
        print(json.dumps(result))
    else:
        dp = result["delta_p"] or {}
        print(f"corpus {path.name}: {result['chunks']} chunks x {cfg.corpus.ctx} tokens, {result['scored_tokens']} "
              f"scored; tokenizer {result['tokenizer']}; baseline {base_name}")
        print(f"  PPL baseline {result['ppl_original']:.4f}   PPL {cfg.variant.name} {result['ppl_variant']:.4f}")
        print(f"  Mean ln(PPL(Q)/PPL(base)) {result['ln_ppl_ratio']:.6f} ± {result['ln_ppl_ratio_se']:.6f}   "
              f"PPL(Q)/PPL(base) {result['ppl_ratio']:.6f} ± {result['ppl_ratio_se']:.6f}")
        print(f"  Mean KLD {result['kld_mean']:.6f} ± {result['kld_se']:.6f}  median {result['kld_median']:.6f}  "
              f"p99 {result['kld_p99']:.6f}  max {result['kld_max']:.6f}")
        print(f"  Mean Δp {100 * dp.get('mean', 0):.3f} %  RMS Δp {100 * dp.get('rms', 0):.3f} %   "
              f"same top-1 {result['same_top1']:.3%}")
    return 0
