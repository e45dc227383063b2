"""Stage 4, evaluate one variant: free-running on the same conversations as the reference, its replies kept per
conversation (resumable). Teacher-forced drift is ``pipeline.stages.score``, check outcomes ``pipeline.stages.outcomes``,
speed and memory ``pipeline.stages.speed`` (every variant in interleaved trials)."""

from __future__ import annotations

import logging
from pathlib import Path


from pipeline.config.summary_contract import SCHEMA_VERSION
from pipeline.config.schema import Config
from pipeline.suites.conversation import ChatRenderer, free_run
from pipeline.infra.model_source import Original
from pipeline.suites.records import Conversation
from pipeline.quantizers.base import Artifact
from pipeline.stages.reference import SuiteReference, context_needed, n_ctx_for
from pipeline.runtimes import load_runtime, runtime_class
from pipeline.infra.stage_cache import Journal, run_stage
from pipeline.infra.code_version import code_version
from pipeline.infra.files import read_jsonl, write_jsonl
from pipeline.stages.standin import DEQUANTIZABLE, _choose_generator
from pipeline.runtimes import runtime_key

log = logging.getLogger(__name__)


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
                     suites: dict[str, list[Conversation]], refs: dict[str, SuiteReference], producer: dict,
                     folder: str | None = None, reuse: bool | None = None) -> dict:
    """cfg.variant free-running through every conversation of every suite, as a stage of its own, resumable per
    conversation. A variant that runs exactly as the reference's producer did reuses the reference transcripts
    (``reuses_reference``). Returns the stage's manifest, its folder (``dir``) and the transcripts per suite and
    conversation id. Its key holds what the replies depend on (the weights, the runtime and its code, the
    conversations as generated, the conversation-driving code), never how the replies are checked or scored.
    ``folder``: the stage's folder name in the run (default: the variant's name); ``reuse``: whether to reuse the
    reference transcripts (default: ``reuses_reference``; False makes the original generate on its own runtime)."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / (folder or variant.name)
    reuse_reference = reuses_reference(cfg, artifact, producer) if reuse is None else reuse
    standin = (variant.runtime_options.get("free_running") == "dequantized"
               and artifact.info.get("format") in DEQUANTIZABLE and "kv_cache" not in variant.runtime_options)
    key = {
        "schema_version": SCHEMA_VERSION,    # an evaluation from another contract is recomputed, never misread
        **runtime_key(cfg, artifact),
        "references": {s: r.hash for s, r in refs.items()},
        # the stand-in is chosen by its teacher-forced agreement with the kernel on the reference's log-probs
        **({"reference_logprobs": {s: r.scores_hash for s, r in refs.items()}} if standin else {}),
        **({"batch": cfg.profile.batch} if cfg.profile.batch > 1 else {}),
        "code": code_version("pipeline.suites.conversation"),
    }
    stop_ids = original.facts["eos_token_ids"]

    def build(tmp: Path) -> dict:
        if reuse_reference:
            return {"runtime_info": None, "free_running_source": f"reference transcripts ({producer['name']})",
                    "dequantized_check": None, "reused_reference": True}
        fr_journal = Journal(out_dir, "free_running", key)
        need_fr = [s for s in refs if s not in fr_journal]
        info = None
        if need_fr:
            need = max(context_needed(suites[s], renderer, refs[s].transcripts) for s in refs)
            rt = load_runtime(variant, artifact.path, cfg,
                              n_ctx=n_ctx_for(need, original.facts.get("context_length")))
            info = rt.info
            gen_rt, fr_note = rt, None
            # The stand-in runs on llama.cpp, whose cache is not the hf int8 cache: a KV variant uses the kernel.
            if standin:
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
            fr_journal.add("_info", info)
        write_jsonl(tmp / "transcripts.jsonl", [tr for s in refs for tr in fr_journal.get(s).values()])
        path_note = fr_journal.get("_path") if "_path" in fr_journal else None
        if path_note and path_note["used"]:
            source = "dequantized weights as F16 GGUF on llama.cpp (checked against the kernel)"
        else:
            source = f"{variant.name} on {variant.runtime} (real kernel)"
        return {"runtime_info": fr_journal.get("_info") if "_info" in fr_journal else info,
                "free_running_source": source, "dequantized_check": path_note, "reused_reference": False}

    manifest = run_stage(f"evaluate:{variant.name}", out_dir, key, build, force=cfg.force)
    if manifest.get("reused_reference"):
        free = {s: {tr["id"]: tr for tr in refs[s].transcripts} for s in refs}
    else:
        free = {}
        for tr in read_jsonl(out_dir / "transcripts.jsonl"):
            free.setdefault(tr["suite"], {})[tr["id"]] = tr
    standin = manifest.get("dequantized_check") or {}
    generated_on = producer["variant"].runtime if manifest.get("reused_reference") else (
        standin["runtime"] if standin.get("used") else variant.runtime)
    return {**manifest, "dir": str(out_dir), "transcripts": free, "generated_on": generated_on}
