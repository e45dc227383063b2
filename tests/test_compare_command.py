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
def test_a_report_of_a_run_without_its_speed_trials_names_the_stage_instead_of_measuring(tiny_cfg, monkeypatch):
    assert run(tiny_cfg("variant=gguf_q8_0")) == 0
    _no_measuring(monkeypatch)
    cfg = tiny_cfg("command=report", "run.variants=[gguf_q8_0]")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["stages_missing"] == {"speed": "the speed trials have not run for this run's variants"}
    assert summary["variants"]["gguf_q8_0"]["drift"]["kld_mean"] > 0
    md = (cfg.results_dir / "report.md").read_text()
    assert "Not in this report: speed (the speed trials have not run for this run's variants)" in md
