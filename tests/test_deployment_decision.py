"""The recommendation a deployment engineer would sign, on hand-made summaries: a broken variant never passes, ties
go to quality, a budget or too few rounds is named in the headline, a loss is judged per variant, and memory is
judged at the workload's context."""

import math

import pytest

from pipeline.config.commands import DecisionConfig, WorkloadConfig
from pipeline.decide.recommendation import decide
from pipeline.decide.target import at_target, make_target

ROUNDS = [100, 130, 90, 120, 95, 125, 105, 115, 98, 128]
CONVERSATIONS = [f"s/c{i}" for i in range(16)]
HOST = {"memory_gib": 23.5}


def variant(kld, decode, *, rounds=ROUNDS, scale=1.0, weights_mb=100.0, runtime_mb=80.0, kv_per_token=23040.0,
            prefill=500.0, spread=0.2):
    """An evaluated variant: decode trials (``rounds`` × ``scale``), per-conversation KLDs around ``kld``
    (± ``spread``), a probe that held 320 tokens of KV, and the pass-rate change of a clean variant."""
    klds = {c: kld * (1 + spread * ((i % 5) - 2) / 2) for i, c in enumerate(CONVERSATIONS)}
    probe_kv = kv_per_token * 320
    return {"status": "ok", "runtime": "llamacpp",
            "drift": {"kld_mean": kld, "kld_p99": kld * 8, "top1_agreement": 0.95, "flip_rate": 0.05,
                      "pass_rate": 0.5},
            "drift_detail": {"kld_by_conversation": {c: [k * 100, 100] for c, k in klds.items()}},
            "intervals": {"kld_mean": {"estimate": kld, "low": kld * 0.85, "high": kld * 1.15},
                          "pass_rate_delta": {"estimate": 0.0, "low": -0.03, "high": 0.03, "units": 16}},
            "speed": {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill, "itl_p99_s": 0.02,
                      "prompt_tokens": 256, "decode_tokens": 64},
            "speed_trials": {"values": {"decode_tokens_per_s": [x * scale for x in rounds]}},
            "memory": {"artifact_bytes": weights_mb * 2**20, "kv_bytes_per_token": kv_per_token,
                       "peak_rss_mb": weights_mb + runtime_mb + probe_kv / 2**20},
            "free_running": {"replies": 60, "degenerate_replies": 3, "repeated_4gram_rate_mean": 0.1}}


QUIET = {"control": "q8", "figures": {"decode_tokens_per_s": {"ratio": 1.04, "low": 1.01, "high": 1.14, "rounds": 10,
                                                              "p": 0.03, "tied": False, "floor": 0.14}}}


def target(**workload):
    return make_target(WorkloadConfig(**workload), DecisionConfig(), 0.2, HOST)


def test_a_lower_drift_variant_tied_on_the_objective_ships():
    """(a) the committed default run's case: Q4_K_M and Q8_0 decode within the A/A floor; Q8_0 drifts 20x less."""
    variants = {"q8": variant(0.0023, 88.9, scale=1.0, weights_mb=140),
                "q4": variant(0.0477, 85.8, scale=0.98, weights_mb=105),
                "slow": variant(0.0, 12.8, scale=0.14, weights_mb=270)}
    rec = decide(variants, DecisionConfig(max_kld_mean=0.1), QUIET, target())
    assert rec["variant"] == "q8"
    assert rec["decided_by"]["figure"] == "mean KLD" and rec["decided_by"]["runner_up"] == "q4"
    assert not rec["decided_by"]["tied"]
    assert "decode tok/s ties q4 (85.8 tok/s against q8's 88.9 tok/s: 0.98×" in rec["summary"]
    assert "inside the noise floor ±14%" in rec["summary"]
    assert "mean KLD decided: mean KLD 0.0023 against the runner-up q4's mean KLD 0.0477" in rec["summary"]
    assert rec["reasons"]["slow"].startswith("meets every constraint; decode tok/s: 12.8 tok/s against q8's")
    assert "paired over 16 conversations" in rec["reasons"]["q4"]
    # a noisy A/A pair never stops the ranking: 7x apart still ranks
    assert rec["steps"][0]["status"] == "ranked" and rec["steps"][0]["behind"] == ["slow"]


def test_variants_that_nothing_separates_go_to_the_higher_fidelity_one_and_the_headline_says_so():
    variants = {"a": variant(0.0480, 88.0, spread=1.5), "b": variant(0.0477, 87.0, scale=0.99, spread=1.5)}
    rec = decide(variants, DecisionConfig(), QUIET, target())
    assert rec["variant"] == "b" and rec["decided_by"]["tied"]
    assert "nothing separates them" in rec["summary"] and "higher fidelity" in rec["summary"]


def test_a_binding_budget_ships_the_smaller_variant_and_the_headline_names_it():
    """(b) a 1 GB budget: at 8 sequences of 2,048 tokens the 500 MB variant does not fit; the smaller one ships."""
    variants = {"q8": variant(0.002, 88.9, weights_mb=500), "q4": variant(0.05, 85.8, scale=0.98, weights_mb=120)}
    t = make_target(WorkloadConfig(concurrency=8), DecisionConfig(memory_budget_gb=1.0), 0.2, HOST)
    rec = decide(variants, DecisionConfig(memory_budget_gb=1.0), QUIET, t)
    assert rec["variant"] == "q4"
    assert rec["reasons"]["q8"].startswith("fails constraint: needs ") and \
        "decision.memory_budget_gb=1 less 20% headroom" in rec["reasons"]["q8"]
    assert "of 763 MB (decision.memory_budget_gb=1 less 20% headroom)" in rec["summary"]
    assert decide(variants, DecisionConfig(), QUIET, target(concurrency=8))["variant"] == "q8"   # the host's: fits


def test_rounds_that_cannot_reach_alpha_say_cannot_rank():
    """(c) with 3 rounds the smallest sign-flip p is 0.25: 7x apart is not a ranking, and the headline says so."""
    three = ROUNDS[:3]
    variants = {"orig": variant(0.0, 14.4, rounds=three, scale=0.14), "q4": variant(0.05, 102.2, rounds=three)}
    rec = decide(variants, DecisionConfig(), None, target())
    assert rec["steps"][0]["status"] == "cannot rank"
    assert "decode tok/s cannot rank with 3 rounds: the smallest sign-flip p over 3 rounds is 0.250" in rec["summary"]
    assert rec["variant"] is None           # the run cannot answer a speed objective: no "Ship" on 3 rounds
    assert "at least 6 rounds are needed" in rec["summary"] and "the highest fidelity is orig" in rec["summary"]


def test_memory_at_the_workload_context_reverses_a_short_context_order():
    """(e) at the probe's 320 tokens the f16-KV variant is smaller; at 4 sequences of 4,096 tokens its cache is
    not: the q8_0-KV variant needs less memory as served."""
    small_weights = variant(0.05, 90, weights_mb=100, kv_per_token=46080)
    small_kv = variant(0.05, 90, weights_mb=140, kv_per_token=12240)
    assert small_weights["memory"]["peak_rss_mb"] < small_kv["memory"]["peak_rss_mb"]
    t = target(context_tokens=4096, concurrency=4)
    assert at_target(small_weights, t)["served_mb"] > at_target(small_kv, t)["served_mb"]
    rec = decide({"f16kv": small_weights, "q8kv": small_kv}, DecisionConfig(objective="memory"), QUIET, t)
    assert rec["variant"] == "q8kv" and rec["decided_by"]["figure"] == "memory as served"
    short = decide({"f16kv": small_weights, "q8kv": small_kv}, DecisionConfig(objective="memory"), QUIET,
                   target(context_tokens=320, concurrency=1))
    assert short["variant"] == "f16kv"
    cap = decide({"f16kv": small_weights, "q8kv": small_kv}, DecisionConfig(objective="capacity"), QUIET, t)
    assert cap["variant"] == "q8kv" and cap["at_target"]["q8kv"]["sequences"] > cap["at_target"]["f16kv"]["sequences"]


def test_a_variant_with_a_nan_figure_or_degenerate_replies_never_passes():
    broken = variant(float("nan"), 30.0)
    broken["runtime_info"] = {"dtype": "float16"}
    looping = variant(0.05, 80)
    looping["free_running"] = {"replies": 14, "degenerate_replies": 13, "repeated_4gram_rate_mean": 0.86}
    rec = decide({"broken": broken, "looping": looping, "ok": variant(0.06, 50)}, DecisionConfig(max_kld_mean=0.1),
                 QUIET, target())
    assert rec["variant"] == "ok"
    assert rec["reasons"]["broken"].startswith("fails constraint: mean KLD is nan (not a number): computed in "
                                               "float16")
    assert "13 of 14 replies degenerate" in rec["reasons"]["looping"]
    alone = decide({"broken": broken}, DecisionConfig(max_kld_mean=0.1), QUIET, target())
    assert alone["variant"] is None and alone["summary"].startswith("no variant meets every constraint")
    assert "mean KLD is nan" in alone["summary"]
    rate_only = variant(0.05, 80)
    rate_only["free_running"] = {"replies": 60, "degenerate_replies": 3, "repeated_4gram_rate_mean": 0.5}
    assert "mean repeated-4-gram rate of its replies 0.50 > 0.35" in decide(
        {"r": rate_only}, DecisionConfig(), QUIET, target())["reasons"]["r"]


def test_latency_targets_are_stated_and_enforced_where_asked():
    variants = {"fast": variant(0.05, 90, prefill=4000), "slow": variant(0.01, 80, scale=0.9, prefill=500)}
    reported = decide(variants, DecisionConfig(), QUIET, target())
    assert reported["variant"] == "slow"            # tied on decode within ±14 %; lower drift
    assert "1 of 2 eligible variants meet workload chat's time to first token ≤ 1 s" in reported["summary"]
    t = make_target(WorkloadConfig(), DecisionConfig(latency_targets="enforce"), 0.2, HOST)
    enforced = decide(variants, DecisionConfig(latency_targets="enforce"), QUIET, t)
    assert enforced["variant"] == "fast"
    assert "time to first token at 2,048 tokens 4.10 s (estimated from the probe's prefill rate) > 1 s" in \
        enforced["reasons"]["slow"]
    assert math.isclose(enforced["at_target"]["slow"]["ttft_s"], 2048 / 500)


@pytest.mark.parametrize("key, value", [("max_pass_drop", 1.5), ("latency_targets", "sometimes"),
                                        ("memory_budget_gb", -1), ("objective", "vibes")])
def test_bad_decision_settings_name_the_key(key, value):
    from pipeline.infra.errors import ConfigError

    with pytest.raises(ConfigError, match=f"decision.{key}"):
        DecisionConfig(**{key: value})


def test_redecide_takes_the_decision_again_from_a_finished_run_and_measures_nothing(tmp_path, monkeypatch):
    """The committed default run decided again under another preset and workload: the summary's recommendation,
    report.md and report.html follow; the per-sample viewer of the report as rendered is kept; no stage runs."""
    import dataclasses
    import json
    import shutil

    import pipeline.stages.speed as speed
    from pipeline.config.schema import PROJECT_ROOT
    from pipeline.cli import run as cli_run
    from tests.conftest import compose

    def redecide_report(cfg):
        assert cli_run(dataclasses.replace(cfg, command="redecide")) == 0
        return json.loads((cfg.results_dir / "summary.json").read_text())

    def no_measuring(*a, **k):
        raise AssertionError("redecide measured something")

    monkeypatch.setattr(speed, "measure_speed", no_measuring)
    run = tmp_path / "results" / "smollm2-135m-instruct" / "quick"
    shutil.copytree(PROJECT_ROOT / "results" / "smollm2-135m-instruct" / "quick", run)
    cfg = compose(["profile=quick", f"paths.results={tmp_path / 'results'}", "decision=memory",
                   "workload=batch", "decision.memory_budget_gb=0.6", "decision.max_pass_drop=0.15"])
    summary = redecide_report(cfg)
    rec = summary["recommendation"]
    assert rec["objective"] == "memory" and rec["target"]["workload"] == "batch" and rec["target"]["concurrency"] == 8
    assert json.loads((run / "summary.json").read_text())["recommendation"] == rec
    md = (run / "report.md").read_text()
    assert f"**Ship `{rec['variant']}`**" in md and "workload batch: 2,048 tokens of context × 8" in md
    # 8 sequences of 2,048 tokens in 0.6 GB less headroom: the q8_0 KV cache is what makes Q8_0 fit
    assert rec["variant"] == "gguf_q8_0+kv_q8_0"
    assert rec["reasons"]["gguf_q8_0"].startswith("fails constraint: needs 584 MB as served")
    assert "<section id='samples'>" in (run / "report.html").read_text()
    missing = compose(["profile=quick", f"paths.results={tmp_path / 'nothing'}"])
    from pipeline.infra.errors import ConfigError

    with pytest.raises(ConfigError, match="no summary.json"):
        redecide_report(missing)


def test_an_interleaved_sliding_window_model_is_served_with_window_sized_local_layers():
    """Gemma 2's layout (13 global layers, 13 local layers of a 4,096-token window): at 8,192 tokens the local
    layers keep half of what the recorded per-token figure (at 4,096, inside the window) counts."""
    from transformers import Gemma2Config

    from pipeline.decide.target import kv_bytes_per_token_at
    from pipeline.figures.kv_layout import kv_layout

    cfg = Gemma2Config(num_hidden_layers=26, sliding_window=4096, num_key_value_heads=4, head_dim=256)
    facts = {"layers": 26, "kv_heads": 4, "head_dim": 256, "attention_heads": cfg.num_attention_heads,
             "kv_layout": kv_layout(cfg)}
    full = 2 * 26 * 4 * 256 * 2
    v = variant(0.01, 50, kv_per_token=full)
    t = make_target(WorkloadConfig(context_tokens=8192), DecisionConfig(), 0.2, HOST, facts, kv_context=4096)
    assert kv_bytes_per_token_at(v, t) == pytest.approx(full * (13 + 13 * 0.5) / 26)
    flat = make_target(WorkloadConfig(context_tokens=8192), DecisionConfig(), 0.2, HOST)
    assert at_target(v, t)["served_mb"] < at_target(v, flat)["served_mb"]


def test_a_figure_not_measured_or_not_a_number_never_passes_a_limit_or_the_target():
    """A NaN flip rate fails its limit; a variant without a mean KLD fails as not measured; one whose memory was
    not measured is not shown to fit (undecided); an enforced latency target on an unmeasured prefill rate is
    undecided; the original is never judged against its own looping replies."""
    nan_flips = variant(0.01, 80)
    nan_flips["drift"]["flip_rate"] = float("nan")
    no_kld = variant(0.01, 80)
    no_kld["drift"]["kld_mean"] = None
    no_memory = variant(0.01, 80)
    no_memory["memory"]["peak_rss_mb"] = None
    rec = decide({"nan_flips": nan_flips, "no_kld": no_kld, "no_memory": no_memory, "ok": variant(0.02, 70)},
                 DecisionConfig(max_flip_rate=0.25), QUIET, target())
    assert rec["variant"] == "ok"
    assert rec["reasons"]["nan_flips"].startswith("fails constraint: flip rate nan (not a number)")
    assert rec["reasons"]["no_kld"].startswith("fails constraint: mean KLD not measured")
    assert rec["reasons"]["no_memory"].startswith("undecided: memory as served") and "not measured" in \
        rec["reasons"]["no_memory"]
    no_prefill = variant(0.01, 80)
    no_prefill["speed"]["prefill_tokens_per_s"] = None
    enforced = make_target(WorkloadConfig(), DecisionConfig(latency_targets="enforce"), 0.2, HOST)
    out = decide({"p": no_prefill}, DecisionConfig(latency_targets="enforce"), QUIET, enforced)
    assert out["variant"] is None and "time to first token not measured" in out["reasons"]["p"]
    assert out["at_target"]["p"]["meets_latency"] is None
    looping = variant(0.0, 20)
    looping["free_running"] = {"replies": 60, "degenerate_replies": 12, "repeated_4gram_rate_mean": 0.1}
    assert decide({"original": looping}, DecisionConfig(), QUIET, target())["variant"] == "original"


def test_a_pick_that_alone_was_ranked_does_not_claim_to_be_the_only_one_meeting_the_constraints():
    dense = variant(0.001, 500)
    dense["no_native_kernel"] = "no native kernel on this device: torch.nn.Linear (float32), dequantized at load"
    rec = decide({"q8": variant(0.01, 80), "awq": dense}, DecisionConfig(), QUIET, target())
    assert rec["variant"] == "q8" and "the only variant ranked on decode tok/s" in rec["summary"]
    assert "1 other(s) meet every constraint but were not ranked: awq" in rec["summary"]
    zero = decide({"a": variant(0.01, 0.0, rounds=[]), "b": variant(0.02, 10.0, rounds=[])}, DecisionConfig(), QUIET,
                  target())
    assert zero["variant"] == "b"               # a lead of 0 tok/s is not a division by zero


def test_one_unit_per_stratum_leaves_no_degrees_of_freedom_and_no_point_interval():
    from pipeline.figures.stats import ratio_t_interval

    alone = ratio_t_interval([1.0, 2.0, 3.0, 4.0], [10, 10, 10, 10], strata=["a", "b", "c", "d"])
    assert alone["low"] < alone["estimate"] < alone["high"]                 # singletons pooled: df 3
    one = ratio_t_interval([1.0], [10])
    assert one["low"] == -math.inf and one["high"] == math.inf
