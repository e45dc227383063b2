"""Stage 5, score one variant teacher-forced on the reference's exact token ids: token-level drift (KLD, top-1,
delta NLL) against the original, and the stored KLD against the exact full-vocabulary KLD on a sample."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.figures import drift as metrics
from pipeline.config.summary_contract import SCHEMA_VERSION
from pipeline.config.schema import Config
from pipeline.suites.conversation import ChatRenderer
from pipeline.infra.model_source import Original
from pipeline.suites.records import Conversation
from pipeline.quantizers.base import Artifact
from pipeline.stages.reference import SuiteReference, context_needed, n_ctx_for
from pipeline.runtimes import load_runtime, runtime_class
from pipeline.infra.stage_cache import Journal, run_stage
from pipeline.infra.files import write_json
from pipeline.runtimes import runtime_code, runtime_key
from pipeline.infra.code_version import code_version

log = logging.getLogger(__name__)


def teacher_forced(runtime, ref: SuiteReference, top_k: int) -> dict[str, dict]:
    """Per conversation: per-token KLD, top-1 agreement, NLL of the reference token under both models. The KLD is
    the top-K + tail-bucket figure, exact (full vocabulary, from the same pass) at the reference's exact rows."""
    out = {}
    for tr in tqdm(ref.transcripts, desc=f"teacher-forced {ref.suite}", unit="conv", leave=False):
        s = ref.scores.get(tr["id"])
        if s is None:
            continue
        rows, ref_rows = ref.rows.get(tr["id"], (np.empty(0, dtype=np.int64), None))
        cand = np.concatenate([s["topk_ids"].astype(np.int64), np.asarray(tr["ids"])[s["pos"] + 1][:, None]], axis=1)
        scores = runtime.score(tr["ids"], s["pos"].tolist(), cand, full_rows=rows, full_ref=ref_rows)
        lp, argmax = scores.logprobs, scores.argmax
        kld = metrics.kld_topk_tail(s["topk_lp"], s["tail"], lp[:, :top_k])
        if len(rows):
            kld[rows] = scores.kld_full
        out[tr["id"]] = {
            "kld": kld.astype(np.float32).tolist(),
            "exact_rows": rows.tolist(),
            "top1": (argmax == s["topk_ids"][:, 0]).astype(int).tolist(),
            "nll_variant": (-lp[:, top_k]).astype(np.float32).tolist(),
            "nll_reference": (-s["actual_lp"].astype(np.float64)).astype(np.float32).tolist(),
            "tail_mass": np.exp(s["tail"].astype(np.float64)).astype(np.float32).tolist(),
            "out_pos": s["out_pos"].tolist(),
            "turn": s["turn"].tolist(),
        }
    return out


def longest_scored(ref: SuiteReference) -> dict:
    """The suite's transcript with the most scored reply tokens (the sample of the proxy and exactness checks)."""
    return max((t for t in ref.transcripts if t["id"] in ref.scores), key=lambda t: len(ref.scores[t["id"]]["pos"]))


EXACT_SAMPLE_TOKENS = 256


def exact_sample(ref: SuiteReference, n: int = EXACT_SAMPLE_TOKENS) -> tuple[dict, np.ndarray]:
    """The longest scored transcript of the suite and n reply positions spread evenly over it (late positions,
    where drift grows, are sampled as much as early ones)."""
    tr = longest_scored(ref)
    total = len(ref.scores[tr["id"]]["pos"])
    idx = np.unique(np.linspace(0, total - 1, min(n, total)).round().astype(np.int64))
    return tr, idx


def exact_sample_logprobs(cfg: Config, original: Original, ref: SuiteReference,
                          n: int = EXACT_SAMPLE_TOKENS) -> np.ndarray:
    """The original's whole log-softmax (transformers, float64) at ``exact_sample(ref, n)``'s positions: the same
    for every variant, so a stage of its own beside the reference, computed once per run and suite instead of in
    every variant's scoring (a transformers load and a pass over the suite's longest transcript: about 10 s a suite
    here)."""
    from pipeline.config.schema import VariantConfig

    out_dir = cfg.model_dir / "reference" / cfg.run.name / f"{ref.suite}-exact_sample"
    key = {"logprobs": ref.scores_hash, "original": original.hash, "tokens": n, "dtype": "float64",
           "code": {**runtime_code(VariantConfig(name="original").runtime),
                    **code_version(exact_sample, longest_scored)}}

    def build(tmp: Path) -> dict:
        tr, idx = exact_sample(ref, n)
        hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
        try:      # written a chunk of rows at a time, read back memory-mapped
            rows = hf.logprob_blocks(tr["ids"], ref.scores[tr["id"]]["pos"][idx].tolist())
            metrics.write_rows(tmp / "logprobs.npy", rows, len(idx), np.float64)
        finally:
            hf.close()
        return {"sample": f"{ref.suite}/{tr['id']}", "tokens": int(len(idx))}

    run_stage(f"reference:{ref.suite}:exact_sample", out_dir, key, build, force=cfg.force)
    return np.load(out_dir / "logprobs.npy", mmap_mode="r")


def kld_exactness(variant_rt, lp_ref: np.ndarray, ref: SuiteReference, n: int = EXACT_SAMPLE_TOKENS) -> dict:
    """The stored KLD as ``teacher_forced`` computes it (the original's top-K + one tail bucket, exact at the
    reference's exact rows) against the exact full-vocabulary KLD on a sample of reference positions: both from
    the same full distributions of the original (transformers) and of the variant (its own runtime), so the ratio
    is the stored figure's own error. ``ratio_topk_only``: the same without the exact rows. ``lp_ref``: the
    original's log-probs at the sample (``exact_sample_logprobs``)."""
    tr, idx = exact_sample(ref, n)
    s = ref.scores[tr["id"]]
    pos = s["pos"][idx]
    if lp_ref.shape[0] != len(idx):
        raise ValueError(f"kld_exactness: {lp_ref.shape[0]} rows of the original's log-probs for a sample of "
                         f"{len(idx)} positions ({ref.suite}/{tr['id']})")
    ids = s["topk_ids"][idx].astype(np.int64)
    rows, ref_rows = ref.rows.get(tr["id"], (np.empty(0, dtype=np.int64), None))
    at = {int(r): j for j, r in enumerate(rows)}
    hit = [(i, at[int(r)]) for i, r in enumerate(idx) if int(r) in at]
    mine, theirs = (np.array(x, dtype=np.int64) for x in zip(*hit)) if hit else (np.empty(0, dtype=np.int64),) * 2
    # streamed: both full distributions a chunk of rows at a time (the original's stored rows memory-mapped)
    exact = np.empty(len(idx))
    var_at_ids = np.empty(ids.shape)
    at_rows = np.empty(len(mine))
    start = 0
    for lr, lv in metrics.paired(metrics.stored_chunks(lp_ref), variant_rt.logprob_blocks(tr["ids"], pos.tolist())):
        stop = start + len(lv)
        exact[start:stop] = metrics.kld_full(lr, lv)
        var_at_ids[start:stop] = np.take_along_axis(lv, ids[start:stop], axis=1)
        here = np.flatnonzero((mine >= start) & (mine < stop))
        if len(here):
            at_rows[here] = metrics.kld_full(ref_rows[theirs[here]], lv[mine[here] - start])
        start = stop
    bucket = metrics.kld_topk_tail(s["topk_lp"][idx], s["tail"][idx], var_at_ids)
    stored = bucket.copy()
    if hit:
        stored[mine] = at_rows
    e, st, b = float(exact.mean()), float(stored.mean()), float(bucket.mean())
    return {"sample": f"{ref.suite}/{tr['id']}", "tokens": int(len(idx)), "top_k": int(ids.shape[1]),
            "exact_rows": len(hit), "kld_exact_mean": e, "kld_stored_mean": st, "ratio": (st / e) if e > 0 else None,
            "kld_topk_only_mean": b, "ratio_topk_only": (b / e) if e > 0 else None,
            "tail_mass_mean": float(np.exp(s["tail"][idx].astype(np.float64)).mean())}


def scores_exactness(variant, original_weights: bool) -> bool:
    """Whether ``variant``'s scoring compares the stored KLD with the exact one (and so needs the original's exact
    rows): its runtime hands over full logits, and it is not the original's own weights (``original_weights``) on
    the original's runtime without a KV-cache setting, which against itself measures nothing."""
    from pipeline.config.schema import VariantConfig

    cls = runtime_class(variant.runtime)
    return cls.full_logits and not (original_weights and variant.runtime == VariantConfig(name="original").runtime
                                    and not cls.kv_cache_applied(variant.runtime_options))


def score_variant(cfg: Config, original: Original, renderer: ChatRenderer, artifact: Artifact,
                  suites: dict[str, list[Conversation]], refs: dict[str, SuiteReference]) -> dict:
    """(a): cfg.variant teacher-forced on every reference transcript (KLD, top-1, NLL per token), and the stored
    KLD against the exact one on a sample. Its own stage: it depends on how the reference is scored (top-K, exact
    rows), the free-running replies do not. Returns the stage's manifest plus its directory."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / f"{variant.name}.scores"
    key = {
        "schema_version": SCHEMA_VERSION,
        **runtime_key(cfg, artifact),
        "reference_logprobs": {s: r.scores_hash for s, r in refs.items()},
        "exact_rows": {s: r.rows_hash for s, r in refs.items()},
        # how the KLD and the other token-level figures are computed from the two distributions
        "kld_code": code_version("pipeline.figures.drift", teacher_forced, kld_exactness, exact_sample, longest_scored),
    }
    exact_ok = scores_exactness(variant, artifact.hash == original.hash)

    def build(tmp: Path) -> dict:
        tf_journal = Journal(out_dir, "teacher_forced", key)
        ex_journal = Journal(out_dir, "kld_exactness", key)
        need_tf = [s for s in refs if s not in tf_journal]
        need_ex = [s for s in refs if s not in ex_journal and refs[s].scores] if exact_ok else []
        info = None
        if need_tf or need_ex:
            # the original's exact rows first (their own stage, memory-mapped after): built while this variant's
            # runtime is loaded, the two models would be resident at once
            lp_refs = {s: exact_sample_logprobs(cfg, original, refs[s]) for s in need_ex}
            need = max(context_needed(suites[s], renderer, refs[s].transcripts) for s in refs)
            rt = load_runtime(variant, artifact.path, cfg, n_ctx=n_ctx_for(need, original.facts.get("context_length")))
            try:
                info = rt.info
                for s in need_tf:
                    tf_journal.add(s, teacher_forced(rt, refs[s], cfg.reference.top_k))
                for s in need_ex:
                    ex_journal.add(s, kld_exactness(rt, lp_refs[s], refs[s]))
            finally:
                rt.close()
        tf_all = {s: tf_journal.get(s) for s in refs}
        meta = {s: {c.id: c.meta for c in suites[s] if c.meta} for s in refs}
        for s, convs in tf_all.items():        # depth/length of recall documents, for drift by depth
            for cid, c in convs.items():
                if cid in meta[s]:
                    c["meta"] = meta[s][cid]
        write_json(tmp / "teacher_forced.json", tf_all)
        exactness = {s: ex_journal.get(s) for s in refs if s in ex_journal}
        rows = sum(len(c.get("exact_rows", ())) for convs in tf_all.values() for c in convs.values())
        positions = sum(len(c["kld"]) for convs in tf_all.values() for c in convs.values())
        return {"runtime_info": info, "kld_exactness": exactness or None,
                "exact_rows": {"rows": rows, "positions": positions,
                               "exact_tail_mass": cfg.reference.exact_tail_mass}}

    manifest = run_stage(f"score:{variant.name}", out_dir, key, build, force=cfg.force)
    return {**manifest, "dir": str(out_dir)}
