"""Stage 6, the checks' outcomes: every turn's machine checks (``pipeline.suites.checks``) applied to the
reference's reply and to the variant's, turn by turn, with the reply-level comparison (chrF, first divergent token,
repetition, length), into ``samples.jsonl``; and to the deployment path's replies, where it ran, into
``served.jsonl``.

Outcomes are computed here, from the replies' text, never when the replies are generated: the stage's key holds the
checks as the profile scores them and the version of the code that applies them (``pipeline.suites.checks``), so a
fixed check or a changed budget recomputes every outcome in seconds, and no reply is generated again.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config.schema import Config
from pipeline.infra.code_version import code_version
from pipeline.infra.files import read_jsonl, write_jsonl
from pipeline.infra.stage_cache import run_stage
from pipeline.figures import drift
from pipeline.suites import checks
from pipeline.suites.records import Conversation, checks_fingerprint


def checks_code() -> dict:
    """The code an outcome or a reply comparison depends on."""
    return code_version("pipeline.suites.checks", "pipeline.suites.language", "pipeline.figures.drift",
                        compare_free_running, turn_outcomes)


def turn_outcomes(conv: Conversation, transcript: dict) -> list[list[bool]]:
    """Per turn of ``transcript``: the outcome of each of that turn's checks on its reply text (through the checks
    module's own binding, the code whose version the key holds)."""
    return [[bool(checks.run_check(c, t["text"])) for c in turn.checks]
            for turn, t in zip(conv.turns, transcript["turns"])]


def compare_free_running(conv: Conversation, ref_tr: dict, var_tr: dict) -> list[dict]:
    """Per turn: the check outcomes of both replies, chrF, first divergent token, repetition, length ratio."""
    rows = []
    ref_checks, var_checks = turn_outcomes(conv, ref_tr), turn_outcomes(conv, var_tr)
    for i, (rt, vt) in enumerate(zip(ref_tr["turns"], var_tr["turns"])):
        ref_ids = ref_tr["ids"][rt["start"]:rt["end"]]
        var_ids = var_tr["ids"][vt["start"]:vt["end"]]
        rows.append({
            "turn": i,
            "checks_reference": ref_checks[i],
            "checks_variant": var_checks[i],
            "check_labels": [checks.check_label(c, j) for j, c in enumerate(conv.turns[i].checks)],
            "chrf": drift.chrf(vt["text"], rt["text"]) if rt["text"] or vt["text"] else 100.0,
            "first_divergence": drift.first_divergence(ref_ids, var_ids),
            "repeated_4gram_rate": drift.repeated_ngram_rate(var_ids, 4),
            "longest_loop_tokens": drift.longest_loop(var_ids),
            "length_ratio": (len(var_ids) / len(ref_ids)) if ref_ids else None,
            "reply_tokens": len(var_ids),
            "reference_text": rt["text"],
            "variant_text": vt["text"],
        })
    return rows


def check_variant(cfg: Config, suites: dict[str, list[Conversation]], refs: dict, free: dict,
                  deployment: dict | None = None, baseline: dict | None = None) -> dict:
    """``free``: the evaluate stage's result (its manifest, and ``transcripts`` per suite and conversation id);
    ``deployment``: the deployment stage's result or None; ``baseline``: the original's own free-running on the
    runtime that generated the variant's replies, where that is not the reference's (an evaluate stage's result, or
    None): each sample then also carries the baseline's outcomes (``checks_baseline``), so the variant's flips can
    be read against the original on the same runtime. Returns the stage's manifest with its folder (``dir``)."""
    variant = cfg.variant
    out_dir = cfg.model_dir / "runs" / cfg.run.name / f"{variant.name}.checks"
    key = {"free_running": free["key_hash"], "references": {s: r.hash for s, r in refs.items()},
           "checks": {s: checks_fingerprint(convs) for s, convs in suites.items()},
           "deployment": (deployment or {}).get("key_hash"), "baseline": (baseline or {}).get("key_hash"),
           "code": checks_code()}

    def build(tmp: Path) -> dict:
        samples = []
        for s, ref in refs.items():
            convs = {c.id: c for c in suites[s]}
            for tr in ref.transcripts:
                conv = convs[tr["id"]]
                extra = {"meta": conv.meta} if conv.meta else {}
                rows = compare_free_running(conv, tr, free["transcripts"][s][tr["id"]])
                if baseline:
                    for row, outcomes in zip(rows, turn_outcomes(conv, baseline["transcripts"][s][tr["id"]])):
                        row["checks_baseline"] = outcomes
                        row["baseline_runtime"] = baseline["generated_on"]
                for row in rows:
                    samples.append({"variant": variant.name, "suite": s, "conversation": tr["id"], **row, **extra})
        write_jsonl(tmp / "samples.jsonl", samples)
        served = []
        if deployment:
            for tr in read_jsonl(Path(deployment["dir"]) / "transcripts.jsonl"):
                conv = next(c for c in suites[tr["suite"]] if c.id == tr["id"])
                for i, outcomes in enumerate(turn_outcomes(conv, tr)):
                    served.append({"suite": tr["suite"], "conversation": tr["id"], "turn": i, "checks": outcomes,
                                   "text": tr["turns"][i]["text"]})
            write_jsonl(tmp / "served.jsonl", served)
        return {"samples": len(samples), "served": len(served) if deployment else None}

    manifest = run_stage(f"checks:{variant.name}", out_dir, key, build, force=cfg.force)
    return {**manifest, "dir": str(out_dir)}
