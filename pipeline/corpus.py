"""`quantdrift corpus`: KL divergence on a plain text file with llama.cpp perplexity's conventions.

As `llama-perplexity --kl-divergence`: the text is tokenized once; it is cut into consecutive chunks of ``ctx``
tokens (at least 2 x ctx tokens are required; a partial last chunk is dropped); the first token of a chunk is
replaced by BOS when the model's tokenizer adds a BOS token; and only the second half of each chunk is scored
(the logits at positions ctx/2 .. ctx-2 predicting tokens ctx/2+1 .. ctx-1), so every scored token has at
least ctx/2 tokens of context. KLD is over the full vocabulary, from the original's distribution to the
variant's. PPL = exp(mean NLL) over the same scored tokens.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline import metrics
from pipeline.config import Config, ConfigError, VariantConfig

log = logging.getLogger(__name__)


def chunk_plan(n_tokens: int, ctx: int) -> tuple[int, int]:
    """(number of chunks, first scored position) for llama.cpp's perplexity convention."""
    if ctx < 4 or ctx % 2:
        raise ConfigError(f"corpus.ctx={ctx}: expected an even number of tokens >= 4")
    if n_tokens < 2 * ctx:
        raise ConfigError(f"corpus.file holds {n_tokens} tokens; llama.cpp's convention needs at least 2 x ctx = "
                          f"{2 * ctx} (use a longer text or a smaller ctx)")
    return n_tokens // ctx, ctx // 2


def corpus_drift(original_rt, variant_rt, ids: list[int], ctx: int, bos_id: int | None,
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
        targets = np.asarray(chunk[first + 1:ctx])[:, None]
        lo = original_rt.logprobs(chunk, positions)
        lv = variant_rt.logprobs(chunk, positions)
        kld += metrics.kld_full(lo, lv).tolist()
        nll_o += (-np.take_along_axis(lo, targets, axis=-1)[:, 0]).tolist()
        nll_v += (-np.take_along_axis(lv, targets, axis=-1)[:, 0]).tolist()
        same += (lo.argmax(-1) == lv.argmax(-1)).tolist()
    dist = metrics.distribution(kld)
    return {
        "ppl_original": math.exp(float(np.mean(nll_o))),
        "ppl_variant": math.exp(float(np.mean(nll_v))),
        "kld_mean": dist["mean"], "kld_median": dist["median"], "kld_p99": dist["p99"],
        "same_top1": float(np.mean(same)),
        "chunks": n_chunks, "ctx": ctx, "scored_tokens": len(kld), "bos_first": bos_id is not None,
    }


def run_corpus(cfg: Config) -> int:
    from pipeline.prepare import prepare
    from pipeline.quantizers import build_artifact
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint), trust_remote_code=cfg.model.trust_remote_code)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    adds_bos = bool(getattr(tok, "add_bos_token", False)) and tok.bos_token_id is not None
    artifact = build_artifact(cfg.variant, original, cfg)
    n_ctx = max(cfg.corpus.ctx + 8, 256)
    original_rt = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
    variant_rt = load_runtime(cfg.variant, artifact.path, cfg, n_ctx=n_ctx)
    result = corpus_drift(original_rt, variant_rt, ids, cfg.corpus.ctx, tok.bos_token_id if adds_bos else None,
                          cfg.corpus.max_chunks)
    result = {"variant": cfg.variant.name, "file": str(path), **result}
    if cfg.corpus.json:
        print(json.dumps(result))
    else:
        print(f"corpus {path.name}: {result['chunks']} chunks x {cfg.corpus.ctx} tokens, {result['scored_tokens']} scored")
        print(f"  PPL original {result['ppl_original']:.4f}   PPL {cfg.variant.name} {result['ppl_variant']:.4f}")
        print(f"  KLD mean {result['kld_mean']:.6f}  median {result['kld_median']:.6f}  p99 {result['kld_p99']:.6f}")
        print(f"  same top-1 {result['same_top1']:.3%}")
    return 0
