"""End to end: prepare -> quantize -> reference -> evaluate -> report, through run(cfg) as the CLI calls it."""

import json
import subprocess
import sys

import pytest

from pipeline.cli import run
from pipeline.config.schema import PROJECT_ROOT

# The contract comes from the metric catalogue: every judged metric must be measured for an ok variant.
from pipeline.config.summary_contract import METRICS, SCHEMA_VERSION, validate_summary  # noqa: E402


def _manifests(root):
    return {str(p): json.loads(p.read_text())["created_unix"] for p in root.rglob("manifest.json")}


def assert_summary_contract(summary, variants, recommends: bool = True):
    """``recommends``: a run whose decision must name a variant (the embedded model always has one that meets
    the default constraints); a random tiny model may legitimately have none."""
    assert summary["schema_version"] == SCHEMA_VERSION
    validate_summary(summary)
    assert summary["reference"]["runtime"]
    assert set(summary["variants"]) == set(variants)
    for name in variants:
        v = summary["variants"][name]
        assert v["status"] == "ok", (name, v.get("reason"))
        for m in METRICS:
            if m.better:
                assert v[m.section][m.name] is not None, f"{name}.{m.section}.{m.name} is empty"
    rec = summary["recommendation"]
    if recommends:
        assert rec["variant"] in variants, rec["summary"]
    else:
        assert rec["variant"] in variants or rec["variant"] is None
    assert set(rec["reasons"]) == set(variants)


@pytest.mark.slow
def test_tiny_model_end_to_end_and_second_run_recomputes_nothing(tiny_cfg, tmp_path):
    variants = ["original", "gguf_q8_0"]
    cfg = tiny_cfg("command=compare", f"run.variants=[{','.join(variants)}]", "load=off")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert_summary_contract(summary, variants, recommends=False)
    assert summary["variants"]["original"]["drift"]["kld_mean"] == pytest.approx(0.0, abs=1e-6)
    assert summary["variants"]["gguf_q8_0"]["drift"]["kld_mean"] > 0
    # a random model's distributions are nearly flat: the top-K leaves most mass outside, so every position keeps
    # the original's whole row and the stored KLD is the exact one
    assert summary["variants"]["gguf_q8_0"]["drift"]["kld_stored_exact_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert summary["reference"]["parity"]["ok"]
    for name in ("report.md", "report.html", "samples.jsonl", "pareto.png"):
        assert (cfg.results_dir / name).is_file()
    # what the results cost, stage by stage, from the stages' manifests, and the report's table of it
    t = summary["stage_times"]
    assert set(t["references_s"]) == {"smoke"} and t["references_s"]["smoke"] > 0
    assert t["variants_s"]["gguf_q8_0"]["free_running"] > 0 and t["variants_s"]["gguf_q8_0"]["scoring"] > 0
    assert t["variants_s"]["original"]["scoring"] > 0 and t["run_s"]["speed"] > 0
    assert t["total_s"] == pytest.approx(sum(t["references_s"].values()) + sum(t["run_s"].values())
                                         + sum(sum(r.values()) for r in t["variants_s"].values()))
    assert "## Run time" in (cfg.results_dir / "report.md").read_text()
    # every stage's peak host memory is recorded, and none adds more than 1.5 x the largest model it could hold plus
    # 2 GB (libraries it loads) to what the process held when it started (this test's process holds the whole
    # session's): a whole conversation's (n, vocab) float64 matrix, or two models resident at once, would break it
    # at a real model's size (the 1.24 B run: docs/plan.md)
    peaks = t["peak_host_mb"]
    assert {"prepare", "convert_f16", "parity", "reference", "evaluate", "score", "speed"} <= set(peaks)
    assert set(peaks["score"]) == set(variants) and set(peaks["reference"]) == {"smoke"}
    largest_mb = max(v["memory"]["artifact_bytes"] for v in summary["variants"].values()) / 2**20
    grown = {}
    for path in (tmp_path / "artifacts").rglob("manifest.json"):
        mem = json.loads(path.read_text()).get("host_memory")
        if mem and path.parent.name != "speed":       # the speed stage keeps a probe process per variant
            grown[str(path.parent.relative_to(tmp_path))] = mem["peak_host_mb"] - mem["start_rss_mb"]
    assert len(grown) >= 8
    for where, mb in grown.items():
        assert mb <= 1.5 * largest_mb + 2048, (where, mb)
    for name, v in summary["variants"].items():       # each speed probe, a process of its own
        assert 0 < v["memory"]["peak_rss_mb"] <= 1.5 * largest_mb + 2048, (name, v["memory"]["peak_rss_mb"])
    # the evaluation is keyed by the summary schema, so one cached under another contract is recomputed
    evaluation = json.loads((tmp_path / "artifacts" / "tiny" / "runs" / "smoke" / "gguf_q8_0" / "manifest.json").read_text())
    assert evaluation["key"]["schema_version"] == SCHEMA_VERSION
    before = _manifests(tmp_path / "artifacts")
    assert run(cfg) == 0
    assert _manifests(tmp_path / "artifacts") == before, "an immediate second run must recompute nothing"


@pytest.mark.slow
def test_a_batched_profile_generates_what_the_single_sequence_one_does(tiny_cfg, tmp_path):
    """profile.batch=2: the reference and the variant's free-running run two conversations at once on llama.cpp;
    the transcripts carry the same tokens as one-at-a-time generation on at least 99 % of positions."""
    from pipeline.infra.files import read_jsonl

    assert run(tiny_cfg("variant=gguf_q8_0")) == 0
    assert run(tiny_cfg("variant=gguf_q8_0", "profile.batch=2", "run.name=batched")) == 0
    ref = tmp_path / "artifacts" / "tiny" / "reference"
    one, two = (read_jsonl(ref / name / "smoke" / "transcripts.jsonl") for name in ("smoke", "batched"))
    assert [t["id"] for t in one] == [t["id"] for t in two]
    same = sum(a == b for x, y in zip(one, two) for a, b in zip(x["ids"], y["ids"]))
    assert same / sum(len(x["ids"]) for x in one) >= 0.99
    manifest = json.loads((tmp_path / "artifacts" / "tiny" / "runs" / "batched" / "gguf_q8_0" / "manifest.json")
                          .read_text())
    assert manifest["key"]["batch"] == 2


@pytest.mark.slow
def test_a_skipped_variant_is_reported_with_its_reason(tiny_cfg):
    cfg = tiny_cfg("command=report", "run.variants=[original,gguf_q4_0]")
    run(tiny_cfg("variant=original"))
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["variants"]["gguf_q4_0"]["status"] == "skipped"
    assert "not evaluated" in summary["variants"]["gguf_q4_0"]["reason"]
    assert "gguf_q4_0" in (cfg.results_dir / "report.md").read_text()


@pytest.mark.smoke
def test_smoke_run_of_the_embedded_model_through_the_cli(tmp_path):
    """The real entry point, as `make compare` calls it: a two-variant comparison of the embedded model, then the
    report of three variants (the third never evaluated), which measures nothing."""
    common = ["profile=smoke", "run.suites=[smoke]", f"paths.artifacts={tmp_path / 'artifacts'}",
              f"paths.results={tmp_path / 'results'}", f"paths.cache={PROJECT_ROOT / '.cache'}",
              f"hydra.run.dir={tmp_path / 'run'}"]
    exe = [sys.executable, "-m", "pipeline.cli"]
    compared = subprocess.run(exe + ["compare", "run.variants=[gguf_q8_0,gguf_q4_k_m]", "load=off"] + common,
                              capture_output=True, text=True, timeout=1800)
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "recommendation:" in compared.stdout
    report = subprocess.run(exe + ["report", "run.variants=[original,gguf_q8_0,gguf_q4_k_m]"] + common,
                            capture_output=True, text=True, timeout=600)
    # `original` was not compared: reported as skipped, not dropped; the speed trials are the comparison's
    assert report.returncode == 0, report.stderr[-3000:]
    assert "recommendation:" in report.stdout and "not in this report" not in report.stderr, report.stderr[-2000:]
    summary = json.loads((tmp_path / "results" / "smollm2-135m-instruct" / "smoke" / "summary.json").read_text())
    assert summary["variants"]["original"]["status"] == "skipped"
    assert_summary_contract({**summary, "variants": {k: v for k, v in summary["variants"].items() if k != "original"},
                             "recommendation": {**summary["recommendation"], "reasons": {
                                 k: r for k, r in summary["recommendation"]["reasons"].items() if k != "original"}}},
                            ["gguf_q8_0", "gguf_q4_k_m"], recommends=False)
    rec = summary["recommendation"]
    # two speed rounds cannot reach alpha: with both variants eligible the run names no pick, and says why
    passing = [n for n in ("gguf_q8_0", "gguf_q4_k_m") if not rec["reasons"][n].startswith(("fails", "undecided"))]
    if len(passing) > 1:
        assert rec["variant"] is None and "cannot rank with 2 rounds" in rec["summary"], rec["summary"]
    else:
        assert rec["variant"] == (passing[0] if passing else None), rec["summary"]
    parity = summary["reference"]["parity"]
    # the HF tokenizer was given the GGUF's own pre-tokenizer at prepare, so no suite text splits differently
    assert parity["ok"] and parity["f16_kld_mean"] < 1e-3 and parity["tokenizer"]["diverging_texts"] == 0
    assert summary["model"]["tokenizer_repair"]["gguf_pre_tokenizer"] == "smollm"
    assert "Q4_1" in (tmp_path / "results" / "smollm2-135m-instruct" / "smoke" / "report.md").read_text()


def test_a_result_from_another_schema_is_reported_skipped_not_misread(tmp_path):
    from pipeline.decide.variant_summary import variant_summary

    old = {"status": "ok", "runtime": "llamacpp", "description": "x", "evaluation": {"dir": str(tmp_path / "gone")}}
    v = variant_summary(old)
    assert v["status"] == "skipped" and "summary schema 1" in v["reason"] and "make compare" in v["reason"]


@pytest.mark.slow
def test_a_variant_generated_on_another_runtime_is_checked_against_the_original_on_that_runtime(tiny_cfg):
    """The reference comes from the F16 GGUF on llama.cpp; original+kv_int8 generates on transformers. Its checks are
    also read against the original's own replies on transformers (a stage shared by every such variant), and the
    original there against the reference is the runtime switch's own flip floor, in the summary and the report."""
    variants = ["original", "original+kv_int8"]
    for v in variants:
        assert run(tiny_cfg(f"variant={v}")) == 0
    cfg = tiny_cfg("command=report", f"run.variants=[{','.join(variants)}]")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["reference"]["runtime"].endswith("@llamacpp")
    sr = summary["variants"]["original+kv_int8"]["free_running"]["same_runtime"]
    assert sr["runtime"] == "hf" and sr["vs_original_same_runtime"]["checks"] > 0
    assert summary["runtime_floor"]["hf"] == sr["runtime_switch_floor"]
    assert summary["variants"]["original"]["free_running"]["same_runtime"] is None
    assert (cfg.model_dir / "runs" / "smoke" / "original@hf" / "transcripts.jsonl").is_file()
    assert "the original on hf (runtime switch floor)" in (cfg.results_dir / "report.md").read_text()
