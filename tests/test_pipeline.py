"""End to end: prepare -> quantize -> reference -> evaluate -> report, through run(cfg) as the CLI calls it."""

import json
import subprocess
import sys

import pytest

from pipeline.cli import run
from pipeline.config import PROJECT_ROOT

DRIFT = ("kld_mean", "kld_median", "kld_p99", "top1_agreement", "delta_nll", "pass_rate", "flip_rate")
SPEED = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s", "itl_p99_s")
MEMORY = ("artifact_bytes", "peak_rss_mb", "kv_bytes_per_token")


def _manifests(root):
    return {str(p): json.loads(p.read_text())["created_unix"] for p in root.rglob("manifest.json")}


def assert_summary_contract(summary, variants):
    assert summary["schema_version"] == 1
    assert summary["reference"]["runtime"]
    assert set(summary["variants"]) == set(variants)
    for name in variants:
        v = summary["variants"][name]
        assert v["status"] == "ok", (name, v.get("reason"))
        for section, keys in (("drift", DRIFT), ("speed", SPEED), ("memory", MEMORY)):
            for k in keys:
                assert v[section][k] is not None, f"{name}.{section}.{k} is empty"
    rec = summary["recommendation"]
    assert rec["variant"] in variants or rec["variant"] is None
    assert set(rec["reasons"]) == set(variants)


@pytest.mark.slow
def test_tiny_model_end_to_end_and_second_run_recomputes_nothing(tiny_cfg, tmp_path):
    variants = ["original", "gguf_q8_0"]
    for v in variants:
        assert run(tiny_cfg(f"variant={v}")) == 0
    cfg = tiny_cfg("command=report", f"run.variants=[{','.join(variants)}]")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert_summary_contract(summary, variants)
    assert summary["variants"]["original"]["drift"]["kld_mean"] == pytest.approx(0.0, abs=1e-6)
    assert summary["variants"]["gguf_q8_0"]["drift"]["kld_mean"] > 0
    assert summary["reference"]["parity"]["ok"]
    for name in ("report.md", "report.html", "samples.jsonl", "pareto.png"):
        assert (cfg.results_dir / name).is_file()
    before = _manifests(tmp_path / "artifacts")
    for v in variants:
        assert run(tiny_cfg(f"variant={v}")) == 0
    assert _manifests(tmp_path / "artifacts") == before, "an immediate second run must recompute nothing"


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
    """The real entry point, as `make compare` calls it: a two-variant sweep on the embedded model, then the report."""
    common = ["profile=smoke", "run.suites=[smoke]", f"paths.artifacts={tmp_path / 'artifacts'}",
              f"paths.results={tmp_path / 'results'}", f"paths.cache={PROJECT_ROOT / '.cache'}",
              f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    exe = [sys.executable, "-m", "pipeline.cli"]
    sweep = subprocess.run(exe + ["-m", "variant=gguf_q8_0,gguf_q4_k_m"] + common, capture_output=True, text=True,
                           timeout=1800)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    report = subprocess.run(exe + ["report", "run.variants=[original,gguf_q8_0,gguf_q4_k_m]"] + common,
                            capture_output=True, text=True, timeout=600)
    # `original` was not in the sweep: reported as skipped, not dropped
    assert report.returncode == 0, report.stderr[-3000:]
    assert "recommendation:" in report.stdout
    summary = json.loads((tmp_path / "results" / "smollm2-135m-instruct" / "smoke" / "summary.json").read_text())
    assert summary["variants"]["original"]["status"] == "skipped"
    assert_summary_contract({**summary, "variants": {k: v for k, v in summary["variants"].items() if k != "original"},
                             "recommendation": {**summary["recommendation"], "reasons": {
                                 k: r for k, r in summary["recommendation"]["reasons"].items() if k != "original"}}},
                            ["gguf_q8_0", "gguf_q4_k_m"])
    parity = summary["reference"]["parity"]
    assert parity["ok"] and parity["f16_kld_mean"] < 1e-3 and not parity["tokenizer_mismatches"]
    assert "Q4_1" in (tmp_path / "results" / "smollm2-135m-instruct" / "smoke" / "report.md").read_text()
