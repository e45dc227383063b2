"""The parity checks before the reference (stage 3): whether the F16 GGUF converted from the original may stand in
as generator (its KLD against the original on the same ids), and how the GGUF vocabulary's tokenizer and the
folder's own tokenizer.json split the suites' texts compared with the tokenizer transformers loads (reported, never
blocking).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.config.schema import Config, VariantConfig
from pipeline.infra.files import stable_hash
from pipeline.infra.model_source import Original
from pipeline.infra.stage_cache import run_stage
from pipeline.runtimes import load_runtime
from pipeline.stages.reference import f16_variant
from pipeline.suites.conversation import ChatRenderer, base_messages
from pipeline.suites.records import Conversation


def parity_texts(convs: list[Conversation], renderer: ChatRenderer) -> list[str]:
    texts = []
    for c in convs:
        if c.system:
            texts.append(c.system)
        texts += [t.user for t in c.turns]
        texts.append(renderer.render(base_messages(c) + [{"role": "user", "content": c.turns[0].user}]))
    return texts


def _common_ends(a: list[int], b: list[int]) -> tuple[int, int]:
    """Lengths of the common prefix and of the common suffix (not overlapping the prefix) of two differing lists."""
    from pipeline.figures.drift import first_divergence

    first = first_divergence(a, b)
    last = 0
    while last < min(len(a), len(b)) - first and a[-1 - last] == b[-1 - last]:
        last += 1
    return first, last


def tokenizer_divergence(texts_by_suite: dict[str, list[str]], renderer: ChatRenderer, tokenize,
                         examples: int = 5) -> dict:
    """How the GGUF vocabulary's own tokenizer (what llama.cpp and every server built on it apply to text) differs
    from the HF tokenizer on the suites' texts: texts and HF tokens that tokenize differently (the tokens between
    the common prefix and suffix), per suite, with the first examples."""
    out = {"texts": 0, "diverging_texts": 0, "hf_tokens": 0, "diverging_tokens": 0, "by_suite": {}, "examples": []}
    for suite, texts in texts_by_suite.items():
        row = {"texts": len(texts), "diverging_texts": 0, "hf_tokens": 0, "diverging_tokens": 0}
        for text in texts:
            a, b = renderer.encode(text), tokenize(text)
            row["hf_tokens"] += len(a)
            if a == b:
                continue
            first, last = _common_ends(a, b)
            row["diverging_texts"] += 1
            row["diverging_tokens"] += len(a) - first - last
            if len(out["examples"]) < examples:
                out["examples"].append({"suite": suite, "text": text[:120], "first_diff_token": first,
                                        "context": renderer.text_around(text, first),
                                        "hf": a[first:first + 5], "gguf": b[first:first + 5]})
        out["by_suite"][suite] = row
        for k in ("texts", "diverging_texts", "hf_tokens", "diverging_tokens"):
            out[k] += row[k]
    return out


def folder_tokenizer_divergence(checkpoint: Path, renderer: ChatRenderer, texts: dict[str, list[str]]) -> dict:
    """Whether the tokenizer transformers loads for the original (``AutoTokenizer``: its class follows the
    config's model_type and can differ from the folder's) splits the suites' texts as the folder's own
    ``tokenizer.json`` does, which is what a server reading that file applies. Reported, never blocking: every
    runtime here is fed the loaded tokenizer's ids."""
    path = Path(checkpoint) / "tokenizer.json"
    loaded = type(renderer.tok).__name__
    if not path.is_file():
        return {"skipped": "the folder has no tokenizer.json", "loaded": loaded}
    from tokenizers import Tokenizer

    own = Tokenizer.from_file(str(path))
    out = tokenizer_divergence(texts, renderer, lambda text: own.encode(text, add_special_tokens=False).ids)
    return {"loaded": loaded, **out}


def check_parity(cfg: Config, original: Original, f16_path: Path, f16_hash: str, renderer: ChatRenderer,
                 texts: dict[str, list[str]]) -> dict:
    """The F16 GGUF's KLD against the original on the same ids (a broken conversion stops the GGUF variants), and
    the GGUF tokenizer's divergence from the HF tokenizer on every suite text (reported, never blocking: every
    runtime is fed the HF ids, so drift stays on one token stream; the deployment path measures what the
    divergence costs a user whose server tokenizes text). Cached per inputs."""
    out_dir = cfg.model_dir / "parity"
    key = {"original": original.hash, "f16": f16_hash, "texts": stable_hash(texts), "version": PARITY_VERSION,
           "tokens": cfg.reference.parity_tokens, "flash_attn": cfg.runtime.flash_attn}

    def build(tmp: Path) -> dict:
        from pipeline.figures.drift import compare_chunks, logprob_chunks, paired, write_rows
        from pipeline.infra.gguf_file import gguf_metadata

        stream = []
        for text in (t for suite_texts in texts.values() for t in suite_texts):
            stream += renderer.encode(text)
            if len(stream) >= cfg.reference.parity_tokens:
                break
        stream = stream[: cfg.reference.parity_tokens]
        positions = list(range(len(stream) - 1))
        # One runtime loaded at a time (the two together would need both models' memory): the F16 file's logits
        # go to disk as the float32 rows llama.cpp gave, then stream beside the original's.
        spill = tmp / "f16-logits.npy"
        from pipeline.runtimes.llamacpp import vocab_loads_in_child

        vocab_loads_in_child(f16_path)      # an abort in llama.cpp's vocabulary loader stops the GGUF variants only
        gguf = load_runtime(f16_variant(), f16_path, cfg, n_ctx=max(cfg.reference.parity_tokens + 8, 512))
        try:
            tokenizer = tokenizer_divergence(texts, renderer, gguf.tokenize)
            write_rows(spill, gguf.logit_blocks(stream, positions), len(positions))
        finally:
            gguf.close()
        tokenizer["gguf_pre_tokenizer"] = gguf_metadata(f16_path, "tokenizer.ggml.pre")
        tokenizer["hf_pre_tokenizer"] = renderer.pre_tokenizer()
        hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
        try:
            f16_rows = np.load(spill, mmap_mode="r")
            cmp = compare_chunks(paired(hf.logprob_blocks(stream, positions), logprob_chunks([f16_rows])))
            del f16_rows
        finally:
            hf.close()
        spill.unlink()
        kld = cmp["kld"]
        result = {
            "tokenizer": tokenizer,
            "f16_kld_mean": float(kld.mean()),
            "f16_kld_max": float(kld.max()),
            "f16_top1_agreement": float((cmp["argmax_a"] == cmp["argmax_b"]).mean()),
            "tokens": len(stream),
            "max_kld": cfg.reference.parity_max_kld,
        }
        result["ok"] = result["f16_kld_mean"] < cfg.reference.parity_max_kld
        return {"parity": result}

    manifest = run_stage("parity", out_dir, key, build, force=cfg.force)
    return manifest["parity"]


# 2: the tokenizer comparison is a reported property (per suite, diverging tokens, pre-tokenizers), not a gate.
PARITY_VERSION = 2


def parity_error(parity: dict) -> str | None:
    """Why GGUF figures cannot be trusted on this model, or None. Only a broken conversion stops them: a tokenizer
    divergence is reported (the measurement feeds every runtime the same ids)."""
    if parity["f16_kld_mean"] >= parity["max_kld"]:
        return (f"the F16 GGUF's mean KLD against the original is {parity['f16_kld_mean']:.2e} "
                f"(limit {parity['max_kld']:.0e}): the conversion is broken, GGUF figures would be meaningless")
    return None


def diverging_suites(parity: dict | None) -> list[str]:
    """Suites with at least one text that the GGUF tokenizer splits differently from the HF tokenizer."""
    by_suite = ((parity or {}).get("tokenizer") or {}).get("by_suite") or {}
    return [s for s, row in by_suite.items() if row["diverging_texts"]]
