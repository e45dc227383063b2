"""`quantdrift calibration`: GPTQ/AWQ re-quantized at several calibration sample counts, scored on the run's
reference, with intervals and the paired change against the largest count."""

import json

import pytest

from pipeline.commands.calibration import swept_variant, sweep_rows
from pipeline.cli import run
from pipeline.infra.errors import ConfigError
from pipeline.compose import load_variant
from pipeline.report.sections import _calibration_section


def test_a_swept_variant_changes_only_its_sample_count_and_never_shares_the_variants_artifact():
    base = load_variant("gptq_w4")
    own = base.quantize["calibration"]["samples"]
    assert swept_variant(base, own) is base                       # its own count: its own artifact
    v = swept_variant(base, 512)
    assert v.name == v.base == "gptq_w4.calib512"
    assert v.quantize["calibration"]["samples"] == 512 and base.quantize["calibration"]["samples"] == own
    assert {k: x for k, x in v.quantize.items() if k != "calibration"} == \
           {k: x for k, x in base.quantize.items() if k != "calibration"}
    with pytest.raises(ConfigError, match="no calibration settings"):
        swept_variant(load_variant("gguf_q8_0"), 32)


def _measured(variant, samples, per_conv):
    return {"variant": variant, "samples": samples, "kld_by_conversation": per_conv}


def test_rows_carry_intervals_and_the_paired_change_against_the_largest_count():
    convs = [f"s/c{i}" for i in range(8)]
    big = {c: [0.10 * 100 + i, 100] for i, c in enumerate(convs)}            # mean ~0.1 per token
    worse = {c: [big[c][0] * 1.5, 100] for c in convs}                       # every conversation 50 % worse
    same = {c: [big[c][0] + (0.5 if i % 2 else -0.5), 100] for i, c in enumerate(convs)}
    rows = sweep_rows([_measured("g", 32, worse), _measured("g", 128, same), _measured("g", 512, big)])
    by = {r["samples"]: r for r in rows}
    assert by[512]["compared_to"] == 512 and "delta" not in by[512]
    assert by[512]["kld_low"] <= by[512]["kld_mean"] <= by[512]["kld_high"]
    assert by[512]["conversations"] == 8 and by[512]["tokens"] == 800
    assert by[32]["significant"] and by[32]["delta_low"] > 0                 # fewer texts: significantly worse
    assert by[32]["delta"] == pytest.approx(by[32]["kld_mean"] - by[512]["kld_mean"])
    assert not by[128]["significant"] and by[128]["delta_low"] < 0 < by[128]["delta_high"]


def test_the_sweep_config_is_checked():
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="calibration_sweep.samples"):
        compose(["calibration_sweep.samples=[32,0]"])
    with pytest.raises(ConfigError, match="calibration_sweep.variants"):
        compose(["calibration_sweep.variants=gptq_w4"])


@pytest.mark.slow
@pytest.mark.full       # a whole run repeated: `make test-all` (the nightly suite), not `make test`
def test_the_sweep_runs_on_a_tiny_model_caches_and_reaches_the_report(tiny_cfg, tmp_path):
    pytest.importorskip("gptqmodel")
    args = ("command=calibration", "calibration_sweep.variants=[gptq_w4]", "calibration_sweep.samples=[2,8]")
    assert run(tiny_cfg(*args)) == 0
    cfg = tiny_cfg(*args)
    sweep = json.loads((cfg.results_dir / "calibration_sweep.json").read_text())
    rows = {r["samples"]: r for r in sweep["rows"]}
    assert set(rows) == {2, 8} and not sweep["skipped"]
    assert rows[2]["calibration_samples"] == 2 and rows[8]["calibration_samples"] == 8
    assert rows[2]["calibration_tokens"] < rows[8]["calibration_tokens"]
    for r in rows.values():
        assert 0 < r["kld_low"] <= r["kld_mean"] <= r["kld_high"] and r["producer"]["tool"] == "GPTQModel"
        assert r["tokens"] > 0 and r["bits_per_weight"] > 0
    assert "delta" in rows[2] and rows[2]["compared_to"] == 8
    variants = tmp_path / "artifacts" / "tiny" / "variants"
    assert (variants / "gptq_w4.calib2").is_dir() and (variants / "gptq_w4.calib8").is_dir()
    assert not (variants / "gptq_w4").exists(), "the variant's own artifact is not touched by another count"
    built = {p: p.stat().st_mtime for p in variants.glob("*/manifest.json")}
    assert run(tiny_cfg(*args)) == 0                                         # cached: nothing requantized
    assert {p: p.stat().st_mtime for p in variants.glob("*/manifest.json")} == built
    key, title, blocks = _calibration_section({"calibration_sweep": sweep})
    head, table = blocks[0]
    assert key == "calibration" and [row[1] for row in table] == ["2", "8"] and "Δ vs the largest count" in head[4]


def test_the_report_has_no_calibration_section_without_a_sweep():
    assert _calibration_section({"calibration_sweep": None}) is None
    assert _calibration_section({}) is None
