"""Paired statistics, the Pareto front and the decision, on hand-made numbers."""

import numpy as np
import pytest

from pipeline.decide.variant_summary import degenerate, free_running_figures
from pipeline.decide.recommendation import decide
from pipeline.config.commands import DecisionConfig
from pipeline.decide.recommendation import dominator, pareto_front
from pipeline.figures.stats import bootstrap_ratio, conversation_intervals


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
    # no trials here: the medians compare, and the reason says so with the numbers
    assert "decode tok/s: 60.0 tok/s against fast's 80.0 tok/s: 0.75×, no paired trials" in rec["reasons"]["slow_same"]
    assert rec["reasons"]["drifty"].startswith("fails constraint: mean KLD 0.3000 > 0.1")
    assert rec["reasons"]["broken"].startswith("failed: RuntimeError")
    assert rec["summary"].startswith("decode tok/s decided: 80.0 tok/s against the runner-up slow_same's 60.0 tok/s")
    assert rec["decided_by"]["figure"] == "decode tok/s" and rec["decided_by"]["runner_up"] == "slow_same"
    assert set(rec["pareto_front"]) == {"original", "fast", "drifty"}
    none = decide(variants, DecisionConfig(max_kld_mean=0.001, min_decode_tokens_per_s=50))
    assert none["variant"] is None and none["closest"] == "original" and "decode 20.0 tok/s < 50" in none["summary"]
    mem = decide(variants, DecisionConfig(objective="memory", max_kld_mean=0.5))
    assert mem["variant"] == "drifty"


@pytest.mark.parametrize("objective, loser_says", [
    ("decode_speed", "decode tok/s: 20.0 tok/s against fast's 80.0 tok/s: 0.25×"),
    ("memory", "memory as served: 900 MB against fast's 200 MB: 4.50×"),
    ("size", "artifact size: 858.3 MiB against fast's 190.7 MiB: 4.50×"),
])
def test_a_loser_on_the_objective_is_described_in_that_objective_s_direction(objective, loser_says):
    """The loser's figure against the best's, whichever way is better (for memory and size the loser's is HIGHER)."""
    variants = {"original": _variant(0.0, 20, 900), "fast": _variant(0.04, 80, 200)}
    rec = decide(variants, DecisionConfig(objective=objective, max_kld_mean=0.1))
    assert rec["variant"] == "fast"
    assert loser_says in rec["reasons"]["original"], rec["reasons"]["original"]


@pytest.mark.parametrize("preset", ["default", "latency", "memory"])
def test_decision_presets_compose(preset):
    from tests.conftest import compose

    d = compose([f"decision={preset}"]).decision
    assert d.name == preset and np.isfinite(d.max_kld_mean)


# ------------------------------------------------------------------ intervals, not noise (issue 12)

from pipeline.figures.stats import median_interval, minimum_detectable, paired_ratio, sign_flip_p  # noqa: E402


def test_sign_flip_test_is_exact_and_symmetric():
    assert sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)          # all six the same sign: the two extreme patterns
    assert sign_flip_p([1.0] * 5) == pytest.approx(2 / 32)          # five rounds can never reach 5 %
    assert sign_flip_p([1.0, -1.0, 1.0, -1.0]) == 1.0
    assert sign_flip_p([0.0, 0.0]) == 1.0 and sign_flip_p([]) is None
    big = sign_flip_p(np.linspace(0.1, 2.0, 30))                    # sampled patterns beyond 16 units
    assert big < 0.001
    assert sign_flip_p([0.3, -0.2, 0.5]) == sign_flip_p([-0.3, 0.2, -0.5])


def test_median_interval_has_the_stated_coverage():
    iv = median_interval([5, 1, 4, 2, 3, 6])
    assert iv["estimate"] == 3.5 and (iv["low"], iv["high"]) == (1, 6) and iv["level"] == pytest.approx(62 / 64)
    iv = median_interval(range(1, 21))          # n=20: (x_6, x_15) holds 95.9 %
    assert (iv["low"], iv["high"]) == (6, 15) and iv["level"] >= 0.95
    assert median_interval([]) is None


def test_paired_ratio_over_rounds():
    a = [100, 104, 98, 101, 99, 103]
    t = paired_ratio([x * 1.2 for x in a], a)
    assert t["ratio"] == pytest.approx(1.2) and t["p"] == pytest.approx(2 / 64) and t["rounds"] == 6
    noise = paired_ratio([100, 97, 103, 99, 104, 96], a)
    assert noise["p"] > 0.05 and noise["low"] < 1 < noise["high"]


def _with(v, **intervals):
    v["intervals"] = {k: {"estimate": e, "low": lo, "high": hi} for k, (e, lo, hi) in intervals.items()}
    return v


def test_upper_confidence_leaves_a_straddling_variant_undecided():
    variants = {"original": _variant(0.0, 20, 900),
                "straddles": _with(_variant(0.08, 90, 200), kld_mean=(0.08, 0.05, 0.12)),
                "clear": _with(_variant(0.03, 60, 300), kld_mean=(0.03, 0.02, 0.04)),
                "over": _with(_variant(0.2, 99, 100), kld_mean=(0.2, 0.15, 0.3))}
    rec = decide(variants, DecisionConfig(max_kld_mean=0.1))
    assert rec["variant"] == "clear" and rec["undecided"] == ["straddles"]
    assert rec["reasons"]["straddles"].startswith("undecided: mean KLD 0.0800 [0.0500, 0.1200]")
    assert "straddles the limit" in rec["reasons"]["straddles"]
    assert rec["reasons"]["over"].startswith("fails constraint: mean KLD 0.2000 [0.1500, 0.3000] > 0.1000")
    point = decide(variants, DecisionConfig(max_kld_mean=0.1, confidence="point"))
    assert point["variant"] == "straddles" and point["undecided"] == []
    only = decide({"straddles": variants["straddles"]}, DecisionConfig(max_kld_mean=0.1))
    assert only["variant"] is None and "1 undecided: straddles" in only["summary"]


def test_pass_rate_ratio_not_measurable_is_reported_not_dropped():
    v = _with(_variant(0.01, 50, 100), pass_rate_ratio=(0.5, 0.2, 0.9))
    rec = decide({"a": v}, DecisionConfig(min_pass_rate_ratio=0.95))
    assert rec["variant"] is None and "pass rate 50% [20%, 90%] of the original's < 95%" in rec["reasons"]["a"]
    blind = _variant(0.01, 50, 100)
    blind["intervals"] = {}                      # the original passes no check: no ratio
    rec = decide({"a": blind}, DecisionConfig(min_pass_rate_ratio=0.95))
    assert rec["variant"] == "a" and "not measurable" in rec["summary"]
    assert rec["not_measurable"]["a"] == ["pass-rate ratio not measurable: the original passes none of the checks"]


def _trials(v, values, figure="decode_tokens_per_s"):
    v.setdefault("speed_trials", {"values": {}})["values"][figure] = values
    return v


BASE = [100, 130, 90, 120, 95, 125, 105, 115, 98, 128]


def test_speed_ties_are_decided_by_the_paired_test_over_trials_after_the_family_wise_correction():
    variants = {"a": _trials(_variant(0.05, 110, 200), BASE),
                "noisy_faster": _trials(_variant(0.01, 114, 200), [x * f for x, f in zip(
                    BASE, (1.3, 0.85, 1.25, 0.85, 1.2, 0.95, 1.3, 0.8, 1.2, 0.9))]),
                "slower": _trials(_variant(0.0, 80, 200), [x * 0.7 for x in BASE])}
    rec = decide(variants, DecisionConfig(tie_tolerance=0.0))
    step = rec["steps"][0]
    # 'noisy_faster' leads on the median; 'a' is not significantly different: a tie, decided by the next steps
    assert step["lead"] == "noisy_faster" and step["tied"] == ["noisy_faster", "a"] and step["behind"] == ["slower"]
    t = step["tests"]["slower"]
    assert t["p"] == pytest.approx(2 / 1024) and t["p_adjusted"] == pytest.approx(2 * 2 / 1024) and not t["tied"]
    assert "holm-adjusted p=0.004 < 0.05" in rec["reasons"]["slower"]
    assert rec["variant"] == "noisy_faster" and "drift" in [s["objective"] for s in rec["steps"]]
    assert "sign-flip p=" in rec["reasons"]["a"] and "ties noisy_faster's" in rec["reasons"]["a"]
    # six rounds: 2/64 per test, and Holm over the two comparisons leaves nothing significant: all tie on speed
    six = {n: _trials(_variant(v["drift"]["kld_mean"], v["speed"]["decode_tokens_per_s"], 200),
                      v["speed_trials"]["values"]["decode_tokens_per_s"][:6]) for n, v in variants.items()}
    rec6 = decide(six, DecisionConfig(tie_tolerance=0.0))
    assert rec6["steps"][0]["status"] == "cannot rank" and rec6["steps"][0]["tied"] == ["a", "noisy_faster", "slower"]
    assert "cannot rank with 6 rounds" in rec6["summary"] and "0.062 after the holm correction" in rec6["summary"]
    assert rec6["variant"] is None and rec6["closest"] == "slower"    # no answer on speed; the highest fidelity named
    assert "at least 7 rounds are needed" in rec6["summary"]
    none = decide(six, DecisionConfig(tie_tolerance=0.0, multiple_comparisons="none"))
    assert none["steps"][0]["behind"] == ["slower"]


def test_a_difference_inside_the_aa_floor_is_a_tie_and_a_noisy_aa_pair_widens_the_floor():
    variants = {"best": _trials(_variant(0.05, 110, 200), BASE),
                "close": _trials(_variant(0.01, 104, 200), [x * 0.94 for x in BASE]),
                "far": _trials(_variant(0.02, 80, 200), [x * 0.7 for x in BASE])}
    quiet = {"control": "best", "figures": {"decode_tokens_per_s": {"ratio": 1.02, "low": 0.9, "high": 1.1,
                                                                      "rounds": 10, "p": 0.6, "tied": True,
                                                                      "floor": 0.1}}}
    rec = decide(variants, DecisionConfig(tie_tolerance=0.0), quiet)
    step = rec["steps"][0]
    # 'close' is 6 % slower in every round (p far under alpha) but inside the run's ±10 % A/A floor: a tie
    assert step["tests"]["close"]["p_adjusted"] < 0.05 and step["tied"] == ["best", "close"]
    assert step["behind"] == ["far"] and "outside the noise floor ±10%" in rec["reasons"]["far"]
    assert rec["variant"] == "close"
    assert rec["decided_by"]["figure"] == "mean KLD" and "decode tok/s ties the step's best, best's (" in rec["summary"]
    assert "inside the noise floor ±10%" in rec["summary"]
    # a noisy A/A pair widens the floor; it never stops the ranking: 'far' (0.7x) is still behind
    loud = {"control": "best", "figures": {"decode_tokens_per_s": {**quiet["figures"]["decode_tokens_per_s"],
                                                                     "p": 0.002, "tied": False, "ratio": 0.8,
                                                                     "floor": 0.2}}}
    rec = decide(variants, DecisionConfig(tie_tolerance=0.0), loud)
    assert rec["steps"][0]["status"] == "ranked" and rec["steps"][0]["behind"] == ["far"]
    assert rec["variant"] == "close" and "outside the noise floor ±20%" in rec["reasons"]["far"]


def test_the_checks_are_judged_for_non_inferiority_on_their_interval():
    def losing(est, lo, hi):
        return _with(_variant(0.01, 50, 100), pass_rate_delta=(est, lo, hi))

    rec = decide({"clear": losing(-0.01, -0.04, 0.02), "straddles": losing(-0.04, -0.08, -0.01),
                  "loses": losing(-0.12, -0.18, -0.07)}, DecisionConfig())
    assert rec["variant"] == "clear" and rec["undecided"] == ["straddles"]
    assert rec["reasons"]["loses"].startswith("fails constraint: pass-rate change against the original -12.0% "
                                              "[-18.0%, -7.0%]") and "< -5%" in rec["reasons"]["loses"]
    assert "straddles the margin -5%" in rec["reasons"]["straddles"]
    assert decide({"a": losing(-0.12, -0.18, -0.07)}, DecisionConfig(max_pass_drop=None))["variant"] == "a"


def test_minimum_detectable_effect_shrinks_with_more_conversations():
    def run(n):
        samples = [_sample("s", f"c{i}", [i % 2 == 0, True], [True, True]) for i in range(n)]
        tf = {"s": {f"c{i}": {"kld": [0.01 * (1 + i % 3)] * 4} for i in range(n)}}
        return minimum_detectable(samples, tf)["s"]

    few, many = run(4), run(16)
    assert few["conversations"] == 4 and few["reference_pass_rate"] == pytest.approx(0.75)
    assert 0 < many["mde_pass_rate"] < few["mde_pass_rate"] <= 1
    assert 1 < many["mde_kld_ratio"] < few["mde_kld_ratio"]
    assert not few["no_signal_for_flips"]
    blind = [_sample("s", f"c{i}", [False, i == 0], [True, True]) for i in range(8)]     # the original passes 1 in 16
    assert minimum_detectable(blind, {})["s"]["no_signal_for_flips"]


def test_a_format_on_no_native_kernel_is_not_ranked_on_speed_and_its_drift_still_counts():
    fast_dense = _variant(0.01, 500, 100)
    fast_dense["no_native_kernel"] = "no native kernel on this device: torch.nn.Linear (float32), dequantized at load"
    variants = {"q8": _variant(0.02, 80, 200), "awq": fast_dense, "drifty": _variant(0.5, 90, 150)}
    rec = decide(variants, DecisionConfig(max_kld_mean=0.1))
    assert rec["variant"] == "q8"
    assert rec["reasons"]["awq"].startswith("meets every constraint, but no native kernel on this device")
    assert "not ranked on decode tok/s" in rec["reasons"]["awq"] and "awq" not in rec["pareto_front"]
    rec = decide({"awq": fast_dense, "drifty": variants["drifty"]}, DecisionConfig(max_kld_mean=0.1))
    assert rec["variant"] is None or rec["variant"] != "awq"
    assert decide({"awq": fast_dense}, DecisionConfig(max_kld_mean=0.001))["reasons"]["awq"].startswith(
        "fails constraint: mean KLD")          # its drift is judged like any other variant's


def test_a_loss_beyond_the_margin_fails_however_many_variants_ran():
    """(d) the loss is judged on the variant's own interval: nine other variants do not dilute it (a Holm-adjusted
    p once excused p=0.0096 as 0.077)."""
    def dropping(lo, hi, p_value):
        v = _with(_variant(0.01, 50, 100), pass_rate_delta=((lo + hi) / 2, lo, hi))
        v["free_running"] = {"conversation_test": {"conversations": 16, "mean_difference": (lo + hi) / 2,
                                                   "p": p_value}}
        return v

    alone = decide({"v0": dropping(-0.14, -0.06, 0.0096)}, DecisionConfig())
    many = decide({"v0": dropping(-0.14, -0.06, 0.0096),
                   **{f"v{i}": dropping(-0.02, 0.02, 0.9) for i in range(1, 10)}}, DecisionConfig())
    for rec in (alone, many):
        assert rec["pass_drop"]["v0"]["verdict"] == "fails" and rec["reasons"]["v0"].startswith("fails constraint")
    assert many["variant"] != "v0"


def test_the_conversation_interval_holds_its_level_at_sixteen_conversations():
    """16 conversations in two suites, per-conversation mean KLD lognormal (sigma 0.6), 100-500 tokens each: the
    t interval of the ratio estimator covers the true mean near its stated 95 %; the percentile bootstrap over the
    same units covers less (anti-conservative at this size)."""
    from pipeline.figures.stats import ratio_t_interval

    rng = np.random.default_rng(7)
    truth = 0.03 * np.exp(0.6 ** 2 / 2)
    hits_t = hits_boot = 0
    runs = 300
    for k in range(runs):
        tokens = rng.integers(100, 500, size=16)
        sums = np.exp(rng.normal(np.log(0.03), 0.6, size=16)) * tokens
        strata = ["a"] * 8 + ["b"] * 8
        t = ratio_t_interval(sums, tokens, strata=strata)
        b = bootstrap_ratio(sums, tokens, seed=k, replicates=500, strata=strata)
        hits_t += t["low"] <= truth <= t["high"]
        hits_boot += b["low"] <= truth <= b["high"]
    assert hits_t / runs >= 0.88 and hits_t > hits_boot + 3, (hits_t, hits_boot)
    two = ratio_t_interval([[1.0, 2.0], [3.0, 1.0], [2.0, 2.0]], [10, 10, 10])
    assert two["estimate"] == pytest.approx([0.2, 5 / 30]) and two["low"][0] < 0.2 < two["high"][0]
    assert ratio_t_interval([0.5, 0.5], [1, 1], bounds=(0, 1))["low"] == pytest.approx(0.5)
