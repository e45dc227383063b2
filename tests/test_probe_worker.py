"""The speed probe's worker process: loaded once, measured per request, stopped on every exit path."""

import json
import time
from dataclasses import asdict

import pytest

from pipeline.config.schema import RuntimeConfig
from pipeline.instruments.probe import ProbeWorker, run_trial
from tests.conftest import pids_running, process_alive


def _spec(artifact, runtime="hf", **options) -> dict:
    return {"runtime": runtime, "artifact": str(artifact), "options": {"n_ctx": 256, **options},
            "runtime_cfg": {**asdict(RuntimeConfig(device="cpu", threads=1)), "repeat_penalty": 1.0},
            "trust_remote_code": False, "prompt_ids": list(range(100, 132)), "decode_tokens": 8, "repeats": 2,
            "warmup": 1}


_alive = process_alive


def test_a_worker_loads_once_and_measures_every_trial_it_is_asked_for(tiny_llama):
    spec = _spec(tiny_llama)
    with ProbeWorker(spec, "original") as worker:
        pid = worker.proc.pid
        first = run_trial(spec, 1.0, "original", worker)
        second = run_trial(spec, 1.0, "original", worker)
        assert worker.proc.pid == pid and _alive(pid)
    for trial in (first, second):
        assert trial["decode_tokens"] == 8 and trial["prompt_tokens"] == 32
        assert trial["decode_tokens_per_s"] > 0 and trial["ttft_s"] > 0 and trial["peak_rss_mb"] > 0
        assert 0.0 <= trial["cpu_noise"] <= 1.0 and trial["noisy"] is False
        # the trial's own peak (high-water mark reset at its start), the load's peak and the size after it apart
        assert trial["peak_rss_per_trial"] is True and trial["load_peak_rss_mb"] >= trial["steady_rss_mb"] > 0
    # loaded once: both trials carry the same load time and load memory, and their timings are their own
    assert first["load_s"] == second["load_s"] > 0
    assert first["load_peak_rss_mb"] == second["load_peak_rss_mb"]
    assert json.dumps(first["runtime_info"]) == json.dumps(second["runtime_info"])
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "close() left the worker running"


def test_a_gguf_probe_process_never_loads_torch(tiny_llama, embedded_gguf):
    """The process that loads a GGUF (the speed probe: on a GPU, llama.cpp's CUDA backend) has no torch module,
    so torch's CUDA runtime can never share it; the transformers probe does load torch (the check can fail)."""
    assert run_trial(_spec(embedded_gguf, runtime="llamacpp"), 1.0, "gguf_q8_0")["torch_loaded"] is False
    assert run_trial(_spec(tiny_llama), 1.0, "original")["torch_loaded"] is True


def test_without_a_worker_a_trial_runs_in_a_fresh_process_that_is_gone_after(tiny_llama, own_processes):
    trial = run_trial(_spec(tiny_llama), 1.0, "original")
    assert trial["decode_tokens_per_s"] > 0
    time.sleep(0.2)
    assert own_processes(pids_running("pipeline.instruments.probe")) == set()


@pytest.mark.integration
def test_a_worker_that_cannot_load_its_variant_fails_with_the_reason_and_exits(tmp_path):
    missing = tmp_path / "nothing-here"
    spec = _spec(missing)
    worker = ProbeWorker(spec, "broken")
    try:
        with pytest.raises(RuntimeError, match="speed probe failed"):
            run_trial(spec, 1.0, "broken", worker)
        assert worker.proc.wait(timeout=30) is not None
    finally:
        worker.close()


def test_the_speed_stage_keeps_one_loaded_worker_per_label_across_rounds(tiny_cfg, tiny_llama, monkeypatch):
    from pipeline.stages import speed as speed

    cfg = tiny_cfg("profile.speed.trials=3")
    results = {"original": {"status": "ok", "probe": _spec(tiny_llama)},
               "other": {"status": "ok", "probe": _spec(tiny_llama, n_batch=64)}}
    run = speed.measure_speed(cfg, results)
    assert run["workers"] == speed.WORKERS_KEPT == "one per label for the stage"
    for label in ("original", "other", "original" + speed.AA_SUFFIX):
        loads = {t["load_s"] for t in run["trials"][label]}
        assert len(loads) == 1, f"{label} was loaded more than once: {loads}"
    # the A/A copy is a process of its own (its own load), so the noise floor includes a load's luck
    assert run["trials"]["original"][0]["load_s"] != run["trials"]["original" + speed.AA_SUFFIX][0]["load_s"]

    # without room for all of them at once, each trial gets a fresh process
    monkeypatch.setattr(speed, "_mem_available_mb", lambda: 10.0)
    run = speed.measure_speed(tiny_cfg("profile.speed.trials=2", "force=true"), results)
    assert run["workers"] == speed.WORKERS_FRESH == "one per trial"
    assert len({t["load_s"] for t in run["trials"]["original"]}) == 2


def test_each_trial_reads_its_own_peak_not_the_process_high_water_mark():
    """The probe resets the resident high-water mark at each trial's start: a trial that allocates little after one
    that allocated much reads its own, lower peak (a kept process would otherwise report its highest peak, its
    load's, in every trial)."""
    import numpy as np

    from pipeline.infra.stage_memory import reset_peak_rss
    from pipeline.instruments.memory import peak_rss_mb

    assert reset_peak_rss(), "this kernel refuses /proc/self/clear_refs"
    big = np.ones(256 * 2**20 // 8)
    big[:: 4096 // 8] = 2.0
    first = peak_rss_mb()
    del big
    assert reset_peak_rss()
    second = peak_rss_mb()
    assert first - second > 200, (first, second)


class _FakeWorker:
    def __init__(self, spec, label):
        self.label, self.closed = label, False

    def close(self):
        self.closed = True


def test_the_probe_pool_is_sized_from_measured_memory_not_the_estimate(tmp_path, tiny_cfg, monkeypatch):
    """A probe whose measured load peak is twice its estimate makes the pool expect the same of every probe of its
    runtime: with room for two estimated probes but not for two measured ones, the second label runs fresh."""
    from pipeline.instruments import probe
    from pipeline.stages import speed

    specs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"\0" * 2**20)
        specs[name] = {"runtime": "hf", "artifact": str(tmp_path / name)}
    monkeypatch.setattr(probe, "ProbeWorker", _FakeWorker)
    pool = speed.WorkerPool(tiny_cfg(), specs, ["a", "b"])
    estimate = pool.estimate_mb("a")
    assert estimate == pytest.approx(1.2 + 700.0)
    # room for this probe and a fresh one as estimated (2 x 701 MB within 80 % of 1,800 MB)...
    monkeypatch.setattr(speed, "_mem_available_mb", lambda: 1800.0)
    assert pool.worker("a") is not None and pool.kept == ["a"]
    pool.record("a", {"load_peak_rss_mb": 2 * estimate})
    assert pool.expected_mb("b") == pytest.approx(2 * estimate)
    # ...but the measured peak says each takes 1,402 MB: keeping b as well would leave no room for a fresh probe
    assert pool.worker("b") is None and "b" in pool.refused and "1402 MB kept" in pool.refused["b"]
    assert pool.mode() == speed.WORKERS_MIXED
    assert pool.worker("a") is pool.workers["a"]       # a kept probe stays kept
    pool.close()
    assert not pool.workers
