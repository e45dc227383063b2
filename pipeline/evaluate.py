"""Stage 4, evaluate one variant against the reference:
(a) teacher-forced on the reference's exact token ids -> token-level drift (KLD, top-1, delta NLL),
(b) free-running on the same conversations -> checks, flips, chrF, divergence, degeneration,
(c) a speed and memory probe in a clean subprocess.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline import metrics
from pipeline.config import Config
from pipeline.conversation import ChatRenderer, run_conversation
from pipeline.prepare import Original
from pipeline.prompts import Conversation
from pipeline.quantizers.base import Artifact
from pipeline.reference import SuiteReference, context_needed, load_runtime, n_ctx_for
from pipeline.store import Journal, read_json, run_stage, write_json, write_jsonl

log = logging.getLogger(__name__)


def teacher_forced(runtime, ref: SuiteReference, top_k: int) -> dict[str, dict]:
    """Per conversation: per-token KLD, top-1 agreement, NLL of the reference token under both models."""
    out = {}
    for tr in tqdm(ref.transcripts, desc=f"teacher-forced {ref.suite}", unit="conv", leave=False):
        s = ref.scores.get(tr["id"])
        if s is None:
            continue
        cand = np.concatenate([s["topk_ids"].astype(np.int64), np.asarray(tr["ids"])[s["pos"] + 1][:, None]], axis=1)
        lp, argmax = runtime.gather(tr["ids"], s["pos"].tolist(), cand)
        kld = metrics.kld_topk_tail(s["topk_lp"], s["tail"], lp[:, :top_k])
        out[tr["id"]] = {
            "kld": kld.astype(np.float32).tolist(),
            "top1": (argmax == s["topk_ids"][:, 0]).astype(int).tolist(),
            "nll_variant": (-lp[:, top_k]).astype(np.float32).tolist(),
            "nll_reference": (-s["actual_lp"].astype(np.float64)).astype(np.float32).tolist(),
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


def _same_as_producer(cfg: Config, artifact: Artifact, ref: SuiteReference, producer_hash: str) -> bool:
    return artifact.hash == producer_hash or (cfg.variant.name == "original")


def evaluate_variant(cfg: Config, original: Original, renderer: ChatRenderer, artifact: Artifact,
                     suites: dict[str, list[Conversation]], refs: dict[str, SuiteReference], producer: dict,
                     probe_prompt: list[int]) -> dict:
    """Runs (a), (b), (c) for cfg.variant, resumable per conversation. Returns the variant's raw result."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / variant.name
    key = {
        "variant": variant.name, "artifact": artifact.hash, "runtime": variant.runtime,
        "runtime_options": variant.runtime_options, "references": {s: r.hash for s, r in refs.items()},
        "threads": cfg.runtime.n_threads, "device": cfg.runtime.device, "speed": cfg.profile.speed.__dict__,
        "probe_prompt": len(probe_prompt),
    }
    stop_ids = original.facts["eos_token_ids"]
    # The reference transcripts are the free-running output of the producer; re-running it would repeat them.
    reuse_reference = cfg.variant.name == "original" or artifact.hash == producer["hash"]

    def build(tmp: Path) -> dict:
        from pipeline.probe import probe_speed

        tf_journal = Journal(out_dir, "teacher_forced", key)
        fr_journal = Journal(out_dir, "free_running", key)
        need_tf = [s for s in refs if s not in tf_journal]
        need_fr = [] if reuse_reference else [s for s in refs if s not in fr_journal]
        if need_tf or need_fr:
            need = max(context_needed(suites[s], renderer, refs[s].transcripts) for s in refs)
            rt = load_runtime(variant, artifact.path, cfg,
                              n_ctx=n_ctx_for(need, original.facts.get("context_length")))
            info = rt.info
            for s in need_tf:
                tf_journal.add(s, teacher_forced(rt, refs[s], cfg.reference.top_k))
            for s in need_fr:
                convs = {c.id: c for c in suites[s]}
                per_conv = {}
                conv_journal = Journal(out_dir, f"free_running_{s}", key)
                for tr in tqdm(refs[s].transcripts, desc=f"free-running {s} ({variant.name})", unit="conv"):
                    if tr["id"] not in conv_journal:
                        conv_journal.add(tr["id"], run_conversation(rt, renderer, convs[tr["id"]], stop_ids,
                                                                    original.facts.get("context_length")))
                    per_conv[tr["id"]] = conv_journal.get(tr["id"])
                fr_journal.add(s, per_conv)
            rt.close()
        else:
            info = None
        free = {s: ({tr["id"]: tr for tr in refs[s].transcripts} if reuse_reference else fr_journal.get(s))
                for s in refs}
        samples = []
        for s in refs:
            for tr in refs[s].transcripts:
                var_tr = free[s][tr["id"]]
                for row in compare_free_running(tr, var_tr):
                    samples.append({"variant": variant.name, "suite": s, "conversation": tr["id"], **row})
        speed = probe_speed(cfg, variant, artifact, probe_prompt)
        write_json(tmp / "teacher_forced.json", {s: tf_journal.get(s) for s in refs})
        write_jsonl(tmp / "samples.jsonl", samples)
        write_json(tmp / "speed.json", speed)
        return {"runtime_info": info or speed.get("runtime_info"),
                "free_running_source": (f"reference transcripts ({producer['name']})" if reuse_reference
                                        else f"{variant.name} on {variant.runtime}")}

    manifest = run_stage(f"evaluate:{variant.name}", out_dir, key, build, force=cfg.force)
    return {
        "manifest": manifest,
        "teacher_forced": read_json(out_dir / "teacher_forced.json"),
        "samples_path": str(out_dir / "samples.jsonl"),
        "speed": read_json(out_dir / "speed.json"),
    }
