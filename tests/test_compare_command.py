"""`quantdrift compare` owns the order of a comparison (pre-flight, variants, speed, load, decision, report), and
`quantdrift report` renders finished stages and measures nothing: the committed run renders as it was, and a run
that lacks its speed trials says so instead of measuring them."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.cli import run
from pipeline.config.schema import PROJECT_ROOT

COMMITTED = PROJECT_ROOT / "results" / "smollm2-135m-instruct" / "quick"


def _no_measuring(monkeypatch):
    """Every instrument and stage that measures or builds, made to fail the test if it is called."""
    import pipeline.commands.compare as compare
    import pipeline.instruments.bandwidth as bandwidth
    import pipeline.stages.load as load
    import pipeline.stages.speed as speed
    import pipeline.commands.variant_job as variant_job

    def measured(*a, **k):
        raise AssertionError("the report measured something")

    for module, name in ((speed, "measure_speed"), (bandwidth, "run_bandwidth"), (bandwidth, "measure_bandwidth"),
                         (load, "run_load"), (variant_job, "evaluate_job"), (compare, "evaluate_variants"),
                         (compare, "measure_speed_stage"), (compare, "load_stage")):
        monkeypatch.setattr(module, name, measured)


def test_the_report_of_the_committed_run_measures_nothing_and_renders_it_as_it_was(tmp_path, monkeypatch):
    from tests.conftest import compose

    _no_measuring(monkeypatch)
    results = tmp_path / "results"
    shutil.copytree(COMMITTED, results / COMMITTED.parent.name / COMMITTED.name)
    shutil.copy(PROJECT_ROOT / "results" / "history.jsonl", results / "history.jsonl")
    names = list(json.loads((COMMITTED / "summary.json").read_text())["variants"])
    cfg = compose(["command=report", "profile=quick", f"run.variants=[{','.join(names)}]",
                   f"paths.results={results}", f"paths.artifacts={tmp_path / 'artifacts'}"])
    assert run(cfg) == 0
    for name in ("summary.json", "report.md", "report.html"):
        assert (cfg.results_dir / name).read_bytes() == (COMMITTED / name).read_bytes(), name
    empty = compose(["command=report", "run.variants=[original]", f"paths.results={tmp_path / 'none'}",
                     f"paths.artifacts={tmp_path / 'artifacts'}"])
    from pipeline.infra.errors import ConfigError

    with pytest.raises(ConfigError, match="quantdrift compare"):
        run(empty)


@pytest.mark.slow
def test_compare_runs_its_stages_in_order_and_the_report_renders_them_without_measuring(tiny_cfg, monkeypatch,
                                                                                        capsys):
    import pipeline.commands.compare as compare
    import pipeline.decide.summary as summary_mod
    import pipeline.report.write as write
    import pipeline.stages.preflight as preflight
    import pipeline.stages.speed as speed
    import pipeline.commands.variant_job as variant_job

    order = []

    def spy(module, name, label):
        real = getattr(module, name)

        def wrapper(cfg, *a, **k):
            order.append(label(cfg))
            return real(cfg, *a, **k)

        monkeypatch.setattr(module, name, wrapper)

    spy(preflight, "run_preflight", lambda cfg: "preflight")
    spy(variant_job, "evaluate_job", lambda cfg: f"variant {cfg.variant.name}")
    spy(speed, "measure_speed", lambda cfg: "speed")
    spy(summary_mod, "write_summary", lambda cfg: "decision")
    spy(write, "render_report", lambda cfg: "report")
    variants = ["original", "gguf_q8_0"]
    cfg = tiny_cfg("command=compare", f"run.variants=[{','.join(variants)}]", "load=off")
    assert run(cfg) == 0
    assert order == ["preflight", "variant original", "variant gguf_q8_0", "speed", "decision", "report"]
    out = capsys.readouterr().out
    assert "recommendation:" in out
    measured = json.loads((cfg.results_dir / "summary.json").read_text())
    assert measured["stages_missing"] == {}
    assert measured["speed_protocol"]["rounds"] and measured["bandwidth"]
    q8 = measured["variants"]["gguf_q8_0"]
    assert q8["drift"]["kld_mean"] > 0 and q8["speed"]["decode_tokens_per_s"] > 0

    # the report of the same run: the same figures, taken from the finished stages, nothing measured
    monkeypatch.undo()
    _no_measuring(monkeypatch)
    assert run(tiny_cfg("command=report", f"run.variants=[{','.join(variants)}]")) == 0
    rendered = json.loads((cfg.results_dir / "summary.json").read_text())
    for key in ("variants", "recommendation", "speed_noise", "bandwidth", "stages_missing"):
        assert rendered[key] == measured[key], key


@pytest.mark.slow
def test_a_report_names_the_stages_its_run_lacks_instead_of_measuring_or_borrowing_them(tiny_cfg, monkeypatch):
    assert run(tiny_cfg("variant=gguf_q8_0")) == 0
    _no_measuring(monkeypatch)
    cfg = tiny_cfg("command=report", "run.variants=[gguf_q8_0]")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["stages_missing"] == {"speed": "the speed trials have not run for this run's variants"}
    assert summary["variants"]["gguf_q8_0"]["drift"]["kld_mean"] > 0
    md = (cfg.results_dir / "report.md").read_text()
    assert "Not in this report: speed (the speed trials have not run for this run's variants)" in md

    # a load sweep that an earlier run left in the results folder, served from other artifacts: named, not shown
    from pipeline.stages.load import evaluated_as
    from pipeline.stages.variant_setup import load_result
    from tests.test_load import _stored_sweep

    _stored_sweep(cfg.results_dir, ["gguf_q8_0"], {"gguf_q8_0": "an earlier run's artifact"})
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["load"] is None and "load" not in summary["variants"]["gguf_q8_0"]
    assert "served other artifacts of gguf_q8_0 than this run evaluated" in summary["stages_missing"]["load"]
    md = (cfg.results_dir / "report.md").read_text()
    assert f"; load (the load sweep in {cfg.results_dir / 'load.json'} is not shown" in md
    # the same sweep recorded beside this run's evaluation is this run's
    _stored_sweep(cfg.results_dir, ["gguf_q8_0"], {"gguf_q8_0": evaluated_as(load_result(cfg, "gguf_q8_0"))})
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert "load" not in summary["stages_missing"] and set(summary["load"]["variants"]) == {"gguf_q8_0"}
    assert summary["variants"]["gguf_q8_0"]["load"]["throughput_at_slo"] == 80.0


def _teacher_forced(tmp_path, kld_per_conversation: list[float]):
    """A scoring stage's folder whose conversations have these mean KLDs (four positions each)."""
    from pipeline.infra.files import write_json

    convs = {f"c{i}": {"kld": [k] * 4, "top1": [1] * 4, "nll_variant": [1.0] * 4, "nll_reference": [1.0] * 4}
             for i, k in enumerate(kld_per_conversation)}
    write_json(tmp_path / "teacher_forced.json", {"long_output": convs})
    return {"dir": str(tmp_path)}


@pytest.mark.parametrize("klds, limit, screen, variant, screened", [
    ([0.30, 0.32, 0.35, 0.31, 0.33, 0.34], 0.1, True, "gguf_q4_0", True),     # wholly above: out
    ([0.02, 0.30, 0.01, 0.25, 0.03, 0.20], 0.1, True, "gguf_q4_0", False),    # straddles: measured on
    ([0.01, 0.02, 0.01, 0.02, 0.01, 0.02], 0.1, True, "gguf_q4_0", False),    # below
    ([0.30, 0.32, 0.35, 0.31, 0.33, 0.34], 0.1, False, "gguf_q4_0", False),   # decision.screen=false
    ([0.30, 0.32, 0.35, 0.31, 0.33, 0.34], None, True, "gguf_q4_0", False),   # no KLD limit
    ([0.30, 0.32, 0.35, 0.31, 0.33, 0.34], 0.1, True, "original", False),     # the baseline is never screened
])
def test_the_screen_takes_out_a_variant_only_when_its_kld_interval_lies_wholly_above_the_limit(
        tmp_path, klds, limit, screen, variant, screened):
    from pipeline.commands.variant_job import screen as screen_verdict
    from tests.conftest import compose

    cfg = compose([f"variant={variant}", f"decision.max_kld_mean={'null' if limit is None else limit}",
                   f"decision.screen={str(screen).lower()}"])
    verdict = screen_verdict(cfg, _teacher_forced(tmp_path, klds))
    assert (verdict is not None) == screened, verdict
    if screened:
        assert verdict["kld_mean"]["low"] > limit and verdict["limit"] == limit
        assert "lies wholly above decision.max_kld_mean=0.1" in verdict["reason"]


@pytest.mark.slow
def test_a_screened_variant_is_scored_then_stops_and_the_decision_names_its_kld(tiny_cfg):
    """With a KLD limit every quantized file exceeds, the quantized variants are scored and stop there: no
    free-running stage, no speed trial, listed with their figure in the report; the original is measured in full."""
    variants = ["original", "gguf_q4_0"]
    common = ["run.suites=[long_output]", "profile.max_conversations=6", "load=off", "decision.max_kld_mean=0.0"]
    cfg = tiny_cfg("command=compare", f"run.variants=[{','.join(variants)}]", *common)
    run(cfg)
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    q4 = summary["variants"]["gguf_q4_0"]
    assert q4["status"] == "ok" and q4["screened"]["kld_mean"]["low"] > 0, q4.get("screened")
    assert q4["drift"]["kld_mean"] > 0 and q4["free_running"]["replies"] == 0
    assert q4["speed"]["decode_tokens_per_s"] is None and q4["speed_trials"]["rounds"] == 0
    assert not (cfg.model_dir / "runs" / cfg.run.name / "gguf_q4_0").exists(), "free-running ran"
    orig = summary["variants"]["original"]
    assert "screened" not in orig and orig["free_running"]["replies"] > 0 and orig["speed"]["decode_tokens_per_s"]
    assert summary["recommendation"]["reasons"]["gguf_q4_0"].startswith("fails constraint: mean KLD")
    md = (cfg.results_dir / "report.md").read_text()
    assert "Screened out after their teacher-forced scoring" in md and "`gguf_q4_0`: mean KLD" in md
