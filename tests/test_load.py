"""The served-load sweep: the knee and the SLO decision on hand-built sweeps, the engine's lifecycle (start, health,
stop, no server left after a kill), and the whole sweep on the tiny model with a load generator that sends real
requests to the real llama-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.figures.served_load import judge_level, knee, level_table, levels_within, operating_point
from pipeline.figures.capacity import sequences_that_fit


def rows(levels: dict[int, dict]) -> list[dict]:
    return [{"concurrency": c, "completed": 4, "errored": 0, **f} for c, f in levels.items()]


def sweep(throughputs: dict[int, list[float]], itl_p99: dict[int, list[float]] | None = None,
          ttft_p99: dict[int, list[float]] | None = None) -> dict[int, dict]:
    """A level table from per-level, per-round figures."""
    rounds = len(next(iter(throughputs.values())))
    trials = []
    for r in range(rounds):
        trials.append(rows({c: {"output_tokens_per_s": t[r],
                                "itl_p99_s": (itl_p99 or {}).get(c, [0.02] * rounds)[r],
                                "ttft_p99_s": (ttft_p99 or {}).get(c, [0.2] * rounds)[r],
                                "peak_rss_mb": 300.0 + c} for c, t in throughputs.items()}))
    return level_table(trials)


def test_level_table_takes_the_median_over_rounds_with_the_rounds_range():
    table = sweep({1: [100, 90, 110], 2: [150, 160, 140]})
    assert table[1]["output_tokens_per_s"] == 100
    assert table[1]["output_tokens_per_s_interval"]["low"] == 90
    assert table[1]["output_tokens_per_s_interval"]["high"] == 110
    assert table[2]["rounds"] == 3 and table[2]["completed"] == 12


def test_the_knee_is_where_doubling_stops_paying():
    # 1 -> 2: +60 %, 2 -> 4: +30 %, 4 -> 8: +5 %, 8 -> 16: -2 %
    table = sweep({1: [100, 100, 100], 2: [160, 158, 162], 4: [208, 205, 210], 8: [218, 216, 220],
                   16: [214, 212, 215]})
    k = knee(table, 0.10)
    assert k["reached"] and k["concurrency"] == 4
    assert [round(s["gain"], 2) for s in k["steps"]][:3] == [0.6, 0.3, 0.05]


def test_no_knee_while_throughput_still_rises_at_the_highest_level():
    k = knee(sweep({1: [100] * 3, 2: [180] * 3, 4: [300] * 3}), 0.10)
    assert not k["reached"] and k["concurrency"] == 4


def test_the_knee_uses_paired_gains_so_a_slow_round_does_not_fake_one():
    # round 2 ran on a slow machine at every level; within each round doubling still gains 40 %
    table = sweep({1: [100, 50, 100], 2: [140, 70, 140], 4: [196, 98, 196]})
    assert not knee(table, 0.10)["reached"]


def test_a_level_meets_fails_or_is_undecided_by_its_range_against_the_target():
    targets = {"max_itl_p99_s": 0.1, "max_ttft_p99_s": None, "max_e2e_p99_s": None}
    table = sweep({1: [100] * 3, 2: [150] * 3, 4: [170] * 3},
                  itl_p99={1: [0.05, 0.06, 0.07], 2: [0.08, 0.11, 0.09], 4: [0.12, 0.13, 0.15]})
    assert judge_level(table[1], targets)["verdict"] == "meets"
    assert judge_level(table[2], targets)["verdict"] == "undecided"   # the range 0.08-0.11 straddles 0.1
    assert judge_level(table[4], targets)["verdict"] == "fails"


def test_throughput_at_slo_is_the_best_level_meeting_every_target_and_the_memory_budget():
    targets = {"max_itl_p99_s": 0.1, "max_ttft_p99_s": 1.0, "max_e2e_p99_s": None}
    table = sweep({1: [100] * 3, 2: [160] * 3, 4: [210] * 3, 8: [230] * 3},
                  itl_p99={1: [0.03] * 3, 2: [0.04] * 3, 4: [0.06] * 3, 8: [0.2] * 3})
    op = operating_point(table, targets, memory_budget_mb=10_000, gain=0.10)
    assert op["max_concurrency_meeting_targets"] == 4
    assert op["throughput_at_slo"] == 210 and op["throughput_at_slo_concurrency"] == 4
    assert op["knee"]["concurrency"] == 4 and op["recommended_concurrency"] == 4
    # the same sweep on a box whose budget the 4-stream level's memory (304 MB) exceeds
    tight = operating_point(table, targets, memory_budget_mb=303.5, gain=0.10)
    assert tight["throughput_at_slo_concurrency"] == 2
    assert "budget" in " ".join(tight["verdicts"]["4"]["why"])


def test_levels_above_a_failing_one_are_not_trusted_to_meet_the_targets():
    targets = {"max_itl_p99_s": 0.1, "max_ttft_p99_s": None, "max_e2e_p99_s": None}
    table = sweep({1: [100] * 3, 2: [150] * 3, 4: [170] * 3},
                  itl_p99={1: [0.05] * 3, 2: [0.5] * 3, 4: [0.05] * 3})
    op = operating_point(table, targets, None, 0.10)
    assert op["max_concurrency_meeting_targets"] == 1 and op["throughput_at_slo"] == 100


def test_no_level_meeting_the_targets_gives_no_throughput_and_no_recommendation():
    table = sweep({1: [100] * 3, 2: [150] * 3}, ttft_p99={1: [3.0] * 3, 2: [5.0] * 3})
    op = operating_point(table, {"max_ttft_p99_s": 1.0, "max_itl_p99_s": None, "max_e2e_p99_s": None}, None, 0.1)
    assert op["throughput_at_slo"] is None and op["recommended_concurrency"] is None


def test_the_capacity_plan_caps_the_concurrency_levels():
    per_tok = 2 * 30 * 3 * 64 * 2.0       # SmolLM2's f16 KV: 23 KB per token
    fits = sequences_that_fit(2e9, 0.2, 145e6, per_tok, 4096 + 128 + 64)
    assert fits == int((2e9 * 0.8 - 145e6) // (per_tok * 4288))
    assert levels_within([1, 2, 4, 8, 16, 32], 9) == ([1, 2, 4, 8], 9)
    assert levels_within([4, 8], 1) == ([4], 1)           # the first level is always measured


def test_the_decision_ranks_by_throughput_at_slo_and_names_the_workload():
    from pipeline.config.commands import DecisionConfig
    from pipeline.decide.recommendation import decide
    from tests.test_decision import _variant as make_variant

    def with_load(v, thr, lo, hi, conc):
        v["load"] = {"status": "ok", "workload": "chat", "engine": "llama-server", "throughput_at_slo": thr,
                     "throughput_at_slo_interval": {"estimate": thr, "low": lo, "high": hi, "units": 3},
                     "throughput_at_slo_concurrency": conc, "knee_concurrency": conc, "knee_reached": True,
                     "recommended_concurrency": conc, "slo_depth": 2048}
        return v

    variants = {"a": with_load(make_variant(0.02, 100.0, 500.0), 200.0, 190.0, 210.0, 4),
                "b": with_load(make_variant(0.03, 150.0, 400.0), 300.0, 290.0, 310.0, 8),
                "c": make_variant(0.01, 90.0, 600.0)}       # no load figures: ranks last
    out = decide(variants, DecisionConfig(objective="throughput_at_slo", max_kld_mean=0.1, confidence="point",
                                          max_pass_drop=None))
    assert out["variant"] == "b"
    assert "workload chat" in out["summary"] and "8 concurrent" in out["summary"]
    # overlapping ranges over the rounds are a tie: the lower drift wins
    variants["a"]["load"]["throughput_at_slo_interval"]["high"] = 295.0
    out = decide(variants, DecisionConfig(objective="throughput_at_slo", max_kld_mean=0.1, confidence="point",
                                          max_pass_drop=None))
    assert out["variant"] == "a" and out["steps"][0]["tests"]["a"]["tied"]
    assert "the load sweep's ranges overlap" in out["summary"]


# ---------------------------------------------------------------------------------------------------------------
# the engine, for real

@pytest.fixture(scope="module")
def server_exe():
    from pipeline.infra.llama_tools import tool

    try:
        return tool("llama-server")
    except Exception as exc:
        pytest.skip(f"llama-server is not built on this machine ({exc}); `make test` builds it")


def _chat(url: str, text: str, max_tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_the_server_starts_healthy_serves_and_is_stopped(server_exe, embedded_gguf, tmp_path, own_processes):
    from pipeline.servers.llama_server import LlamaServer
    from pipeline.servers.base import pids_of

    server = LlamaServer(server_exe, embedded_gguf, threads=1, slots=2, ctx_per_slot=256, flash_attn=True,
                         log_path=tmp_path / "server.log")
    with server:
        assert server.healthy()
        pid = server.proc.pid
        # warmed up before anything is measured: one short request, WARM_UP_TOKENS generated
        from pipeline.servers.base import WARM_UP_TOKENS

        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            metrics = dict(line.split()[:2] for line in r.read().decode().splitlines()
                           if line and not line.startswith("#"))
        assert float(metrics["llamacpp:tokens_predicted_total"]) == WARM_UP_TOKENS
        reply = _chat(server.url, "Confirm order PO-4471 for 12 pallets.", 8)
        assert reply["usage"]["completion_tokens"] == 8
        assert server.peak_rss_mb() > 50
        assert server.wait_idle(timeout_s=10)          # /slots: no slot processing
    assert not server.healthy()
    assert own_processes(pids_of(server_exe)) == set()
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert "--cont-batching" in (tmp_path / "server.log").read_text()


def _server_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {k: float(v) for k, v in (line.split()[:2] for line in r.read().decode().splitlines()
                                         if line and not line.startswith("#"))}


def test_guidellm_drives_a_real_llama_server_at_1_2_and_4_and_counts_what_the_server_counted(
        server_exe, embedded_gguf, tmp_path, own_processes):
    """guidellm itself, as the load sweep runs it (1/2/4 in one invocation), against a real llama-server on the
    demo GGUF: each parsed level completed its requests without errors, every request with the output tokens asked
    for, and the tokens the parsed levels add up to are the tokens the server's own /metrics counted as predicted
    over the run; the server is stopped afterwards."""
    from pipeline.instruments import loadgen
    from pipeline.servers.base import pids_of
    from pipeline.servers.llama_server import LlamaServer

    levels, out_tokens, per_stream, min_requests = [1, 2, 4], 8, 1, 2
    prompts = [f"Confirm purchase order PO-{4400 + i} for {i + 3} pallets of copier paper and state the total."
               for i in range(loadgen.prompts_needed(levels, min_requests, per_stream))]
    server = LlamaServer(server_exe, embedded_gguf, threads=2, slots=4, ctx_per_slot=256, flash_attn=True,
                         log_path=tmp_path / "server.log")
    with server:
        before = _server_metrics(server.url)["llamacpp:tokens_predicted_total"]
        rows = loadgen.run_guidellm(server.url, prompts, levels=levels, output_tokens=out_tokens,
                                    request_body=LlamaServer.request_body(out_tokens), requests_per_stream=per_stream,
                                    min_requests=min_requests, max_seconds=300, workdir=tmp_path / "guidellm",
                                    idle=lambda: server.wait_idle(timeout_s=30), grouped=3)
        assert server.wait_idle(timeout_s=30)
        predicted = _server_metrics(server.url)["llamacpp:tokens_predicted_total"] - before
    assert own_processes(pids_of(server_exe)) == set()
    assert [r["concurrency"] for r in rows] == levels
    counts = loadgen.level_requests(levels, min_requests, per_stream)
    for r in rows:
        assert r["errored"] == 0 and r["completed"] == counts[r["concurrency"]], r
        assert r["output_tokens_per_s"] > 0 and r["itl_p50_s"] > 0
    assert predicted == out_tokens * sum(r["completed"] for r in rows)


@pytest.mark.integration
def test_an_engine_without_a_finer_signal_is_idle_once_its_process_stops_using_the_cpu(tmp_path):
    """ServedEngine.wait_idle (transformers serve has no /slots): busy while the process burns CPU, idle soon after
    it stops; a process that never rests times out; a process that is gone is not called idle."""
    from pipeline.servers.base import ServedEngine

    engine = ServedEngine(tmp_path / "model", settings={}, log_path=tmp_path / "log", startup_timeout_s=1)
    # busy for 1.5 s of its own CPU time (however the machine shares its cores), then it says so and rests
    rested = tmp_path / "rested"
    busy_then_rest = (f"import time\nwhile time.process_time() < 1.5: pass\nopen({str(rested)!r}, 'w').close()\n"
                      "time.sleep(60)")
    for code, timeout, expected in ((busy_then_rest, 30, True), ("while True: pass", 2, False)):
        engine.proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            assert engine.wait_idle(timeout_s=timeout) is expected
            if expected:
                assert rested.exists()             # idle only once the busy phase had ended, never during it
        finally:
            engine.proc.kill()
            engine.proc.wait()
    assert engine.wait_idle(timeout_s=2) is False          # reaped: no process to read


def test_a_server_that_cannot_start_fails_with_its_log_and_leaves_nothing(server_exe, tmp_path, own_processes):
    from pipeline.servers.llama_server import LlamaServer
    from pipeline.servers.base import ServerError, pids_of

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ServerError, match="exited with status"):
        with LlamaServer(server_exe, bad, threads=1, slots=1, ctx_per_slot=128, flash_attn=False,
                         log_path=tmp_path / "bad.log", startup_timeout_s=30):
            pass
    assert own_processes(pids_of(server_exe)) == set()


def test_no_server_outlives_a_run_killed_with_sigkill(server_exe, embedded_gguf, tmp_path, own_processes):
    from pipeline.servers.base import pids_of

    script = f"""
import sys, time
from pathlib import Path
from pipeline.servers.llama_server import LlamaServer
with LlamaServer(Path({str(server_exe)!r}), Path({str(embedded_gguf)!r}), threads=1, slots=1, ctx_per_slot=128,
                 flash_attn=True, log_path=Path({str(tmp_path / 'k.log')!r})) as s:
    print(s.proc.pid, flush=True)
    time.sleep(600)
"""
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           cwd=str(__import__("pipeline").__path__[0] + "/.."))
    try:
        pid = int(run.stdout.readline())
        assert pid in pids_of(server_exe)
        os.kill(run.pid, signal.SIGKILL)          # no finally, no atexit: only the parent-death signal is left
        run.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid in pids_of(server_exe) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in pids_of(server_exe)
        assert own_processes(pids_of(server_exe)) == set()
    finally:
        if run.poll() is None:
            run.kill()


def test_the_sweep_serves_every_gguf_variant_and_skips_the_others_with_the_reason(server_exe, tiny_cfg, own_processes):
    """run_load on the tiny model: gguf_q8_0 served by the real llama-server (a fresh one per round) under a load
    generator that sends real requests at each level; the original (transformers) is skipped with its reason; the
    summary, report section and plots come out; every server is stopped."""
    from pipeline.servers.base import pids_of
    from pipeline.stages.load import format_load
    from pipeline.stages.load import run_load

    calls = []

    def generate(url, prompts, *, levels, output_tokens, request_body, requests_per_stream, min_requests, max_seconds,
                 workdir, stop=None, idle=None, processes=None, grouped=1):
        assert request_body == {"max_completion_tokens": output_tokens, "ignore_eos": True, "cache_prompt": False}
        assert grouped == 3            # llama-server serves no repeated prompt from a cache: 1/2/4 in one run
        out = []
        for c in levels:
            if out and stop and stop(out):
                break
            assert idle(timeout_s=30)                   # llama-server's /slots: nothing left processing
            start = time.time()
            for p in prompts[:c]:
                reply = _chat(url, p, output_tokens)
                assert reply["usage"]["completion_tokens"] == output_tokens
            end = time.time()
            calls.append((url, c, len(prompts[0])))
            wall = max(end - start, 1e-6)
            out.append({"concurrency": c, "completed": c, "errored": 0, "start_time": start, "end_time": end,
                        "output_tokens_per_s": c * output_tokens / wall, "requests_per_s": c / wall,
                        "ttft_p50_s": 0.01, "ttft_p99_s": 0.02, "itl_p50_s": 0.001 * c, "itl_p99_s": 0.002 * c,
                        "e2e_p50_s": wall, "e2e_p99_s": wall})
        return out

    generate.version = "test generator"
    cfg = tiny_cfg("command=load", "run.variants=[original,original+kv_int8,gguf_q8_0]", "load.repeats=2",
                   "load.concurrency=[1,2]",
                   "load.depths=[64]", "load.output_tokens=4", "runtime.threads=1")
    result = run_load(cfg, generate=generate)
    assert own_processes(pids_of(server_exe)) == set()
    assert result["variants"]["original"]["status"] == "skipped"
    assert "not in this sweep" in result["variants"]["original"]["reason"]      # load=short: llamacpp only
    # a variant no engine can serve says so, whichever runtimes the sweep serves
    assert "integer KV cache" in result["variants"]["original+kv_int8"]["reason"]
    q8 = result["variants"]["gguf_q8_0"]
    assert q8["status"] == "ok" and q8["rounds"] == 2 and q8["engine"] == "llama-server"
    assert len({url for url, *_ in calls}) == 2          # a fresh server (a new port) per round
    assert set(q8["depths"]["64"]["levels"]) == {"1", "2"}
    assert q8["depths"]["64"]["levels"]["1"]["peak_rss_mb"] > 10      # sampled from the server while it ran
    assert (cfg.results_dir / "load.json").is_file()
    assert "gguf_q8_0 on llama-server" in format_load(result)
    # the report's section and plots (one line per variant, the same colour as in every other plot)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.report.plots import _load_plots
    from pipeline.report.load_section import load_section

    key, title, blocks = load_section({"load": result})
    text = json.dumps(blocks)
    assert key == "load" and "gguf_q8_0" in text and "not in this sweep" in text and "workload" in text.lower()
    plots = _load_plots(plt, result, cfg.results_dir, {"gguf_q8_0": "#1f77b4", "original": "#ff7f0e"})
    assert set(plots) == {"load_throughput", "load_itl"}
    assert all((cfg.results_dir / f).stat().st_size > 1000 for f in plots.values())
    # resumable: a second call reuses the stage
    calls.clear()
    run_load(cfg, generate=generate)
    assert calls == []
    # `make load` measures the full sweep in a stage of its own; the short one, still cached beside it, then leaves
    # the wider sweep in the run's results (a `make compare` after `make load` must not hide it)
    full = tiny_cfg("command=load", "run.variants=[original,original+kv_int8,gguf_q8_0]", "load=full",
                    "load.repeats=1", "load.concurrency=[1,2,4]", "load.depths=[64]",
                    "load.include_workload_depth=false", "load.output_tokens=4", "load.runtimes=[llamacpp]",
                    "runtime.threads=1")
    assert full.run.name == cfg.run.name
    assert run_load(full, generate=generate)["profile"] == "full" and {c for _, c, _ in calls} == {1, 2, 4}
    assert (cfg.model_dir / "runs" / cfg.run.name / "load-full" / "load.json").is_file()
    calls.clear()
    again = run_load(cfg, generate=generate)
    assert calls == [] and again["profile"] == "full" and again["logs"].endswith("load-full-logs")
    assert json.loads((cfg.results_dir / "load.json").read_text())["profile"] == "full"
    # the run's time table: the short sweep in the total, the full one beside it with its trials' own time
    from pipeline.decide.stage_times import run_stages

    times = run_stages(cfg, ["gguf_q8_0"])
    assert times["run_s"]["load"] > 0 and times["total_s"] >= times["run_s"]["load"]
    assert set(times["other_sweeps"]) == {"full"} and times["other_sweeps"]["full"]["covers"] == "trials"
    assert 0 < times["other_sweeps"]["full"]["s"] == again["trials_wall_s"]


def _post(url: str, text: str, body: dict) -> dict:
    data = json.dumps({"messages": [{"role": "user", "content": text}], **body}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_hf_variants_are_served_by_transformers_serve_and_the_int8_cache_is_skipped_with_why(tiny_cfg, own_processes):
    """run_load with load.runtimes=[hf] on the tiny model: the original served by a real `transformers serve
    --continuous-batching` (a fresh one per round), every request asking through the engine's own fields for exactly
    N tokens (the tiny random model would otherwise stop at whatever end-of-sequence it draws); the int8 KV-cache
    variant skipped with the reason (continuous batching keeps a paged cache in the model's dtype); no server left."""
    from pipeline.servers.base import pids_running
    from pipeline.stages.load import format_load
    from pipeline.stages.load import run_load

    urls = []

    def generate(url, prompts, *, levels, output_tokens, request_body, requests_per_stream, min_requests, max_seconds,
                 workdir, stop=None, idle=None, processes=None, grouped=1):
        assert "ignore_eos" not in request_body        # transformers serve answers 422 to unknown fields
        assert grouped == 1            # it shares KV blocks between requests with one prefix: a run per level
        out = []
        for c in levels:
            # no /slots: the server process's CPU time says idle (an idle server reads as idle, before the timeout)
            assert idle(timeout_s=30)
            start = time.time()
            for p in prompts[:c]:
                reply = _post(url, p, request_body)
                assert reply["usage"]["completion_tokens"] == output_tokens
            end = time.time()
            urls.append(url)
            wall = max(end - start, 1e-6)
            out.append({"concurrency": c, "completed": c, "errored": 0, "start_time": start, "end_time": end,
                        "output_tokens_per_s": c * output_tokens / wall, "requests_per_s": c / wall,
                        "ttft_p50_s": 0.01, "ttft_p99_s": 0.02, "itl_p50_s": 0.01, "itl_p99_s": 0.02,
                        "e2e_p50_s": wall, "e2e_p99_s": wall})
        return out

    generate.version = "test generator"
    cfg = tiny_cfg("command=load", "run.variants=[original,original+kv_int8]", "load.runtimes=[hf]",
                   "load.repeats=2", "load.concurrency=[1]", "load.depths=[32]", "load.output_tokens=6",
                   "runtime.threads=1")
    marker = "--continuous-batching"
    result = run_load(cfg, generate=generate)
    assert own_processes(pids_running(marker)) == set()
    orig = result["variants"]["original"]
    assert orig["status"] == "ok", orig
    assert orig["engine"] == "transformers serve" and "transformers serve 5." in orig["engine_version"]
    assert orig["rounds"] == 2 and len(set(urls)) == 2            # a fresh server per round
    assert orig["settings"]["dtype"] == "float32" and "continuous batching" in orig["setup"]
    assert orig["depths"]["32"]["levels"]["1"]["peak_rss_mb"] > 100
    kv = result["variants"]["original+kv_int8"]
    assert kv["status"] == "skipped" and "integer KV cache" in kv["reason"]
    assert "original on transformers serve" in format_load(result)


def test_no_transformers_server_outlives_a_run_killed_with_sigkill(tiny_llama, tmp_path):
    """The same parent-death guarantee for transformers serve (a Python server: found by its command line)."""
    from pipeline.servers.base import pids_running

    marker = f"serve {tiny_llama}"
    script = f"""
import time
from pathlib import Path
from pipeline.servers.transformers_serve import TransformersServe
with TransformersServe(Path({str(tiny_llama)!r}), threads=1, slots=1, ctx_per_slot=64,
                       log_path=Path({str(tmp_path / 'k.log')!r})) as s:
    print(s.proc.pid, flush=True)
    time.sleep(600)
"""
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                           cwd=str(__import__("pipeline").__path__[0] + "/.."))
    try:
        pid = int(run.stdout.readline())
        assert pid in pids_running(marker)
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 15
        while pids_running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_running(marker) == []
    finally:
        if run.poll() is None:
            run.kill()


def test_transformers_serve_says_why_it_cannot_serve_a_compressed_tensors_checkpoint(tmp_path):
    """llm-compressor's packed checkpoints cannot be held by transformers 5.24 (the hf runtime dequantizes them at
    load; transformers serve cannot): the plan raises Skip naming the format, before any server starts."""
    from types import SimpleNamespace

    from pipeline.servers.transformers_serve import TransformersServe
    from pipeline.infra.errors import Skip

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    variant = SimpleNamespace(name="awq_w4_llmc", runtime="hf", runtime_options={})
    cfg = SimpleNamespace(runtime=SimpleNamespace(device="cpu", n_threads=2))
    with pytest.raises(Skip, match="compressed-tensors"):
        TransformersServe.plan(cfg, variant, SimpleNamespace(path=folder), 64)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    plan = TransformersServe.plan(cfg, variant, SimpleNamespace(path=folder), 64)
    assert plan["settings"] == {"threads": 2, "device": "cpu", "dtype": "float32"} and plan["kv_element_bytes"] == 4


def _fake_popen(work):
    """subprocess.Popen as loadgen calls it, running ``work(guidellm's command)`` (which writes the report it reads
    back) and exiting with what it returns; the command must come through the process-group supervisor."""
    class FakePopen:
        envs: list = []

        def __init__(self, cmd, **kw):
            assert cmd[1:3] == ["-m", "pipeline.infra.child_processes"], cmd
            FakePopen.envs.append(kw.get("env") or {})
            self.returncode = work(cmd[3:])

        def wait(self, timeout=None):
            return self.returncode

        def poll(self):
            return self.returncode

        def terminate(self):
            pass

        kill = terminate

    return FakePopen


def test_an_engine_that_does_not_fix_the_output_length_fails_the_level_loudly(tmp_path, monkeypatch):
    """A guidellm level whose requests came back with another token count than asked for raises: the engine's
    request fields did not work, and its throughput would not be comparable."""
    import pipeline.instruments.loadgen as loadgen

    report = json.loads((Path(__file__).parent / "data" / "guidellm_0.8.1_concurrent.json").read_text())
    report["benchmarks"] = report["benchmarks"][:1]

    def fake_run(cmd):
        out = cmd[cmd.index("--output") + 1].split("path=")[1]
        Path(out).write_text(json.dumps(report))
        assert json.loads(cmd[cmd.index("--backend") + 1])["extras"]["body"] == {"max_completion_tokens": 7}
        return 0

    monkeypatch.setattr(loadgen.subprocess, "Popen", _fake_popen(fake_run))
    monkeypatch.setattr(loadgen, "guidellm_exe", lambda: Path("/bin/true"))
    with pytest.raises(RuntimeError, match="not the 7 asked for"):
        loadgen.run_guidellm("http://x", ["p"] * 4, levels=[1], output_tokens=7,
                             request_body={"max_completion_tokens": 7}, requests_per_stream=2, min_requests=4,
                             max_seconds=10, workdir=tmp_path)
    with pytest.raises(ValueError, match="its own prompt"):
        loadgen.run_guidellm("http://x", ["p"] * 3, levels=[1], output_tokens=7, request_body={},
                             requests_per_stream=2, min_requests=4, max_seconds=10, workdir=tmp_path)


def test_the_levels_the_knee_rule_cannot_stop_run_in_one_guidellm_invocation(tmp_path, monkeypatch):
    """1/2/4 in one guidellm run (each a benchmark with its own request count), every later level in a run of its
    own after the stop rule and the idle check; each run draws prompts no earlier one used."""
    import copy

    import pipeline.instruments.loadgen as loadgen

    recorded = json.loads((Path(__file__).parent / "data" / "guidellm_0.8.1_concurrent.json").read_text())
    calls = []

    def fake_run(cmd):
        streams = json.loads(cmd[cmd.index("--profile") + 1])["streams"]
        counts = json.loads(cmd[cmd.index("--constraint") + 1])["count"]
        data = Path(cmd[cmd.index("--data") + 1].split("path=")[1])
        calls.append((streams, counts, [json.loads(line)["prompt"] for line in data.read_text().splitlines()]))
        report = copy.deepcopy(recorded)
        report["benchmarks"] = []
        for c in streams:
            b = copy.deepcopy(recorded["benchmarks"][0])
            b["config"]["strategy"]["streams"] = c
            report["benchmarks"].append(b)
        Path(cmd[cmd.index("--output") + 1].split("path=")[1]).write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(loadgen.subprocess, "Popen", _fake_popen(fake_run))
    monkeypatch.setattr(loadgen, "guidellm_exe", lambda: Path("/bin/true"))
    idle = []
    prompts = [f"p{i}" for i in range(64)]
    kw = dict(output_tokens=32, request_body={}, requests_per_stream=2, min_requests=4, max_seconds=10,
              workdir=tmp_path, idle=lambda: idle.append(1))
    rows = loadgen.run_guidellm("http://x", prompts, levels=[16, 1, 4, 2, 8], grouped=3, **kw)
    assert [r["concurrency"] for r in rows] == [1, 2, 4, 8, 16]
    assert [(s, c) for s, c, _ in calls] == [([1, 2, 4], [4, 4, 8]), ([8], [16]), ([16], [32])]
    assert [p for _, _, p in calls] == [prompts[:8], prompts[8:24], prompts[24:56]] and len(idle) == 3
    calls.clear()
    rows = loadgen.run_guidellm("http://x", prompts, levels=[1, 2, 4, 8, 16], stop=lambda r: len(r) >= 3, grouped=3,
                               **kw)
    assert [r["concurrency"] for r in rows] == [1, 2, 4] and [s for s, _, _ in calls] == [[1, 2, 4]]
    assert loadgen.level_groups([4, 1], 3) == [[1, 4]] and loadgen.level_groups([], 3) == []

    def wrong_levels(cmd):
        fake_run(cmd)
        out = Path(cmd[cmd.index("--output") + 1].split("path=")[1])
        report = json.loads(out.read_text())
        out.write_text(json.dumps({**report, "benchmarks": report["benchmarks"][:1]}))
        return 0

    monkeypatch.setattr(loadgen.subprocess, "Popen", _fake_popen(wrong_levels))
    with pytest.raises(RuntimeError, match=r"reported the levels \[1\], not \[1, 2, 4\]"):
        loadgen.run_guidellm("http://x", prompts, levels=[1, 2, 4], grouped=3, **kw)


def test_guidellm_reports_are_parsed_per_level_in_seconds():
    """A real guidellm 0.8.1 report (llama-server, Q8_0, 1/2/4 streams, 32 output tokens; trimmed)."""
    from pathlib import Path

    from pipeline.instruments.loadgen import parse_guidellm

    report = json.loads((Path(__file__).parent / "data" / "guidellm_0.8.1_concurrent.json").read_text())
    rows = parse_guidellm(report)
    assert [r["concurrency"] for r in rows] == [1, 2, 4]
    one = rows[0]
    assert one["completed"] == 7 and one["errored"] == 0
    assert one["output_tokens_per_request"] == 32
    assert 0.5 < one["ttft_p50_s"] < 2 and 0.005 < one["itl_p50_s"] < 0.1      # ms in the JSON, seconds here
    assert one["e2e_p99_s"] >= one["e2e_p50_s"] > one["ttft_p50_s"]            # seconds in the JSON already
    assert one["end_time"] > one["start_time"]
    # a level that completed nothing has no latencies (guidellm writes 0.0 there)
    empty = json.loads(json.dumps(report))
    empty["benchmarks"][0]["metrics"]["request_totals"]["successful"] = 0
    assert parse_guidellm(empty)[0]["ttft_p99_s"] is None
    del empty["benchmarks"][1]["metrics"]["request_latency"]
    with pytest.raises(ValueError, match="request_latency"):
        parse_guidellm(empty)


def test_llama_bench_and_batched_bench_lines_are_read_as_the_tools_print_them():
    from pipeline.instruments.batched_bench import parse_batched_bench
    from pipeline.infra.llama_tools import parse_llama_bench

    bench = ('{"build_commit": "unknown", "model_filename": "model-q8_0.gguf", "n_threads": 2, "n_prompt": 64, '
             '"n_gen": 0, "n_depth": 0, "avg_ns": 1296227939, "stddev_ns": 99854704, "avg_ts": 49.520970, '
             '"stddev_ts": 3.814840, "samples_ns": [ 1225620000, 1366835878 ],"samples_ts": [ 52.2185, 46.8235 ]}')
    rows = parse_llama_bench("main: loading\n" + bench + "\nllama_perf: done\n")
    assert len(rows) == 1 and rows[0]["avg_ts"] == pytest.approx(49.52097) and rows[0]["n_prompt"] == 64
    batched = ('{"n_kv_max": 512, "pp": 64, "tg": 8, "pl": 2, "n_kv": 144, "t_pp": 1.268962, "speed_pp": 100.869843, '
               '"t_tg": 1.993336, "speed_tg": 8.026745, "t": 3.262298, "speed": 44.140663}')
    two = parse_batched_bench(batched)[2]
    assert two["decode_tokens_per_s"] == pytest.approx(8.026745)
    assert two["output_tokens_per_s"] == pytest.approx(2 * 8 / 3.262298)     # prefill included, as a served level


def test_a_stored_sweep_is_judged_again_for_another_workload_without_measuring():
    import copy

    from pipeline.config.commands import WorkloadConfig
    from pipeline.figures.served_load import rejudge

    table = sweep({1: [100] * 3, 2: [160] * 3, 4: [170] * 3}, ttft_p99={1: [2.0] * 3, 2: [3.0] * 3, 4: [6.0] * 3})
    result = {"memory_budget_mb": None, "knee_gain": 0.1, "workload": {},
              "variants": {"q": {"status": "ok", "depths": {"512": {"levels": {str(c): f for c, f in table.items()}}}},
                           "hf": {"status": "skipped", "reason": "no engine"}}}
    chat = rejudge(copy.deepcopy(result), WorkloadConfig())            # TTFT p99 <= 1 s: no level meets it
    assert chat["variants"]["q"]["throughput_at_slo"] is None and chat["variants"]["q"]["slo_depth"] == 512
    batch = rejudge(copy.deepcopy(result), WorkloadConfig(name="batch", max_ttft_p99_s=None, max_itl_p99_s=None))
    q = batch["variants"]["q"]
    assert q["throughput_at_slo"] == 170 and q["knee_concurrency"] == 2 and q["recommended_concurrency"] == 2
    assert batch["workload"]["name"] == "batch"


def test_the_probe_and_llama_bench_alternate_and_the_ratio_is_the_median_of_per_round_ratios(monkeypatch, tmp_path):
    """make bench: probe trial, then llama-bench, bench.rounds times; each side repeats LLAMA_BENCH_REPETITIONS
    times; a slow spell in one round moves that round's both sides, not the ratio."""
    from types import SimpleNamespace

    import pipeline.commands.llama_bench as bench
    import pipeline.infra.llama_tools as llamatools
    import pipeline.instruments.probe as probe
    from tests.conftest import compose

    cfg = compose(["bench.rounds=3", f"paths.artifacts={tmp_path}"])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []
    slow = iter([1.0, 0.5, 1.0])            # the machine halves its speed in round 2, for both sides

    def fake_probe(pcfg, variant, artifact, prompt):
        assert pcfg.profile.speed.repeats == bench.LLAMA_BENCH_REPETITIONS
        calls.append("probe")
        f = next(slow)
        return {"decode_tokens_per_s": 45.0 * f, "prefill_tokens_per_s": 300.0 * f, "ttft_s": 1.0 / f,
                "cpu_noise": 0.01, "peak_rss_mb": 200.0}

    def fake_tool(exe, path, threads, n_batch, fa, kv, prompt, gen):
        calls.append("llama-bench")
        f = 0.5 if calls.count("llama-bench") == 2 else 1.0
        return {"decode_tokens_per_s": 50.0 * f, "prefill_tokens_per_s": 310.0 * f, "detail": {}}

    monkeypatch.setattr(probe, "probe_speed", fake_probe)
    monkeypatch.setattr(bench, "run_llama_bench", fake_tool)
    monkeypatch.setattr(llamatools, "tool", lambda name, where: tmp_path / name)
    variant = SimpleNamespace(name="gguf_q8_0", runtime="llamacpp", runtime_options={})
    speed, row = bench._probe_beside_llama_bench(cfg, variant, SimpleNamespace(path=gguf), [1] * 8)
    assert calls == ["probe", "llama-bench"] * 3
    assert row["rounds"] == 3 and row["decode_ratio"] == pytest.approx(0.9)
    assert row["decode_ratio_range"] == pytest.approx([0.9, 0.9])
    assert row["prefill_ratio"] == pytest.approx(300 / 310)
    assert speed["decode_tokens_per_s"] == pytest.approx(45.0) and row["decode_tokens_per_s"] == pytest.approx(50.0)


def test_a_round_stops_climbing_after_two_flat_doublings_or_a_level_that_completed_nothing():
    from pipeline.figures.served_load import past_the_knee

    def r(*tps):
        return [{"concurrency": 2 ** i, "completed": 4, "output_tokens_per_s": t} for i, t in enumerate(tps)]

    assert not past_the_knee(r(100, 105), 0.10)              # one flat step is not enough
    assert not past_the_knee(r(100, 105, 150), 0.10)         # the second doubling still paid
    assert not past_the_knee(r(100, 150, 160), 0.10)
    assert past_the_knee(r(100, 105, 108), 0.10)
    assert past_the_knee(r(100, 150, 155, 150), 0.10)
    dead = r(100, 150)
    dead[-1]["completed"] = 0
    assert past_the_knee(dead, 0.10)


def test_levels_a_round_skipped_stay_paired_by_round_in_the_knee():
    # round 0 stopped after 4; round 1 measured 8 as well: level 8 has one round, in its own place
    t0 = rows({1: {"output_tokens_per_s": 100.0}, 2: {"output_tokens_per_s": 104.0},
               4: {"output_tokens_per_s": 106.0}})
    t1 = rows({1: {"output_tokens_per_s": 50.0}, 2: {"output_tokens_per_s": 80.0}, 4: {"output_tokens_per_s": 100.0},
               8: {"output_tokens_per_s": 200.0}})
    table = level_table([t0, t1])
    assert table[8]["rounds"] == 1 and table[8]["output_tokens_per_s_rounds"] == [None, 200.0]
    steps = knee(table, 0.10)["steps"]
    assert steps[-1]["from"] == 4 and steps[-1]["gain"] == pytest.approx(1.0)   # paired with round 1 only


def test_guidellm_runs_stop_when_the_climb_is_past_the_knee(monkeypatch, tmp_path):
    import pipeline.instruments.loadgen as loadgen

    ran = []

    sent = []

    def fake_run(cmd):
        c = json.loads(cmd[cmd.index("--profile") + 1])["streams"]
        ran.append(c)
        data = next(a for a in cmd if a.startswith("kind=json_file,path=")).split("path=")[1]
        sent.append([json.loads(line)["prompt"] for line in Path(data).read_text().splitlines()])
        out = next(a for a in cmd if a.startswith("kind=json,path=")).split("path=")[1]
        Path(out).write_text(json.dumps({"c": c}))
        return 0

    flat = {1: 100.0, 2: 104.0, 4: 105.0, 8: 106.0, 16: 106.0}
    popen = _fake_popen(fake_run)
    monkeypatch.setattr(loadgen.subprocess, "Popen", popen)
    monkeypatch.setattr(loadgen, "guidellm_exe", lambda: Path("guidellm"))
    monkeypatch.setattr(loadgen, "parse_guidellm", lambda rep: [
        {"concurrency": c, "completed": 4, "output_tokens_per_s": flat[c]} for c in rep["c"]])
    from pipeline.figures.served_load import KNEE_RULE_LEVELS, past_the_knee

    prompts = [f"p{i}" for i in range(loadgen.prompts_needed([1, 2, 4, 8, 16], 4, 2))]
    assert len(prompts) == 4 + 4 + 8 + 16 + 32
    idled = []
    got = loadgen.run_guidellm("http://x", prompts, levels=[1, 2, 4, 8, 16], output_tokens=4, request_body={},
                               requests_per_stream=2, min_requests=4, max_seconds=10, workdir=tmp_path,
                               stop=lambda rows: past_the_knee(rows, 0.10), idle=lambda: idled.append(len(ran)),
                               grouped=KNEE_RULE_LEVELS)
    # 1/2/4 in one invocation (the rule needs three levels); flat, so the climb ends before 8
    assert ran == [[1, 2, 4]] and [r["concurrency"] for r in got] == [1, 2, 4]
    assert idled == [0]                     # the engine was waited for before every invocation
    # one guidellm worker process for all streams by default (load.generator_processes); None: guidellm's own
    assert [e.get("GUIDELLM__MAX_WORKER_PROCESSES") for e in popen.envs] == ["1"]
    popen.envs.clear()
    loadgen.run_guidellm("http://x", prompts, levels=[1, 2], output_tokens=4, request_body={}, requests_per_stream=2,
                         min_requests=4, max_seconds=10, workdir=tmp_path, processes=None, grouped=3)
    assert [e.get("GUIDELLM__MAX_WORKER_PROCESSES") for e in popen.envs] == [None]
    ran.clear()
    sent.clear()
    loadgen.run_guidellm("http://x", prompts, levels=[1, 2, 4, 8, 16], output_tokens=4, request_body={},
                         requests_per_stream=2, min_requests=4, max_seconds=10, workdir=tmp_path, grouped=3)
    assert ran == [[1, 2, 4], [8], [16]]
    # every request of a level has its own prompt, and no invocation repeats an earlier one's (guidellm starts its
    # list again at each benchmark of one invocation: 1/2/4 share their first prompts)
    assert [len(x) for x in sent] == [8, 16, 32] and sum(sent, []) == prompts[:56]
    ran.clear()
    sent.clear()        # an engine that may serve a repeat from its cache: one run per level, no prompt twice
    loadgen.run_guidellm("http://x", prompts, levels=[1, 2, 4, 8, 16], output_tokens=4, request_body={},
                         requests_per_stream=2, min_requests=4, max_seconds=10, workdir=tmp_path)
    assert ran == [[1], [2], [4], [8], [16]] and sum(sent, []) == prompts


def test_the_served_comparison_orders_server_then_batched_bench_per_round_and_takes_per_round_ratios(monkeypatch,
                                                                                                     tmp_path):
    """The order and arithmetic of make bench's served comparison, with stand-ins for the server trial and the
    tool (the real ones run in the sweep test above and in test_runtimes's batched-bench test): per round every
    GGUF variant is served and then llama-batched-bench runs at the same N on the same file; the variants rotate
    each round; per level the ratio is the median of the per-round ratios; a variant nothing serves is skipped
    with why."""
    from types import SimpleNamespace

    import pipeline.instruments.batched_bench as batched_bench
    import pipeline.commands.llama_bench as bench
    import pipeline.servers.llama_server as llama_server
    import pipeline.infra.llama_tools as llamatools
    import pipeline.stages.load as load
    from pipeline.infra.errors import Skip
    from tests.conftest import compose

    cfg = compose(["bench.rounds=3", f"paths.artifacts={tmp_path}", "run.variants=[original,a,b]",
                   "load.concurrency=[1,2]", "load.depths=[256]", "load.output_tokens=16"])
    calls = []
    slow = {0: 1.0, 1: 0.5, 2: 1.0}          # round 2 runs at half speed, on both sides of each ratio

    def plan(cfg_, name, original, depths, budget_mb):
        assert depths == [256]
        if name == "original":
            raise Skip("no serving engine for 'hf' on cpu")
        return {"engine": llama_server.LlamaServer, "served": tmp_path / f"{name}.gguf", "levels": [1, 2],
                "output_tokens": 16,
                "settings": {"threads": 2, "n_batch": 512, "flash_attn": True, "cache_type_k": "f16",
                             "cache_type_v": "f16"}}

    def trial(plan_, depths, prompts, lc, gpu, generate, log_path):
        assert lc.stop_past_knee is False and depths == [256] and len(prompts[256]) == 8     # 4 + 4 requests
        assert plan_["version"] == "llama-server test"
        r = int(log_path.name.split(".r")[1].split(".")[0])
        calls.append(("serve", plan_["served"].stem, r))
        f = slow[r]
        return {"cpu_noise": 0.01, "depths": {"256": [
            {"concurrency": 1, "output_tokens_per_s": 40.0 * f}, {"concurrency": 2, "output_tokens_per_s": 60.0 * f}]}}

    def tool_run(exe, gguf, threads, n_batch, fa, prompt, gen, sequences, kv):
        assert (prompt, gen, sequences, threads) == (256, 16, [1, 2], 2)
        r = calls[-1][2]
        calls.append(("tool", gguf.stem, r))
        f = slow[r]
        return {1: {"output_tokens_per_s": 50.0 * f}, 2: {"output_tokens_per_s": 60.0 * f}}

    monkeypatch.setattr(load, "plan_variant", plan)
    monkeypatch.setattr(load, "serve_trial", trial)
    monkeypatch.setattr(load, "memory_budget_mb", lambda cfg_, gpu: 1000.0)
    monkeypatch.setattr(load, "load_prompts", lambda renderer, suites, depth, n: ["text"] * n)
    monkeypatch.setattr(batched_bench, "run_llama_batched_bench", tool_run)
    monkeypatch.setattr(llamatools, "tool", lambda name, where: tmp_path / name)
    monkeypatch.setattr(llama_server, "engine_version", lambda exe: "llama-server test")
    out = bench._served_beside_batched_bench(cfg, SimpleNamespace(), None, {}, generate=lambda *a, **k: [])
    assert [c[:2] for c in calls] == [("serve", "a"), ("tool", "a"), ("serve", "b"), ("tool", "b"),
                                      ("serve", "b"), ("tool", "b"), ("serve", "a"), ("tool", "a"),
                                      ("serve", "a"), ("tool", "a"), ("serve", "b"), ("tool", "b")]
    assert out["variants"]["original"]["status"] == "skipped"
    a = out["variants"]["a"]
    assert a["status"] == "ok" and a["rounds"] == 3
    one = a["levels"]["1"]
    assert one["ratio"] == pytest.approx(0.8) and one["ratio_range"] == pytest.approx([0.8, 0.8])
    assert a["levels"]["2"]["ratio"] == pytest.approx(1.0)
    assert a["levels"]["1"]["served_output_tokens_per_s"] == pytest.approx(40.0)
    text = bench.format_bench({"model": "m", "run": "quick", "threads": 2, "variants": {}, "served": out})
    assert "N=1: 40.0 / 50.0 = 0.80" in text and "original" in text and "no serving engine" in text
    # off: nothing is served
    off = compose(["bench.served=false", f"paths.artifacts={tmp_path}"])
    assert bench._served_beside_batched_bench(off, SimpleNamespace(), None, {}) is None


def test_levels_and_depths_read_back_from_load_json_print_in_numeric_order(tmp_path):
    """load.json comes back with its keys sorted as text (16 before 2, 4096 before 512); the table, the report's
    rows and the plots' lines follow the numbers."""
    from pipeline.config.commands import WorkloadConfig
    from pipeline.figures.served_load import rejudge
    from pipeline.stages.load import format_load
    from pipeline.infra.files import read_json, write_json

    table = sweep({1: [100] * 3, 2: [150] * 3, 4: [170] * 3, 16: [171] * 3})
    levels = {str(c): f for c, f in table.items()}
    result = {"memory_budget_mb": None, "knee_gain": 0.1, "workload": {}, "profile": "full", "output_tokens": 8,
              "repeats": 3, "generator": "test",
              "variants": {"q": {"status": "ok", "engine": "llama-server",
                                 "settings": {"threads": 2, "slots": 16, "cache_type_k": "f16", "cache_type_v": "f16"},
                                 "depths": {"512": {"levels": levels}, "4096": {"levels": levels}}}}}
    write_json(tmp_path / "load.json", result)
    back = rejudge(read_json(tmp_path / "load.json"), WorkloadConfig(name="batch", max_ttft_p99_s=None,
                                                                     max_itl_p99_s=None))
    assert list(back["variants"]["q"]["depths"]["512"]["levels"]) == ["1", "16", "2", "4"]     # as stored
    rows = [ln.split()[0] for ln in format_load(back).splitlines() if ln.strip()[:2].strip().isdigit()]
    assert rows == ["1", "2", "4", "16"] * 2
    text = format_load(back)
    assert text.index("context 512") < text.index("context 4096")


def test_a_run_that_only_swept_load_still_gets_both_load_plots(tmp_path):
    """`make load` reports a run in which no variant was evaluated: the load plots must not hang on the
    evaluation's plots (they did: make_plots returned before them when no variant had drift figures)."""
    from pipeline.report.plots import make_plots

    levels = {str(c): {"output_tokens_per_s": 10.0 * c ** 0.5, "itl_p99_s": 0.01 * c} for c in (1, 2, 4)}
    sweep = {"depths": [512], "workload": {"max_itl_p99_s": 0.1},
             "variants": {"gguf_q8_0": {"status": "ok", "depths": {"512": {"levels": levels}}, "knee_reached": True,
                                        "knee_concurrency": 2, "slo_depth": 512},
                          "original": {"status": "skipped", "reason": "no serving engine for hf on cpu"}}}
    summary = {"model": {"name": "m"}, "run": {"name": "load"}, "load": sweep,
               "variants": {"gguf_q8_0": {"status": "skipped"}, "original": {"status": "skipped"}}}
    plots = make_plots(summary, tmp_path)
    assert set(plots) == {"load_throughput", "load_itl"}
    assert all((tmp_path / f).stat().st_size > 1000 for f in plots.values())


def test_load_runtimes_must_name_runtimes_with_a_serving_engine():
    from pipeline.infra.errors import ConfigError
    from tests.conftest import compose

    assert compose([]).load.runtimes == ["llamacpp"]                      # the short sweep of make compare
    assert compose(["load=full"]).load.runtimes == ["llamacpp", "hf"]     # make load: every runtime
    with pytest.raises(ConfigError, match=r"load.runtimes=\['vllm'\].*serving engine \(\['hf', 'llamacpp'\]\)"):
        compose(["load.runtimes=[vllm]"])


def _stored_sweep(results_dir: Path, names: list[str], evaluated: dict | None) -> None:
    """A load.json as run_load writes it (the figures summarised from trials), served from the artifacts whose
    evaluation identities are ``evaluated`` (None: a sweep written before load.json recorded them)."""
    from pipeline.infra.files import write_json
    from pipeline.stages.load import summarize
    from tests.conftest import compose

    table = [{"concurrency": c, "completed": 4, "errored": 0, "output_tokens_per_s": 40.0 * c, "itl_p99_s": 0.02,
              "ttft_p99_s": 0.2, "peak_rss_mb": 300.0} for c in (1, 2)]
    cfg = compose([])
    raw = {"trials": {n: [{"depths": {"512": table}, "wall_s": 5.0, "cpu_noise": 0.0}] for n in names},
           "plans": {n: {"engine": "llama-server", "version": "b1",
                         "settings": {"threads": 2, "cache_type_k": "f16", "cache_type_v": "f16"}, "levels": [1, 2], "fits": 8,
                         "ctx_per_slot": 1024} for n in names},
           "skipped": {}, "depths": [512], "memory_budget_mb": 20000.0, "generator": "guidellm 0.5",
           "output_tokens": 64, "load": {"concurrency": [1, 2], "repeats": 1, "knee_gain": 0.1,
                                         "stop_past_knee": True, "name": "short"}}
    body = summarize(raw, cfg.workload)
    if evaluated is not None:
        body["evaluated"] = evaluated
    results_dir.mkdir(parents=True, exist_ok=True)
    write_json(results_dir / "load.json", body)


def test_the_summary_shows_a_load_sweep_only_beside_the_evaluation_it_served(tmp_path):
    """A results folder can hold a load.json from an earlier run (other variants, other artifacts, or a sweep from
    before load.json recorded what it served) while this run skipped the sweep (load=off): it is not this run's,
    so the summary leaves it out and says why. A sweep of this run's artifacts is shown, with this run's variants
    alone."""
    from types import SimpleNamespace

    from pipeline.decide.load_summary import load_sweep
    from pipeline.stages.load import evaluated_as
    from tests.conftest import compose

    cfg = SimpleNamespace(results_dir=tmp_path, workload=compose([]).workload)

    def result(path, digest):
        return {"status": "ok", "runtime": "llamacpp", "artifact": {"path": path, "hash": digest}}

    mine = {"gguf_q8_0": result("/a/q8.gguf", "h1"), "original": result("/a/original", "h0")}
    earlier = {"gguf_q8_0": result("/old/q8.gguf", "h9"), "gguf_q4_0": result("/old/q4.gguf", "h4")}
    assert load_sweep(cfg, mine) == (None, None)                                # no sweep at all
    _stored_sweep(tmp_path, ["gguf_q8_0", "gguf_q4_0"], {n: evaluated_as(r) for n, r in earlier.items()})
    sweep, why = load_sweep(cfg, mine)
    assert sweep is None and "served other artifacts of gguf_q8_0 than this run evaluated" in why
    assert str(tmp_path / "load.json") in why
    _stored_sweep(tmp_path, ["gguf_q4_0"], {"gguf_q4_0": evaluated_as(earlier["gguf_q4_0"])})
    assert "it measured other variants (gguf_q4_0)" in load_sweep(cfg, mine)[1]
    _stored_sweep(tmp_path, ["gguf_q8_0"], None)
    assert "does not record which evaluation" in load_sweep(cfg, mine)[1]
    # this run's own sweep (another variant beside it: not in this run, so not in its summary)
    _stored_sweep(tmp_path, ["gguf_q8_0", "gguf_q4_0"], {"gguf_q8_0": evaluated_as(mine["gguf_q8_0"]),
                                                         "gguf_q4_0": evaluated_as(earlier["gguf_q4_0"])})
    sweep, why = load_sweep(cfg, mine)
    assert why is None and set(sweep["variants"]) == {"gguf_q8_0"}
    assert sweep["variants"]["gguf_q8_0"]["throughput_at_slo"] == 80.0
    # a variant swept before it was evaluated (`make load` first, no result then) is not held against the sweep
    assert evaluated_as(None) is None and evaluated_as({"status": "failed"}) is None
    _stored_sweep(tmp_path, ["gguf_q8_0"], {"gguf_q8_0": None})
    assert load_sweep(cfg, {"gguf_q8_0": {"status": "skipped"}})[1] is None
    assert "other artifacts of gguf_q8_0" in load_sweep(cfg, mine)[1]
