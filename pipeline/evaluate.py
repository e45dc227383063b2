"""Stage 4, evaluate one variant against the reference:
(a) teacher-forced on the reference's exact token ids -> token-level drift (KLD, top-1, delta NLL),
(b) free-running on the same conversations -> checks, flips, chrF, divergence, degeneration,
speed and memory are measured after the sweep, every variant in interleaved trials (``pipeline.speed``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline import metrics
from pipeline.catalogue import SCHEMA_VERSION
from pipeline.config import Config
from pipeline.conversation import ChatRenderer, free_run, run_conversation
from pipeline.prepare import Original
from pipeline.prompts import Conversation
from pipeline.quantizers.base import Artifact
from pipeline.reference import SuiteReference, context_needed, n_ctx_for
from pipeline.runtimes import load_runtime, runtime_class
from pipeline.runtimes.base import decoding_key
from pipeline.store import Journal, read_json, run_stage, write_json, write_jsonl

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
        scores = runtime.score(tr["ids"], s["pos"].tolist(), cand, full_rows=rows)
        lp, argmax = scores.logprobs, scores.argmax
        kld = metrics.kld_topk_tail(s["topk_lp"], s["tail"], lp[:, :top_k])
        if len(rows):
            kld[rows] = metrics.kld_full(ref_rows, scores.full)
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


def compare_free_running(ref_tr: dict, var_tr: dict) -> list[dict]:
    """Per turn: check outcomes of both, chrF, first divergent token, repetition, length ratio."""
    rows = []
    for i, (rt, vt) in enumerate(zip(ref_tr["turns"], var_tr["turns"])):
        ref_ids = ref_tr["ids"][rt["start"]:rt["end"]]
        var_ids = var_tr["ids"][vt["start"]:vt["end"]]
        rows.append({
            "turn": i,
            "checks_reference": rt["checks"],
            "checks_variant": vt["checks"],
            "check_labels": vt["check_labels"],
            "chrf": metrics.chrf(vt["text"], rt["text"]) if rt["text"] or vt["text"] else 100.0,
            "first_divergence": metrics.first_divergence(ref_ids, var_ids),
            "repeated_4gram_rate": metrics.repeated_ngram_rate(var_ids, 4),
            "longest_loop_tokens": metrics.longest_loop(var_ids),
            "length_ratio": (len(var_ids) / len(ref_ids)) if ref_ids else None,
            "reply_tokens": len(var_ids),
            "reference_text": rt["text"],
            "variant_text": vt["text"],
        })
    return rows


# Artifact formats whose weights ``pipeline.quantizers.dequant`` writes out exactly as a dense checkpoint (the
# stand-in for free-running): GPTQModel's GPTQ and AWQ, llm-compressor's compressed-tensors.
DEQUANTIZABLE = ("gptq", "awq", "compressed-tensors")
PROXY_MAX_KLD_GAP = 0.05       # relative gap of mean KLD, kernel vs dequantized stand-in
PROXY_MIN_TOP1_AGREEMENT = 0.90
PROXY_SAMPLE_TOKENS = 512


def longest_scored(ref: SuiteReference) -> dict:
    """The suite's transcript with the most scored reply tokens (the sample of the proxy and exactness checks)."""
    return max((t for t in ref.transcripts if t["id"] in ref.scores), key=lambda t: len(ref.scores[t["id"]]["pos"]))


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
    from pipeline.config import VariantConfig

    out_dir = cfg.model_dir / "reference" / cfg.run.name / f"{ref.suite}-exact_sample"
    key = {"reference": ref.hash, "original": original.hash, "tokens": n, "dtype": "float64"}

    def build(tmp: Path) -> dict:
        tr, idx = exact_sample(ref, n)
        hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
        try:
            lp = hf.logprobs(tr["ids"], ref.scores[tr["id"]]["pos"][idx].tolist())
        finally:
            hf.close()
        np.save(tmp / "logprobs.npy", np.asarray(lp, dtype=np.float64))
        return {"sample": f"{ref.suite}/{tr['id']}", "tokens": int(len(idx))}

    run_stage(f"reference:{ref.suite}:exact_sample", out_dir, key, build, force=cfg.force)
    return np.load(out_dir / "logprobs.npy")


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
    lp_var = variant_rt.logprobs(tr["ids"], pos.tolist())
    exact = metrics.kld_full(lp_ref, lp_var)
    ids = s["topk_ids"][idx].astype(np.int64)
    bucket = metrics.kld_topk_tail(s["topk_lp"][idx], s["tail"][idx], np.take_along_axis(lp_var, ids, axis=1))
    stored = bucket.copy()
    rows, ref_rows = ref.rows.get(tr["id"], (np.empty(0, dtype=np.int64), None))
    at = {int(r): j for j, r in enumerate(rows)}
    hit = [(i, at[int(r)]) for i, r in enumerate(idx) if int(r) in at]
    if hit:
        mine, theirs = (np.array(x) for x in zip(*hit))
        stored[mine] = metrics.kld_full(ref_rows[theirs], lp_var[mine])
    e, st, b = float(exact.mean()), float(stored.mean()), float(bucket.mean())
    return {"sample": f"{ref.suite}/{tr['id']}", "tokens": int(len(idx)), "top_k": int(ids.shape[1]),
            "exact_rows": len(hit), "kld_exact_mean": e, "kld_stored_mean": st, "ratio": (st / e) if e > 0 else None,
            "kld_topk_only_mean": b, "ratio_topk_only": (b / e) if e > 0 else None,
            "tail_mass_mean": float(np.exp(s["tail"][idx].astype(np.float64)).mean())}


def dequantized_proxy(cfg: Config, artifact: Artifact) -> Path:
    """An F16 GGUF of the quantized model's exact dequantized weights (cached beside the artifact)."""
    from pipeline.quantizers.dequant import write_dense_checkpoint
    from pipeline.quantizers.gguf import convert_checkpoint
    from pipeline.store import run_stage

    dense_dir = cfg.model_dir / "variants" / f"{cfg.variant.base}.dequantized"
    run_stage(f"dequantize:{cfg.variant.base}", dense_dir, {"artifact": artifact.hash},
              lambda tmp: write_dense_checkpoint(artifact.path, tmp / "checkpoint") or {"artifact": "checkpoint"},
              force=cfg.force)
    return convert_checkpoint(cfg, dense_dir / "checkpoint", artifact.hash, cfg.model.name,
                              cfg.model_dir / "variants" / f"{cfg.variant.base}.dequantized-f16")


def _choose_generator(cfg: Config, kernel_rt, artifact: Artifact, refs: dict, original: Original, need: int):
    """The dequantized stand-in for free-running when it reproduces the kernel on a sample, else the kernel."""
    from pipeline.errors import Skip
    from pipeline.reference import f16_variant

    try:
        proxy_path = dequantized_proxy(cfg, artifact)
    except Skip as exc:
        return kernel_rt, {"used": False, "reason": f"no GGUF stand-in: {exc}"}
    proxy_rt = load_runtime(f16_variant(), proxy_path, cfg, n_ctx=n_ctx_for(need, original.facts.get("context_length")))
    check = proxy_check(kernel_rt, proxy_rt, next(iter(refs.values())), cfg.reference.top_k)
    log.info("%s: dequantized stand-in vs kernel on %s: KLD %.4g vs %.4g (gap %.1f%%), top-1 agreement %.1f%% -> %s",
             cfg.variant.name, check["sample"], check["kld_dequantized"], check["kld_kernel"], 100 * check["kld_gap"],
             100 * check["top1_agreement"], "use it for free-running" if check["ok"] else "use the kernel")
    if check["ok"]:
        return proxy_rt, {"used": True, **check}
    proxy_rt.close()
    return kernel_rt, {"used": False, **check}


def _runtime_key(cfg: Config, artifact: Artifact) -> dict:
    """What any stage that runs cfg.variant on its artifact depends on (the evaluation, the deployment path)."""
    variant = cfg.variant
    return {"variant": variant.name, "artifact": artifact.hash, "runtime": variant.runtime,
            "runtime_options": variant.runtime_options, "threads": cfg.runtime.n_threads, "device": cfg.runtime.device,
            "runtime_settings": runtime_class(variant.runtime).key_settings(cfg.runtime), **decoding_key(cfg.runtime)}


def reuses_reference(cfg: Config, artifact: Artifact, producer: dict) -> bool:
    """The reference transcripts are the free-running output of the producer: a variant that runs exactly as the
    producer did (same weights, runtime and runtime options) would repeat them, so it reuses them. "original" is
    the reference by definition (the producer is the original itself or its F16 GGUF, held to it by the parity
    check). Anything else, a KV-cache variant on the producer's weights included, generates its own replies."""
    variant, made_by = cfg.variant, producer["variant"]
    if variant.name == "original" and not runtime_class(variant.runtime).kv_cache_applied(variant.runtime_options):
        return True
    return (artifact.hash == producer["hash"] and variant.runtime == made_by.runtime
            and _generation_options(variant.runtime_options) == _generation_options(made_by.runtime_options))


def _generation_options(options: dict) -> dict:
    """The runtime options that can change generated tokens (not where free-running is produced)."""
    return {k: v for k, v in (options or {}).items() if k != "free_running"}


def evaluate_variant(cfg: Config, original: Original, renderer: ChatRenderer, artifact: Artifact,
                     suites: dict[str, list[Conversation]], refs: dict[str, SuiteReference], producer: dict) -> dict:
    """Runs (b), free-running, then (a), teacher-forced scoring (``score_variant``) for cfg.variant, each a stage
    of its own and resumable per conversation. Returns the variant's raw result."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / variant.name
    # what the replies depend on: the reference transcripts (and the top-K stored with them), never how the KLD
    # is scored, so a scoring change rescores without regenerating a reply
    key = {
        "schema_version": SCHEMA_VERSION,    # an evaluation from another contract is recomputed, never misread
        **_runtime_key(cfg, artifact),
        "references": {s: r.hash for s, r in refs.items()},
        **({"batch": cfg.profile.batch} if cfg.profile.batch > 1 else {}),
    }
    stop_ids = original.facts["eos_token_ids"]
    reuse_reference = reuses_reference(cfg, artifact, producer)

    def build(tmp: Path) -> dict:
        fr_journal = Journal(out_dir, "free_running", key)
        need_fr = [] if reuse_reference else [s for s in refs if s not in fr_journal]
        info = None
        if need_fr:
            need = max(context_needed(suites[s], renderer, refs[s].transcripts) for s in refs)
            rt = load_runtime(variant, artifact.path, cfg,
                              n_ctx=n_ctx_for(need, original.facts.get("context_length")))
            info = rt.info
            gen_rt, fr_note = rt, None
            # The stand-in runs on llama.cpp, whose cache is not the hf int8 cache: a KV variant uses the kernel.
            if variant.runtime_options.get("free_running") == "dequantized" \
                    and artifact.info.get("format") in DEQUANTIZABLE and "kv_cache" not in variant.runtime_options:
                gen_rt, fr_note = _choose_generator(cfg, rt, artifact, refs, original, need)
            try:
                for s in need_fr:
                    convs = {c.id: c for c in suites[s]}
                    conv_journal = Journal(out_dir, f"free_running_{s}", key)
                    todo = [convs[tr["id"]] for tr in refs[s].transcripts if tr["id"] not in conv_journal]
                    free_run(gen_rt, renderer, todo, stop_ids, original.facts.get("context_length"),
                             cfg.profile.batch, lambda tr: conv_journal.add(tr["id"], tr),
                             f"free-running {s} ({variant.name})")
                    fr_journal.add(s, {tr["id"]: conv_journal.get(tr["id"]) for tr in refs[s].transcripts})
            finally:
                if gen_rt is not rt:
                    gen_rt.close()
                rt.close()
            if fr_note is not None:
                fr_journal.add("_path", fr_note)
        free = {s: ({tr["id"]: tr for tr in refs[s].transcripts} if reuse_reference else fr_journal.get(s))
                for s in refs}
        samples = []
        meta = {s: {c.id: c.meta for c in suites[s] if c.meta} for s in refs}
        for s in refs:
            for tr in refs[s].transcripts:
                var_tr = free[s][tr["id"]]
                for row in compare_free_running(tr, var_tr):
                    extra = {"meta": meta[s][tr["id"]]} if tr["id"] in meta[s] else {}
                    samples.append({"variant": variant.name, "suite": s, "conversation": tr["id"], **row, **extra})
        write_jsonl(tmp / "samples.jsonl", samples)
        path_note = fr_journal.get("_path") if "_path" in fr_journal else None
        if reuse_reference:
            source = f"reference transcripts ({producer['name']})"
        elif path_note and path_note["used"]:
            source = "dequantized weights as F16 GGUF on llama.cpp (checked against the kernel)"
        else:
            source = f"{variant.name} on {variant.runtime} (real kernel)"
        return {"runtime_info": info, "free_running_source": source, "dequantized_check": path_note}

    manifest = run_stage(f"evaluate:{variant.name}", out_dir, key, build, force=cfg.force)
    scores = score_variant(cfg, original, renderer, artifact, suites, refs)
    return {
        "manifest": manifest,
        "scores_manifest": scores,
        "teacher_forced": read_json(Path(scores["dir"]) / "teacher_forced.json"),
        "samples_path": str(out_dir / "samples.jsonl"),
    }


def score_variant(cfg: Config, original: Original, renderer: ChatRenderer, artifact: Artifact,
                  suites: dict[str, list[Conversation]], refs: dict[str, SuiteReference]) -> dict:
    """(a): cfg.variant teacher-forced on every reference transcript (KLD, top-1, NLL per token), and the stored
    KLD against the exact one on a sample. Its own stage: it depends on how the reference is scored (top-K, exact
    rows), the free-running replies do not. Returns the stage's manifest plus its directory."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / f"{variant.name}.scores"
    key = {
        "schema_version": SCHEMA_VERSION,
        **_runtime_key(cfg, artifact),
        "references": {s: r.hash for s, r in refs.items()},
        "exact_rows": {s: r.rows_hash for s, r in refs.items()},
    }
    from pipeline.config import VariantConfig

    plain_original = VariantConfig(name="original")
    # the stored KLD against the exact one: the variant needs full logits, and the original on transformers
    # against itself measures nothing
    exact_ok = (runtime_class(variant.runtime).full_logits and not (
        variant.runtime == plain_original.runtime and artifact.hash == original.hash
        and not runtime_class(variant.runtime).kv_cache_applied(variant.runtime_options)))

    def build(tmp: Path) -> dict:
        tf_journal = Journal(out_dir, "teacher_forced", key)
        ex_journal = Journal(out_dir, "kld_exactness", key)
        need_tf = [s for s in refs if s not in tf_journal]
        need_ex = [s for s in refs if s not in ex_journal and refs[s].scores] if exact_ok else []
        info = None
        if need_tf or need_ex:
            need = max(context_needed(suites[s], renderer, refs[s].transcripts) for s in refs)
            rt = load_runtime(variant, artifact.path, cfg, n_ctx=n_ctx_for(need, original.facts.get("context_length")))
            try:
                info = rt.info
                for s in need_tf:
                    tf_journal.add(s, teacher_forced(rt, refs[s], cfg.reference.top_k))
                for s in need_ex:
                    ex_journal.add(s, kld_exactness(rt, exact_sample_logprobs(cfg, original, refs[s]), refs[s]))
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


def deployment_suites(cfg: Config, parity: dict | None, suites: dict) -> list[str]:
    """Suites the deployment path runs on for cfg.variant (none for a runtime without a tokenizer of its own)."""
    from pipeline.reference import diverging_suites

    mode = cfg.profile.deployment_path
    if mode == "never" or not runtime_class(cfg.variant.runtime).own_tokenizer:
        return []
    diverging = set(diverging_suites(parity))
    multi_turn = {s for s, convs in suites.items() if any(len(c.turns) > 1 for c in convs)}
    chosen = {"always": set(suites), "auto": diverging | multi_turn, "diverging": diverging}[mode]
    return [s for s in suites if s in chosen]


def deployment_path(cfg: Config, original: Original, renderer: ChatRenderer, artifact: Artifact,
                    suites: dict[str, list[Conversation]], names: list[str]) -> dict:
    """Free-running as a server runs the variant: each turn's chat rendered to text and tokenized by the runtime's
    own tokenizer, replies detokenized by it. Compared in the summary with the variant's own HF-id free-running
    (pass rate, flips, chrF between the two paths). Resumable per conversation; cached by its inputs."""
    from pipeline.store import stable_hash

    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / f"{variant.name}.served"
    key = {**_runtime_key(cfg, artifact), "template": original.facts.get("chat_template_hash"),
           "conversations": {s: stable_hash(suites[s]) for s in names}}
    stop_ids = original.facts["eos_token_ids"]
    context = original.facts.get("context_length")

    def build(tmp: Path) -> dict:
        journal = Journal(out_dir, "served", key)
        todo = [(s, c) for s in names for c in suites[s] if f"{s}/{c.id}" not in journal]
        if todo:
            # The runtime's tokenizer may split text into more ids than the HF one: leave room for that.
            need = max(context_needed(suites[s], renderer) for s in names)
            rt = load_runtime(variant, artifact.path, cfg, n_ctx=n_ctx_for(need + need // 8, context))
            try:
                for s, conv in tqdm(todo, desc=f"deployment path ({variant.name})", unit="conv"):
                    journal.add(f"{s}/{conv.id}", run_conversation(rt, renderer, conv, stop_ids, context, served=True))
            finally:
                rt.close()
        write_jsonl(tmp / "transcripts.jsonl", [journal.get(f"{s}/{c.id}") for s in names for c in suites[s]])
        return {"suites": names}

    manifest = run_stage(f"deployment:{variant.name}", out_dir, key, build, force=cfg.force)
    return {"dir": str(out_dir), "suites": manifest["suites"], "wall_s": manifest.get("wall_s")}
