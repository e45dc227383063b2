"""business_mc per category: the summary joins each sample's category from the task's data file by id and counts,
per variant, each category's right answers and its flips against the original; the report tables them. Synthetic
per-sample results with known answers, no model; a summary without categories renders as before."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.config.summary_contract import summary_schema
from pipeline.decide.bench_summary import task_summary
from pipeline.infra.files import write_json, write_jsonl
from pipeline.report.bench_section import bench_section, category_blocks
from pipeline.suites.lmeval import flips
from pipeline.suites.lmeval.tasks import get_task, load_docs

DOCS = load_docs("business_mc")


def test_by_category_counts_accuracy_and_flips_on_known_vectors():
    categories = {"a1": "a", "b1": "b", "a2": "a", "b2": "b", "a3": "a", "c1": "c"}
    original = {"a1": True, "a2": True, "a3": False, "b1": False, "b2": True, "c1": True}
    variant = {"a1": False, "a2": True, "a3": True, "b1": False, "b2": False, "c1": True}
    out = flips.by_category(categories, variant, original)
    assert list(out) == ["a", "b", "c"]                          # the data file's order
    assert out["a"] == {"samples": 3, "correct": 2, "accuracy": pytest.approx(2 / 3), "correct_to_wrong": 1,
                        "wrong_to_correct": 1}
    assert out["b"] == {"samples": 2, "correct": 0, "accuracy": 0.0, "correct_to_wrong": 1, "wrong_to_correct": 0}
    assert out["c"] == {"samples": 1, "correct": 1, "accuracy": 1.0, "correct_to_wrong": 0, "wrong_to_correct": 0}
    alone = flips.by_category(categories, {"a1": True, "b1": True})     # a limited run, no reference
    assert alone == {"a": {"samples": 1, "correct": 1, "accuracy": 1.0, "correct_to_wrong": None,
                           "wrong_to_correct": None},
                     "b": {"samples": 1, "correct": 1, "accuracy": 1.0, "correct_to_wrong": None,
                           "wrong_to_correct": None}}


def _stage(root: Path, name: str, correct: dict[str, bool], data_sha256: str | None = None) -> dict:
    folder = root / name
    key = {**get_task("business_mc").key(), **({"data_sha256": data_sha256} if data_sha256 else {})}
    write_jsonl(folder / "samples.jsonl", [{"id": d["id"], "correct": correct[d["id"]]} for d in DOCS])
    write_json(folder / "metrics.json", {"task": key, "metrics": {"acc_norm": sum(correct.values()) / len(DOCS)},
                                         "limit": None, "decoding": {"repeat_penalty": 1.0, "rule": "greedy"},
                                         "sandbox": None})
    return {"status": "ok", "benchmarks": {"business_mc": {"status": "ok", "dir": str(folder), "wall_s": 3.0}}}


def _answers():
    """The original right on the hand-written questions and on every other generated one; the variant loses the
    first three policy questions the original had right and gains the first units question it had wrong."""
    original = {d["id"]: d["category"] not in ("invoice_multistep", "policy_distractor", "date_unit_reasoning")
                or i % 2 == 0 for i, d in enumerate(DOCS)}
    units_wrong = next(d["id"] for d in DOCS if d["category"] == "units")
    original[units_wrong] = False
    lost = [d["id"] for d in DOCS if d["category"] == "policy_distractor" and original[d["id"]]][:3]
    variant = {**original, units_wrong: True, **{i: False for i in lost}}
    return original, variant


def _row_schema() -> dict:
    variant = summary_schema()["properties"]["variants"]["additionalProperties"]["oneOf"][0]
    return variant["properties"]["benchmarks"]["additionalProperties"]["oneOf"][0]


def test_the_summary_counts_each_category_of_business_mc_per_variant(tmp_path):
    original, variant = _answers()
    results = {"original": _stage(tmp_path, "original", original), "q4": _stage(tmp_path, "q4", variant)}
    entry, rows = task_summary("business_mc", results)
    assert entry["reference"] == "original"
    counts = {c: sum(d["category"] == c for d in DOCS) for c in dict.fromkeys(d["category"] for d in DOCS)}
    ref, q4 = rows["original"]["by_category"], rows["q4"]["by_category"]
    assert list(ref) == list(counts) and len(counts) == 12          # nine hand-written categories, three generated
    assert {c: v["samples"] for c, v in q4.items()} == counts
    assert ref["units"]["correct"] == counts["units"] - 1 and ref["units"]["correct_to_wrong"] is None
    assert ref["policy_distractor"]["correct"] == 16 and ref["policy_distractor"]["accuracy"] == 0.5
    assert q4["policy_distractor"] == {"samples": 32, "correct": 13, "accuracy": 13 / 32, "correct_to_wrong": 3,
                                       "wrong_to_correct": 0}
    assert q4["units"]["correct"] == counts["units"] and (q4["units"]["correct_to_wrong"],
                                                          q4["units"]["wrong_to_correct"]) == (0, 1)
    assert all(v["correct_to_wrong"] == v["wrong_to_correct"] == 0 for c, v in q4.items()
               if c not in ("units", "policy_distractor"))
    # the categories add up to the task's own figures
    assert sum(v["correct_to_wrong"] for v in q4.values()) == rows["q4"]["correct_to_wrong"] == 3
    assert sum(v["correct"] for v in q4.values()) / len(DOCS) == pytest.approx(rows["q4"]["accuracy"]["estimate"])
    for row in rows.values():
        jsonschema.validate(row, _row_schema())


def test_no_categories_are_joined_onto_a_stage_that_ran_on_another_data_file(tmp_path):
    original, variant = _answers()
    results = {"original": _stage(tmp_path, "original", original, data_sha256="ab" * 32),
               "q4": _stage(tmp_path, "q4", variant)}
    _, rows = task_summary("business_mc", results)
    assert "by_category" not in rows["original"]
    assert rows["q4"]["by_category"]["policy_distractor"]["correct_to_wrong"] is None    # no paired reference
    jsonschema.validate(rows["original"], _row_schema())


def _summary(rows: dict, entry: dict) -> dict:
    return {"variants": {n: {"status": "ok", "benchmarks": {"business_mc": r}} for n, r in rows.items()},
            "benchmarks": {"business_mc": {**entry, "variants": list(rows)}}}


def test_the_report_tables_each_category_per_variant(tmp_path):
    original, variant = _answers()
    results = {"original": _stage(tmp_path, "original", original), "q4": _stage(tmp_path, "q4", variant)}
    entry, rows = task_summary("business_mc", results)
    summary = _summary(rows, entry)
    _, _, blocks = bench_section(summary)
    tables = [b for b in blocks if isinstance(b, tuple)]
    assert len(tables) == 2
    head, body = tables[1]
    assert head == ["category", "samples", "original (reference)", "q4"]
    by_name = {r[0]: r for r in body}
    assert by_name["policy_distractor"] == ["policy_distractor", "32", "50%", "41% (3 / 0)"]
    assert by_name["units"][3].endswith("(0 / 1)") and by_name["units"][2] != "–"
    assert any("Per category" in b for b in blocks if isinstance(b, str))
    # without categories the task's blocks are those it had before them
    plain = {n: {k: v for k, v in r.items() if k != "by_category"} for n, r in rows.items()}
    _, _, before = bench_section(_summary(plain, entry))
    assert blocks[:len(before)] == before and len(blocks) == len(before) + 2
    assert category_blocks("business_mc", entry | {"variants": list(plain)}, _summary(plain, entry)["variants"]) == []


def test_the_committed_benchmarks_run_renders_its_benchmark_section_as_committed():
    from pipeline.report.markdown import render_markdown

    folder = PROJECT_ROOT / "results" / "smollm2-135m-instruct" / "benchmarks"
    summary = json.loads((folder / "summary.json").read_text())
    committed = (folder / "report.md").read_text()
    plots = {m.group(1): m.group(2) for m in re.finditer(r"!\[([^\]]*)\]\(([^)]*)\)", committed)}

    def section(md: str) -> str:
        return md.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]

    assert section(render_markdown(summary, plots)) == section(committed)
