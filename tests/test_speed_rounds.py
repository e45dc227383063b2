"""The speed stage's extra rounds of the cheap runtimes: taken until this run's spread lets the nightly gate see a
10 % control-relative slowdown, capped in rounds and minutes, of those runtimes' variants only, resumed without
re-measuring."""

import math
import random

import pytest

from pipeline.stages import speed


def _fake_trials(monkeypatch, noise: float, calls: list, stop_after: int | None = None):
    """Each trial's decode rate: the variant's own rate times e^N(0, noise); the transformers one is slow."""
    from pipeline.instruments import probe

    rng = random.Random(7)
    rates = {"hf": 10.0, "q8": 100.0, "q4": 150.0}

    def run_trial(spec, max_cpu_noise, label="", worker=None):
        if stop_after is not None and len(calls) >= stop_after:
            raise KeyboardInterrupt
        calls.append(label)
        return {"decode_tokens_per_s": rates[spec["artifact"]] * math.exp(rng.gauss(0, noise)),
                "prefill_tokens_per_s": 1000.0}

    monkeypatch.setattr(probe, "run_trial", run_trial)
    monkeypatch.setattr(speed.WorkerPool, "worker", lambda self, label: None)


RESULTS = {"original": {"status": "ok", "probe": {"runtime": "hf", "artifact": "hf"}},
           "gguf_q8_0": {"status": "ok", "probe": {"runtime": "llamacpp", "artifact": "q8"}},
           "gguf_q4_0": {"status": "ok", "probe": {"runtime": "llamacpp", "artifact": "q4"}}}


def _cfg(tiny_cfg, *extra):
    return tiny_cfg("profile.speed.trials=4", "profile.speed.aa=false", "profile.speed.extra_runtimes=[llamacpp]",
                    *extra)


def _detectable(run: dict) -> float:
    from pipeline.figures.speed_control import judge

    a = [t["decode_tokens_per_s"] for t in run["trials"]["gguf_q4_0"]]
    b = [t["decode_tokens_per_s"] for t in run["trials"]["gguf_q8_0"]]
    d = [math.log(x / y) for x, y in zip(a, b)]
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
    r = {"mean": m, "sd": sd, "n": len(d)}
    return judge(r, r, 0.05, "higher")["detectable"]


def test_noisy_rounds_take_extra_rounds_of_the_cheap_runtime_until_a_10_percent_slowdown_shows(tiny_cfg,
                                                                                                 monkeypatch):
    calls: list = []
    _fake_trials(monkeypatch, 0.05, calls)
    run = speed.measure_speed(_cfg(tiny_cfg, "profile.speed.extra_max_rounds=80"), RESULTS)
    extra = run["extra_order"]
    assert extra and all(sorted(r) == ["gguf_q4_0", "gguf_q8_0"] for r in extra), run["extra_stop"]
    assert len(run["trials"]["original"]) == 4                     # the slow runtime: its interleaved rounds only
    assert len(run["trials"]["gguf_q8_0"]) == len(run["trials"]["gguf_q4_0"]) == 4 + len(extra)
    assert "reach a 10% detectable regression" in run["extra_stop"]
    # what the stage promised: a baseline measured alike and this run would catch a 10 % slowdown
    assert _detectable(run) <= 0.105
    assert calls.count("original") == 4


def test_quiet_rounds_need_none_and_the_caps_hold(tiny_cfg, monkeypatch):
    calls: list = []
    _fake_trials(monkeypatch, 0.005, calls)
    run = speed.measure_speed(_cfg(tiny_cfg, "profile.speed.extra_max_rounds=80"), RESULTS)
    assert run["extra_order"] == [] and "4 rounds reach" in run["extra_stop"]
    _fake_trials(monkeypatch, 0.2, calls)
    run = speed.measure_speed(_cfg(tiny_cfg, "profile.speed.extra_max_rounds=5", "force=true"), RESULTS)
    assert len(run["extra_order"]) == 5 and "capped at 5 extra rounds" in run["extra_stop"]
    run = speed.measure_speed(_cfg(tiny_cfg, "profile.speed.extra_max_rounds=50",
                                   "profile.speed.extra_max_minutes=1e-9", "force=true"), RESULTS)
    assert len(run["extra_order"]) == 1 and "capped at 1e-09 min" in run["extra_stop"]
    # off by default (the smoke profile): no extra rounds
    run = speed.measure_speed(tiny_cfg("profile.speed.trials=4", "profile.speed.aa=false", "force=true"), RESULTS)
    assert run["extra_order"] == []


def test_an_interrupted_stage_resumes_its_extra_rounds_without_measuring_again(tiny_cfg, monkeypatch):
    calls: list = []
    _fake_trials(monkeypatch, 0.05, calls, stop_after=20)
    cfg = _cfg(tiny_cfg, "profile.speed.extra_max_rounds=80")
    with pytest.raises(KeyboardInterrupt):
        speed.measure_speed(cfg, RESULTS)
    done = list(calls)
    assert len(done) == 20
    _fake_trials(monkeypatch, 0.05, calls)
    run = speed.measure_speed(cfg, RESULTS)
    measured = 4 * 3 + 2 * len(run["extra_order"])
    assert len(calls) == measured, "a trial already in the journal was measured again"
