"""Paired statistics, the Pareto front and the decision, on hand-made numbers."""

import numpy as np
import pytest

from pipeline.aggregate import degenerate, free_running_figures
from pipeline.decision import decide
from pipeline.config import DecisionConfig
from pipeline.decision import dominator, pareto_front
from pipeline.stats import bootstrap_ratio, conversation_intervals


def test_bootstrap_resamples_conversations_deterministically():
    num, den = [1.0, 2.0, 3.0, 10.0], [10, 10, 10, 10]
    a = bootstrap_ratio(num, den, seed=1)
    assert a == bootstrap_ratio(num, den, seed=1)
    assert a["estimate"] == pytest.approx(16 / 40)
    assert a["low"] < a["estimate"] < a["high"] and a["units"] == 4
    same = bootstrap_ratio([2.0] * 5, [4] * 5)
    assert same["low"] == same["high"] == pytest.approx(0.5)          # no spread between conversations
    assert bootstrap_ratio([], []) is None


def _sample(suite, conv, ref, var, rep=0.0, loop=0):
    return {"suite": suite, "conversation": conv, "checks_reference": ref, "checks_variant": var,
            "repeated_4gram_rate": rep, "longest_loop_tokens": loop, "chrf": 50.0, "length_ratio": 1.0,
            "first_divergence": 3}


def test_intervals_flips_and_degeneration():
    tf = {"s": {"a": {"kld": [0.1, 0.3], "top1": [1, 0], "nll_variant": [1.0, 2.0], "nll_reference": [1.0, 1.0]},
                "b": {"kld": [0.0, 0.0], "top1": [1, 1], "nll_variant": [1.0, 1.0], "nll_reference": [1.0, 1.0]}}}
    samples = [_sample("s", "a", [True, True], [False, True], rep=0.5), _sample("s", "b", [False], [True], loop=40),
               _sample("t", "c", [True], [True])]
    iv = conversation_intervals(tf, samples)
    assert iv["kld_mean"]["estimate"] == pytest.approx(0.1)
    assert iv["top1_agreement"]["estimate"] == pytest.approx(0.75)
    assert iv["delta_nll"]["estimate"] == pytest.approx(0.25)
    assert iv["pass_rate"]["estimate"] == pytest.approx(3 / 4)
    assert iv["pass_rate_delta"]["estimate"] == pytest.approx(0.0)
    assert iv["flip_rate"]["estimate"] == pytest.approx(2 / 4)
    limits = {"max_repeated_4gram_rate": 0.35, "max_loop_tokens": 32}
    assert [degenerate(s, limits) for s in samples] == [True, True, False]
    fr = free_running_figures(samples, limits)
    assert fr["degenerate_replies"] == 2
    assert fr["by_suite"]["s"]["pass_to_fail"] == 1 and fr["by_suite"]["s"]["fail_to_pass"] == 1
    assert fr["by_suite"]["s"]["mcnemar_p"] == pytest.approx(1.0) and fr["by_suite"]["t"]["checks"] == 1


def test_pareto_front_and_dominator():
    pts = {"a": (0.0, -10.0, 500.0), "b": (0.1, -20.0, 200.0), "c": (0.2, -15.0, 300.0), "d": (0.1, -20.0, 200.0)}
    assert pareto_front(pts) == ["a", "b", "d"]           # c is dominated by b (and d); b and d tie
    assert dominator("c", pts) in ("b", "d") and dominator("a", pts) is None


def _variant(kld, tps, rss, flip=0.0, p99=0.5, pass_rate=0.5):
    return {"status": "ok", "drift": {"kld_mean": kld, "kld_p99": p99, "flip_rate": flip, "pass_rate": pass_rate},
            "speed": {"decode_tokens_per_s": tps}, "memory": {"peak_rss_mb": rss, "artifact_bytes": rss * 1e6}}


def test_decide_explains_every_loser():
    variants = {"original": _variant(0.0, 20, 900), "fast": _variant(0.04, 80, 200),
                "slow_same": _variant(0.05, 60, 250), "drifty": _variant(0.3, 95, 150),
                "broken": {"status": "failed", "reason": "RuntimeError: boom"}}
    rec = decide(variants, DecisionConfig(max_kld_mean=0.1))
    assert rec["variant"] == "fast"
    assert "dominated by fast" in rec["reasons"]["slow_same"]
    assert rec["reasons"]["drifty"].startswith("fails constraint: mean KLD 0.3000 > 0.1")
    assert "Pareto front" in rec["reasons"]["original"]
    assert rec["reasons"]["broken"].startswith("failed: RuntimeError")
    assert set(rec["pareto_front"]) == {"original", "fast", "drifty"}
    none = decide(variants, DecisionConfig(max_kld_mean=0.001, min_decode_tokens_per_s=50))
    assert none["variant"] is None and none["closest"] == "original" and "decode 20.0 tok/s < 50" in none["summary"]
    mem = decide(variants, DecisionConfig(objective="memory", max_kld_mean=0.5))
    assert mem["variant"] == "drifty"


@pytest.mark.parametrize("objective, loser_says", [
    ("decode_speed", "its decode tok/s (20.0 tok/s) is lower than fast's (80.0 tok/s)"),
    ("memory", "its peak RSS (900 MB) is higher than fast's (200 MB)"),
    ("size", "its artifact size (858.3 MiB) is higher than fast's (190.7 MiB)"),
])
def test_a_loser_on_the_objective_is_described_in_that_objective_s_direction(objective, loser_says):
    """A Pareto-front variant that loses on the objective: for memory and size the loser's figure is HIGHER."""
    variants = {"original": _variant(0.0, 20, 900), "fast": _variant(0.04, 80, 200)}
    rec = decide(variants, DecisionConfig(objective=objective, max_kld_mean=0.1))
    assert rec["variant"] == "fast"
    assert loser_says in rec["reasons"]["original"], rec["reasons"]["original"]


@pytest.mark.parametrize("preset", ["default", "latency", "memory"])
def test_decision_presets_compose(preset):
    from tests.conftest import compose

    d = compose([f"decision={preset}"]).decision
    assert d.name == preset and np.isfinite(d.max_kld_mean)
