"""run.budget (pipeline.plan.budget): the profile's work is cut along the steps, in order, until the plan fits; the
least that carries a signal is refused with its planned time; the allocation reaches each variant's composed config
and is kept for a resumed run; the summary and the report say what was cut."""

from __future__ import annotations

import json

import pytest

from pipeline.config.schema import budget_seconds
from pipeline.infra.errors import ConfigError
from tests.conftest import compose

VARIANTS = "run.variants=[original,gguf_f16,gguf_q8_0,gguf_q4_k_m,gguf_q4_0,gptq_w4,awq_w4_llmc,original+kv_int8]"


@pytest.mark.parametrize("given,seconds", [("30m", 1800), ("2h", 7200), ("1800s", 1800), (45, 2700), ("1.5h", 5400),
                                           ("auto", "auto"), (None, None), ("", None), ("off", None)])
def test_a_budget_reads_as_seconds(given, seconds):
    assert budget_seconds(given) == seconds


@pytest.mark.parametrize("given", ["fast", "-5m", "30x", "0m", True])
def test_a_budget_that_is_no_duration_is_refused_naming_the_key(given):
    with pytest.raises(ConfigError, match=r"run\.budget.*a duration such as 30m"):
        budget_seconds(given)
    with pytest.raises(ConfigError, match=r"run\.budget"):
        compose([f"run.budget={str(given).lower()}"])


def _cost(cfg) -> tuple[float, int, str]:
    """A plan in which every reply token costs 0.01 s per variant (ten variants), a speed round 30 s, an extra
    speed minute 60 s, a load round 120 s (none with load=off)."""
    from pipeline.suites.records import load_suite, select

    tokens = 0
    for suite in cfg.selected_suites():
        convs = select(load_suite(suite.name, suite.path), *cfg.profile.limits(suite.name))
        tokens += sum(t.max_new_tokens or 0 for c in convs for t in c.turns)
    s = cfg.profile.speed
    extra = 60.0 * s.extra_max_minutes if s.extra_max_rounds else 0.0
    load = 120 * cfg.load.repeats if cfg.load.name != "off" else 0.0
    return 10 * 0.01 * tokens + 30 * s.trials + extra + load, 0, "a test's cost model"


def _quick():
    return compose(["profile=quick", VARIANTS])


def test_a_profile_inside_its_budget_runs_uncut():
    from pipeline.plan.budget import fit

    cfg = _quick()
    whole = _cost(cfg)[0]
    record = fit(cfg, whole + 1, _cost)
    assert record["allocation"] is None and record["steps"] == [] and record["planned_s"] == whole


def test_the_cuts_are_taken_in_order_and_stop_at_the_first_allocation_that_fits():
    from pipeline.plan.budget import Allocation, fit, profile_allocation, steps

    cfg = _quick()
    whole = _cost(cfg)[0]
    # past the gate-only cuts (extra rounds 600 -> 0 s, load rounds 360 -> 120 s), into the conversations
    budget = whole - 600 - 240 - 1
    record = fit(cfg, budget, _cost)
    names = [what for what, _ in steps(cfg, profile_allocation(cfg))]
    assert record["steps"] == names[:len(record["steps"])]
    assert record["steps"][:3] == ["extra llama.cpp speed rounds at most 5 min", "no extra speed rounds",
                                   "one load-sweep round"]
    assert len(record["steps"]) == 4          # six conversations per suite were enough
    a = record["allocation"]
    assert a["profile.speed.extra_max_rounds"] == 0 and a["load.repeats"] == 1
    assert {v["max_conversations"] for v in a["profile.per_suite"].values()} == {6}
    assert a["profile.per_suite"]["long_output"]["max_new_tokens_cap"] == 512      # the caps not reached yet
    assert a["profile.speed.trials"] == cfg.profile.speed.trials
    cut = Allocation(per_suite=a["profile.per_suite"], trials=a["profile.speed.trials"],
                     extra_max_rounds=0, extra_max_minutes=a["profile.speed.extra_max_minutes"], load_repeats=1)
    assert record["planned_s"] == _cost(cut.apply(cfg))[0] <= budget < record["profile_planned_s"] == whole


def test_a_budget_under_the_least_that_carries_a_signal_is_refused_with_that_allocations_time():
    from pipeline.plan.budget import MIN_CONVERSATIONS, fit

    cfg = _quick()
    with pytest.raises(ConfigError) as exc:
        fit(cfg, 60, _cost)
    msg = str(exc.value)
    assert "run.budget" in msg and "cannot be kept" in msg and "Nothing was computed" in msg
    assert f"{MIN_CONVERSATIONS} conversations, replies capped at 256 tokens" in msg       # long_output: half of 512
    assert "9 speed rounds" in msg          # the fewest that rank 7 comparisons after Holm (2/2^9 x 7 < 0.05)
    assert "Raise the budget to at least" in msg


def test_the_overrides_give_a_composed_config_the_same_allocation_as_applying_it():
    from pipeline.plan.budget import fit, allocation_of

    cfg = _quick()
    record = fit(cfg, _cost(cfg)[0] * 0.5, _cost)
    a = allocation_of(record)
    applied = a.apply(cfg)
    composed = compose(["profile=quick", VARIANTS, *a.overrides()])
    for suite in ("long_output", "multi_turn"):
        assert composed.profile.limits(suite) == applied.profile.limits(suite) != cfg.profile.limits(suite)
    assert composed.profile.speed == applied.profile.speed
    assert composed.load.repeats == applied.load.repeats == 1


def test_a_resumed_run_keeps_its_first_allocation_and_a_new_budget_fits_again(tmp_path):
    from pipeline.plan.budget import fit_budget, read_budget

    cfg = compose(["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=20m"])
    calls = []

    def counted(c):
        calls.append(1)
        return _cost(c)

    first, overrides = fit_budget(cfg, counted)
    assert overrides and calls and first.profile.limits("long_output") != cfg.profile.limits("long_output")
    kept = read_budget(cfg)
    assert kept["budget"] == "20m" and kept["allocation"]
    calls.clear()
    again, overrides_again = fit_budget(cfg, counted)
    assert calls == [] and overrides_again == overrides and again.profile == first.profile
    wider = compose(["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=10h"])
    same, none = fit_budget(wider, counted)
    assert calls and none == [] and same is wider and read_budget(wider)["allocation"] is None
    off = compose(["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=off"])
    assert fit_budget(off, counted) == (off, []) and read_budget(off) is None


def test_compare_gives_every_variant_the_cut_allocation_and_the_report_says_what_was_cut(tiny_cfg, monkeypatch):
    import pipeline.commands.variant_job as variant_job
    import pipeline.plan.budget as budget
    from pipeline.cli import run
    from pipeline.report.sections import report_sections

    seen = []

    def job(cfg):
        seen.append((cfg.variant.name, cfg.profile.limits("smoke"), cfg.profile.speed.trials))
        return {"status": "skipped", "reason": "not run in this test"}

    monkeypatch.setattr(variant_job, "evaluate_job", job)
    monkeypatch.setattr(budget, "plan_seconds", lambda cfg: _cost)
    cfg = tiny_cfg("command=compare", "run.variants=[original,gguf_q8_0]", "load=off", "run.budget=4m",
                   "profile.max_conversations=4", "profile.max_new_tokens_cap=64", "profile.speed.trials=10")
    whole = _cost(cfg)[0]
    assert whole > 240
    assert run(cfg) == 0
    cut = budget.read_budget(cfg)
    assert cut["allocation"] and cut["planned_s"] <= 240 < cut["profile_planned_s"]
    limits = (cut["allocation"]["profile.per_suite"]["smoke"]["max_conversations"],
              cut["allocation"]["profile.per_suite"]["smoke"]["max_new_tokens_cap"])
    assert cut["allocation"]["profile.speed.trials"] == 6 < cfg.profile.speed.trials     # one comparison: 2/2^6 < 0.05
    assert seen == [(n, limits, cut["allocation"]["profile.speed.trials"]) for n in ("original", "gguf_q8_0")]
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["run"]["budget"] == cut
    assert summary["run"]["workload"]["per_suite"]["smoke"]["max_new_tokens_cap"] == limits[1]
    assert not any("load" in w or "extra" in w for w in cut["steps"])      # load=off; smoke has no extra rounds
    text = json.dumps(report_sections(summary))
    assert "Run budget 4m" in text and "; ".join(cut["steps"]) in text and "over the budget" in text
    assert "load-sweep" not in text and "extra llama.cpp" not in text         # load=off; smoke has no extra rounds


def test_a_budget_without_a_plan_is_refused_and_auto_runs_the_profile_uncut(tmp_path):
    """A hub model not downloaded yet has no shapes to plan from: a budget the user set cannot be kept (refused,
    naming the way out); auto runs the profile as it is."""
    from pipeline.plan.budget import NoTimeBasis, fit_budget, kept_allocation, read_budget

    base = ["model=local", "model.source=org/not-downloaded", "run.variants=[original]", f"paths.artifacts={tmp_path}"]
    with pytest.raises(NoTimeBasis, match=r"run\.budget=30m: the plan has no time.*BUDGET=off"):
        fit_budget(compose([*base, "run.budget=30m"]))
    auto = compose([*base, "run.budget=auto"])
    assert fit_budget(auto) == (auto, [])
    kept = read_budget(auto)          # kept as a fit that cut nothing: a resumed sitting stays uncut
    assert kept["allocation"] is None and "downloaded" in kept["no_time"]
    assert kept_allocation(auto) is auto
    assert fit_budget(auto, lambda c: pytest.fail("a kept fit is not planned again")) == (auto, [])


def test_a_plan_without_any_stage_time_is_no_basis_for_a_budget(tiny_cfg):
    from pipeline.plan.budget import NoTimeBasis, plan_seconds

    cfg = tiny_cfg("run.variants=[original,gguf_q8_0]", "run.budget=30m")       # an empty results folder
    with pytest.raises(NoTimeBasis, match="no measured run"):
        plan_seconds(cfg)(cfg)


def test_auto_is_three_hours_on_a_cpu_and_no_budget_on_a_gpu(monkeypatch):
    import pipeline.plan.estimate as estimate
    from pipeline.plan.budget import AUTO_CPU_S, resolved_budget

    cfg = compose(["run.budget=auto", VARIANTS])
    monkeypatch.setattr(estimate, "_on_device", lambda cfg: False)
    assert resolved_budget(cfg) == AUTO_CPU_S == 3 * 3600
    monkeypatch.setattr(estimate, "_on_device", lambda cfg: True)
    assert resolved_budget(cfg) is None


def test_nothing_left_to_cut_is_refused_without_a_cut_named():
    """The smoke profile is already below every step (2 conversations, 16-token replies, 2 rounds), and load=off."""
    from pipeline.plan.budget import fit

    cfg = compose(["profile=smoke", "load=off", VARIANTS])
    with pytest.raises(ConfigError, match="no step cuts it further"):
        fit(cfg, 1, _cost)


def test_a_resumed_run_with_other_settings_is_fitted_again(tmp_path):
    from pipeline.plan.budget import fit_budget

    base = ["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=20m"]
    first, _ = fit_budget(compose(base), _cost)
    fewer = compose([*base, "profile.max_conversations=2", "profile.speed.trials=20"])
    calls = []
    again, _ = fit_budget(fewer, lambda c: calls.append(1) or _cost(c))
    assert calls                                         # not the first sitting's allocation
    assert again.profile.limits("multi_turn")[0] == 2 and again.profile.limits("multi_turn") != first.profile.limits("multi_turn")


def test_make_plan_prints_the_cut_or_that_the_profile_fits(monkeypatch, tmp_path):
    import pipeline.plan.budget as budget

    monkeypatch.setattr(budget, "plan_seconds", lambda cfg: _cost)
    at = f"paths.artifacts={tmp_path}"
    cut = budget.fit_line(compose(["profile=quick", VARIANTS, "run.budget=20m", at]))
    assert cut.startswith("budget: run.budget=20m (20 min): the profile's work") and "will cut it (" in cut
    assert budget.fit_line(compose(["profile=quick", VARIANTS, "run.budget=10h", at])).endswith("fits uncut")
    assert budget.fit_line(compose(["profile=quick", VARIANTS, at])) is None


def test_the_comparison_after_a_plan_runs_the_allocation_the_plan_printed(monkeypatch, tmp_path):
    """The plan reads this machine's speed anew each time: the comparison started after it takes the plan's fit
    (or its refusal) for the same budget and inputs within the hour, and plans again otherwise."""
    import pipeline.plan.budget as budget

    base = ["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}"]
    monkeypatch.setattr(budget, "plan_seconds", lambda cfg: _cost)
    cfg = compose([*base, "run.budget=20m"])
    line = budget.fit_line(cfg)
    slower = []            # the same work read 30 % slower a minute later: it would cut further

    def slower_cost(c):
        slower.append(1)
        t, n, basis = _cost(c)
        return 1.3 * t, n, basis

    ran, overrides = budget.fit_budget(cfg, slower_cost)
    assert slower == [] and f"to {budget.read_budget(cfg)['described']}," in line
    assert budget.read_budget(cfg)["planned_by"].startswith("quantdrift plan")
    fresh = compose([*base, "run.budget=20m", "run.name=fresh"])
    assert budget.fit_budget(fresh, slower_cost)[1] != overrides and slower      # no plan for this run: fitted

    # a plan that refused: the comparison refuses as it did, naming the plan
    tight = compose([*base, "run.budget=1m", "run.name=tight"])
    with pytest.raises(ConfigError, match="cannot be kept") as refused:
        budget.fit_line(tight)
    with pytest.raises(ConfigError, match="as `quantdrift plan` found 0 min ago") as again:
        budget.fit_budget(tight, lambda c: (1.0, 0, "fits now"))
    assert str(refused.value) in str(again.value)

    # other inputs, or a plan older than the hour: fitted anew
    other = compose([*base, "run.budget=1m", "run.name=tight", "profile.speed.trials=12"])
    assert budget.fit_budget(other, lambda c: (1.0, 0, "fits now")) == (other, [])
    budget.fit_line(compose([*base, "run.budget=20m", "run.name=old"]))
    old = compose([*base, "run.budget=20m", "run.name=old"])
    monkeypatch.setattr(budget, "PLAN_KEPT_S", -1)
    slower.clear()
    budget.fit_budget(old, slower_cost)
    assert slower and "planned_by" not in budget.read_budget(old)


@pytest.mark.parametrize("left,given_back", [
    (2, ["the profile's speed rounds", "the profile's load-sweep rounds", "extra llama.cpp speed rounds at most 5 min",
         "the profile's extra llama.cpp speed rounds"]),
    (3, ["the profile's speed rounds", "the profile's load-sweep rounds", "extra llama.cpp speed rounds at most 5 min"]),
    (7, ["the profile's speed rounds"]),
    (8, None)])
def test_a_cut_run_gets_back_the_speed_and_load_rounds_that_the_screen_freed(tmp_path, monkeypatch, left, given_back):
    """The fit plans every variant's speed and load; once the screen has taken variants out, the rounds the cut took
    from those stages come back, in the reverse of the order they were cut, as far as the variants left fit in what
    the fit gave those stages for all of them (plus what it left of the budget)."""
    import pipeline.plan.budget_screen as budget_screen
    import pipeline.stages.variant_setup as variant_setup
    from pipeline.commands.compare import rebudget
    from pipeline.plan.budget import fit_budget, kept_allocation, read_budget
    from pipeline.report.run_time_section import _budget_block

    given = compose(["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=10m"])
    cfg, _ = fit_budget(given, _cost)
    fitted = read_budget(given)
    # the fit: 9 speed rounds, one load round, no extra rounds, planned 583.6 of 600 s
    assert (cfg.profile.speed.trials, cfg.load.repeats, cfg.profile.speed.extra_max_rounds) == (9, 1, 0)

    def rest(c, names):         # per variant 10 s a speed round and 40 s a load round; the extra rounds at their cap
        s = c.profile.speed
        return len(names) * (10 * s.trials + 40 * c.load.repeats) + (60 * s.extra_max_minutes if s.extra_max_rounds
                                                                      else 0)

    names = list(cfg.run.variants)
    monkeypatch.setattr(variant_setup, "load_result", lambda c, n: {
        "status": "ok", **({"screened": {"reason": "KLD over the limit"}} if n in names[left:] else {})})
    monkeypatch.setattr(budget_screen, "rest_seconds", lambda c: rest)
    after = rebudget(cfg)
    record = read_budget(given)
    if given_back is None:                  # nothing screened out: the fit stands
        assert after is cfg and record == fitted
        return
    assert record["after_screen"]["given_back"] == given_back
    assert record["after_screen"]["screened_out"] == names[left:]
    assert record["after_screen"]["allowed_rest_s"] == pytest.approx(8 * (90 + 40) + 600 - 583.6)
    assert record["after_screen"]["planned_rest_s"] == rest(after, names[:left]) <= record["after_screen"]["allowed_rest_s"]
    assert after.profile.speed.trials == 10 and after.profile.per_suite == cfg.profile.per_suite   # scoring as it ran
    assert kept_allocation(given).profile.speed == after.profile.speed                           # the summary's view
    assert kept_allocation(given).load.repeats == after.load.repeats == (3 if left < 7 else 1)
    assert rebudget(after) is after                                                             # given back once
    again = compose(["profile=quick", VARIANTS, f"paths.artifacts={tmp_path}", "run.budget=10m", "run.name=untimed"])
    untimed, _ = fit_budget(again, _cost)
    monkeypatch.setattr(budget_screen, "rest_seconds", lambda c: lambda c2, n: float("inf"))   # a stage without a time
    assert rebudget(untimed) is untimed and "after_screen" not in read_budget(again)
    text = " ".join(_budget_block({"run": {"budget": record}, "variants": {}}))
    assert f"The screen took out {', '.join(names[left:])} before free-running" in text and given_back[-1] in text


def test_the_rest_after_the_screen_is_the_plans_speed_and_load_time_for_the_variants_left(tmp_path):
    """What the give-back weighs: the plan's own speed and load rows (from the committed demo run), for the
    variants named and the allocation given."""
    import dataclasses

    from pipeline.plan.budget_screen import rest_seconds

    cfg = compose(["profile=quick", "run.variants=[original,gguf_q8_0,gguf_q4_k_m]", f"paths.artifacts={tmp_path}",
                   "profile.speed.extra_max_rounds=0"])
    planned = rest_seconds(cfg)
    one, three = planned(cfg, ["gguf_q8_0"]), planned(cfg, list(cfg.run.variants))
    more_rounds = dataclasses.replace(cfg, profile=dataclasses.replace(
        cfg.profile, speed=dataclasses.replace(cfg.profile.speed, trials=2 * cfg.profile.speed.trials)))
    assert 0 < one < three < planned(more_rounds, list(cfg.run.variants))
    assert planned(dataclasses.replace(cfg, load=dataclasses.replace(cfg.load, repeats=1)), ["gguf_q8_0"]) < one
