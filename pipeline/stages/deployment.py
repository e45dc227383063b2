"""The deployment path: free-running as a server runs the variant, each turn's chat rendered to text and tokenized
by the runtime's own tokenizer, compared in the summary with the same variant's HF-id free-running."""

from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from pipeline.config.schema import Config
from pipeline.suites.conversation import ChatRenderer, run_conversation
from pipeline.infra.model_source import Original
from pipeline.suites.records import Conversation, generation_fingerprint
from pipeline.infra.code_version import code_version
from pipeline.quantizers.base import Artifact
from pipeline.stages.reference import context_needed, n_ctx_for
from pipeline.runtimes import load_runtime, runtime_class
from pipeline.infra.stage_cache import Journal, run_stage
from pipeline.infra.files import write_jsonl
from pipeline.runtimes import runtime_key

log = logging.getLogger(__name__)


def deployment_suites(cfg: Config, parity: dict | None, suites: dict) -> list[str]:
    """Suites the deployment path runs on for cfg.variant (none for a runtime without a tokenizer of its own)."""
    from pipeline.stages.parity import diverging_suites

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

    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / f"{variant.name}.served"
    key = {**runtime_key(cfg, artifact), "template": original.facts.get("chat_template_hash"),
           "conversations": {s: generation_fingerprint(suites[s]) for s in names},
           "code": code_version("pipeline.suites.conversation")}
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
    return {"dir": str(out_dir), "suites": manifest["suites"], "wall_s": manifest.get("wall_s"),
            "key_hash": manifest["key_hash"]}
