"""Stage 3, reference: the original's own transcripts for every suite, with its top-K log-probs per generated
token (+ the tail mass). The parity checks that decide whether the F16 GGUF may stand in as generator are in
``pipeline.stages.parity``.

Transcripts: greedy, multi-turn replies carried forward. Log-probs: always from the original checkpoint on the
hf runtime, teacher-forced on the transcript's exact ids, so every variant's KL divergence is against the
original's distribution whichever runtime generated the text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.config.schema import Config, VariantConfig
from pipeline.infra.errors import ConfigError
from pipeline.suites.conversation import ChatRenderer, base_messages, free_run
from pipeline.infra.model_source import Original
from pipeline.suites.records import Conversation, generation_fingerprint
from pipeline.infra.code_version import code_version
from pipeline.runtimes import load_runtime
from pipeline.runtimes.base import decoding_key
from pipeline.infra.stage_cache import Journal, journal_path, run_stage
from pipeline.infra.files import read_json, read_jsonl, stable_hash, write_json, write_jsonl

log = logging.getLogger(__name__)


# The variant (conf/variant/gguf_f16.yaml) that checks the conversion and, when it holds, generates the reference.
F16_NAME = "gguf_f16"


def f16_variant() -> VariantConfig:
    from pipeline.compose import load_variant

    return load_variant(F16_NAME)


def context_needed(convs: list[Conversation], renderer: ChatRenderer, transcripts: list[dict] | None = None) -> int:
    """Upper bound of the tokens any free-running pass over these conversations can hold."""
    need = 0
    for i, c in enumerate(convs):
        budgets = sum(t.max_new_tokens or 512 for t in c.turns)
        if transcripts is not None:
            tr = transcripts[i]
            replies = sum(t["end"] - t["start"] for t in tr["turns"])
            need = max(need, len(tr["ids"]) - replies + budgets)
        else:
            first = base_messages(c) + [{"role": "user", "content": c.turns[0].user}]
            user = len(renderer.first_prompt(first)) + sum(len(renderer.encode(t.user)) for t in c.turns[1:])
            need = max(need, user + budgets + 16 * len(c.turns))
    return need + 8


def n_ctx_for(need: int, context_length: int | None) -> int:
    n_ctx = ((need + 255) // 256) * 256
    if context_length and n_ctx > context_length:
        if need > context_length:
            raise ConfigError(f"a conversation needs {need} tokens but the model's context is {context_length}: "
                              "shorten the suite's turns or lower max_new_tokens")
        n_ctx = context_length
    return n_ctx


# ------------------------------------------------------------------------------------------ reference

@dataclass
class SuiteReference:
    suite: str
    transcripts: list[dict]          # run_conversation() output per conversation
    scores: dict[str, dict]          # conversation id -> arrays (topk_ids, topk_lp, tail, actual_lp, pos, turn)
    producer: str
    hash: str
    # conversation id -> (indices into its scored positions, the original's whole log-softmax there, float32):
    # the positions whose tail beyond the top-K holds more than reference.exact_tail_mass (``exact_rows``)
    rows: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    rows_hash: str | None = None
    scores_hash: str | None = None   # the log-probs stage's key hash (what teacher-forced scoring depends on)


class RowFiles(Mapping):
    """Conversation id -> (row indices, the rows' .npy file memory-mapped): each access maps the file anew, and
    the map goes when its caller lets go of it. Maps kept open for the whole run would keep every conversation's
    rows that a scoring pass read (4 bytes x vocabulary each) in the pipeline's resident set into the stages after
    it; mapped per access, one conversation's rows are resident at a time."""

    def __init__(self, files: dict[str, tuple[np.ndarray, Path]]):
        self._files = files

    def __getitem__(self, cid: str) -> tuple[np.ndarray, np.ndarray]:
        idx, path = self._files[cid]
        return idx, np.load(path, mmap_mode="r")

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def reply_positions(transcript: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every reply token: the position that predicts it, its output position within the reply, its turn."""
    pos, out_pos, turn = [], [], []
    for ti, t in enumerate(transcript["turns"]):
        for j in range(t["start"], t["end"]):
            pos.append(j - 1)
            out_pos.append(j - t["start"])
            turn.append(ti)
    return np.array(pos, dtype=np.int64), np.array(out_pos, dtype=np.int64), np.array(turn, dtype=np.int64)


def build_reference(cfg: Config, original: Original, renderer: ChatRenderer, suite: str,
                    convs: list[Conversation], producer: dict) -> SuiteReference:
    """The suite's reference: the producer's transcripts (``reference_transcripts``), the original's top-K log-probs
    on them (``reference_logprobs``) and its whole distribution where the top-K leaves much outside
    (``exact_rows``), three stages so that a change to how log-probs are kept never regenerates a transcript.
    producer: {"name": ..., "variant": VariantConfig, "path": Path, "hash": str}."""
    transcripts, manifest = reference_transcripts(cfg, original, renderer, suite, convs, producer)
    scores, scores_hash = reference_logprobs(cfg, original, suite, transcripts, manifest["key_hash"])
    ref = SuiteReference(suite=suite, transcripts=transcripts, scores=scores, producer=manifest["producer"],
                         hash=manifest["key_hash"], scores_hash=scores_hash)
    return exact_rows(cfg, original, ref)


def reference_transcripts(cfg: Config, original: Original, renderer: ChatRenderer, suite: str,
                          convs: list[Conversation], producer: dict) -> tuple[list[dict], dict]:
    """The producer's greedy multi-turn transcripts of the suite, resumable per conversation; (transcripts, the
    stage's manifest). Its key holds what the replies depend on: the conversations as generated (not their
    checks), the producer's weights, runtime, settings and code, the chat template and the decoding rule."""
    from pipeline.runtimes import runtime_class, runtime_code

    out_dir = cfg.model_dir / "reference" / cfg.run.name / suite
    key = {
        "original": original.hash,
        "producer": producer["name"], "producer_hash": producer["hash"],
        "conversations": generation_fingerprint(convs),
        **({"batch": cfg.profile.batch} if cfg.profile.batch > 1 else {}),   # batched arithmetic: other last bits
        "template": original.facts.get("chat_template_hash"),
        "runtime_settings": runtime_class(producer["variant"].runtime).key_settings(cfg.runtime),
        **decoding_key(cfg.runtime),
        "code": {**runtime_code(producer["variant"].runtime), **code_version("pipeline.suites.conversation")},
    }
    stop_ids = original.facts["eos_token_ids"]

    def build(tmp: Path) -> dict:
        gen_journal = Journal(out_dir, "transcripts", key)
        todo = [c for c in convs if c.id not in gen_journal]
        if todo:
            need = context_needed(convs, renderer)
            n_ctx = n_ctx_for(need, original.facts.get("context_length"))
            rt = load_runtime(producer["variant"], producer["path"], cfg, n_ctx=n_ctx)
            try:
                free_run(rt, renderer, todo, stop_ids, original.facts.get("context_length"), cfg.profile.batch,
                         lambda tr: gen_journal.add(tr["id"], tr), f"reference {suite} ({producer['name']})")
            finally:
                rt.close()
        write_jsonl(tmp / "transcripts.jsonl", [gen_journal.get(c.id) for c in convs])
        return {"producer": producer["name"], "conversations": len(convs)}

    manifest = run_stage(f"reference:{suite}", out_dir, key, build, force=cfg.force)
    return read_jsonl(out_dir / "transcripts.jsonl"), manifest


def reference_logprobs(cfg: Config, original: Original, suite: str, transcripts: list[dict],
                       transcripts_hash: str) -> tuple[dict[str, dict[str, np.ndarray]], str]:
    """The original's top-K log-probs (+ the tail bucket and the log-prob of the token that came) at every reply
    token of the transcripts, teacher-forced on their exact ids on the hf runtime; (per conversation arrays, the
    stage's key hash). Resumable per conversation."""
    from pipeline.figures.drift import topk_chunks
    from pipeline.runtimes import runtime_code

    out_dir = cfg.model_dir / "reference" / cfg.run.name / f"{suite}-logprobs"
    key = {"transcripts": transcripts_hash, "original": original.hash, "top_k": cfg.reference.top_k,
           "code": {**runtime_code(VariantConfig(name="original").runtime),
                    **code_version("pipeline.figures.drift", reply_positions)}}

    def build(tmp: Path) -> dict:
        score_journal = Journal(out_dir, "scores", key)
        todo = [t for t in transcripts if t["id"] not in score_journal]
        if todo:
            hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
            try:
                for tr in tqdm(todo, desc=f"reference {suite} log-probs", unit="conv"):
                    pos, out_pos, turn = reply_positions(tr)
                    if len(pos) == 0:
                        score_journal.add(tr["id"], None)
                        continue
                    actual = np.asarray(tr["ids"])[pos + 1]
                    # streamed: the log-softmax a chunk of rows at a time, its top-K kept per chunk
                    ids, topk_lp, tail, actual_lp = topk_chunks(hf.logprob_blocks(tr["ids"], pos.tolist()),
                                                                cfg.reference.top_k, actual)
                    score_journal.add(tr["id"], {
                        "topk_ids": ids.tolist(), "topk_lp": topk_lp.astype(np.float32).tolist(),
                        "tail": tail.astype(np.float32).tolist(), "actual_lp": actual_lp.astype(np.float32).tolist(),
                    })
            finally:
                hf.close()
        arrays = {}
        for tr in transcripts:
            s = score_journal.get(tr["id"])
            if s is None:
                continue
            pos, out_pos, turn = reply_positions(tr)
            arrays[f"{tr['id']}|pos"] = pos
            arrays[f"{tr['id']}|out_pos"] = out_pos
            arrays[f"{tr['id']}|turn"] = turn
            arrays[f"{tr['id']}|topk_ids"] = np.asarray(s["topk_ids"], dtype=np.int32)
            for k in ("topk_lp", "tail", "actual_lp"):
                arrays[f"{tr['id']}|{k}"] = np.asarray(s[k], dtype=np.float32)
        with open(tmp / "scores.npz", "wb") as fh:
            np.savez(fh, **arrays)      # uncompressed: float32 log-probs hardly compress, and zlib took ~12 s a run
        return {"conversations": len(arrays) // 7}

    manifest = run_stage(f"reference:{suite}:logprobs", out_dir, key, build, force=cfg.force)
    return _by_conversation(out_dir / "scores.npz"), manifest["key_hash"]


def _by_conversation(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """A stage's npz of per-conversation arrays named "<conversation id>|<field>", as {id: {field: array}}."""
    npz = np.load(path)
    out: dict[str, dict] = {}
    for name in npz.files:
        cid, field_name = name.rsplit("|", 1)
        out.setdefault(cid, {})[field_name] = npz[name]
    return out


def exact_rows(cfg: Config, original: Original, ref: SuiteReference) -> SuiteReference:
    """The original's whole distribution (float32 log-probs) where the top-K leaves more than
    ``reference.exact_tail_mass`` outside: there the one-bucket tail under-reads KL divergence most, and the
    teacher-forced pass computes the exact full-vocabulary figure instead. Measured on the default run's
    reference (8 conversations per suite, K=1024): 7 % of positions, and the mean KLD goes from 0.983-0.988 of
    the exact one to 0.995-0.997 (Q8_0, Q4_K_M, Q4_0), at 4 bytes x vocabulary per kept row (float16 would halve
    that, but its 3 digits per log-prob read 1e-5 nats for a model against itself). A stage of its own beside the
    reference, so that changing the threshold rescores but never regenerates a transcript. Each conversation's
    rows are one .npy file, written a chunk of rows at a time and read memory-mapped, so no conversation's rows
    are ever held whole."""
    import os
    import shutil

    from pipeline.figures.drift import write_rows

    tau = cfg.reference.exact_tail_mass
    if tau is None or tau >= 1.0:
        return ref
    out_dir = cfg.model_dir / "reference" / cfg.run.name / f"{ref.suite}-exact_rows"
    # layout 2: one rows/<conversation hash>.npy per conversation (memory-mapped), not one rows.npz read whole
    key = {"logprobs": ref.scores_hash, "exact_tail_mass": tau, "dtype": "float32", "layout": 2}

    def file_name(cid: str) -> str:      # conversation ids are free text: the file is named by their hash
        return f"{stable_hash(cid)[:20]}.npy"

    def picked(cid: str) -> np.ndarray:
        return np.flatnonzero(np.exp(ref.scores[cid]["tail"].astype(np.float64)) > tau)

    def build(tmp: Path) -> dict:
        done = Journal(out_dir, "rows", key)
        todo = [tr for tr in ref.transcripts if tr["id"] in ref.scores and tr["id"] not in done
                and len(picked(tr["id"]))]
        work = journal_path(out_dir)
        if todo:
            hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
            try:
                for tr in tqdm(todo, desc=f"reference {ref.suite} exact rows", unit="conv"):
                    idx = picked(tr["id"])
                    part = work / (file_name(tr["id"]) + ".part")
                    write_rows(part, hf.logprob_blocks(tr["ids"], ref.scores[tr["id"]]["pos"][idx].tolist()),
                               len(idx), np.float32)
                    os.replace(part, work / file_name(tr["id"]))
                    done.add(tr["id"], {"rows": len(idx)})
            finally:
                hf.close()
        (tmp / "rows").mkdir()
        index, kept, total = {}, 0, 0
        for tr in ref.transcripts:
            if tr["id"] not in ref.scores:
                continue
            idx = picked(tr["id"])
            total += len(ref.scores[tr["id"]]["pos"])
            if len(idx):
                name = file_name(tr["id"])
                try:        # the work folder is on the same file system: a link, not a copy of the rows
                    os.link(work / name, tmp / "rows" / name)
                except OSError:
                    shutil.copyfile(work / name, tmp / "rows" / name)
                index[tr["id"]] = {"file": name, "idx": idx.tolist()}
                kept += len(idx)
        write_json(tmp / "rows.json", index)
        size = sum(f.stat().st_size for f in (tmp / "rows").iterdir())
        return {"rows": kept, "positions": total, "bytes": size}

    manifest = run_stage(f"reference:{ref.suite}:exact_rows", out_dir, key, build, force=cfg.force)
    index = read_json(out_dir / "rows.json")
    rows = RowFiles({cid: (np.asarray(e["idx"], dtype=np.int64), out_dir / "rows" / e["file"])
                     for cid, e in index.items()})
    log.info("reference %s: exact rows at %d of %d positions (tail mass > %g), %.1f MB", ref.suite,
             manifest["rows"], manifest["positions"], tau, manifest["bytes"] / 1e6)
    return replace(ref, rows=rows, rows_hash=manifest["key_hash"])
