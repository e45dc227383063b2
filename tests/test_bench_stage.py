"""Benchmark tasks in a comparison (run.suites entries bench:TASK): validated when the config loads, run as a
cached stage on each variant's own runtime, summarised per task as accuracy, recovery and flips against the
original, tabled in the report, and judged by decision.min_recovery."""

import json

import pytest

from pipeline.cli import run
from pipeline.config.commands import DecisionConfig
from pipeline.decide.constraints import judge_constraints
from pipeline.decide.recommendation import decide
from pipeline.infra.errors import ConfigError
from tests.conftest import compose


def test_bench_entries_are_tasks_validated_when_the_config_loads():
    cfg = compose(["run.suites=[smoke,bench:business_mc]", "profile=smoke"])
    assert cfg.run.suites == ["smoke"] and cfg.run.bench_tasks == ["business_mc"]
    assert [s.name for s in cfg.selected_suites()] == ["smoke"]      # the conversation stages never see it
    assert cfg.profile.bench_limit == 8
    assert compose(["profile=full"]).profile.bench_limit is None
    # the quick profile: HumanEval's first 64 problems, every business_mc question (a per-task override)
    quick = compose(["profile=quick"]).profile
    assert quick.bench_limit_for("humaneval") == 64 and quick.bench_limit_for("business_mc") is None
    with pytest.raises(ConfigError, match="profile.bench_limits.humaneval"):
        compose(["+profile.bench_limits.humaneval=-1"])
    # any name lm-eval's registry could hold is accepted here, cheaply (no lm-eval, no registry walk): whether it
    # is a task and its data is offline is the pre-flight's check (tests/test_lmeval.py)
    assert compose(["run.suites=[smoke,bench:gsm8k,bench:arc_easy]"]).run.bench_tasks == ["gsm8k", "arc_easy"]
    with pytest.raises(ConfigError, match=r"run\.suites='bench:no\*such' is not valid: .*business_mc, humaneval, "
                                          r"or the name of a task of lm-eval's registry"):
        compose(["run.suites=[smoke,'bench:no*such']"])
    with pytest.raises(ConfigError, match="at least one conversation suite"):
        compose(["run.suites=[bench:business_mc]"])
    with pytest.raises(ConfigError, match="profile.bench_limit"):
        compose(["profile.bench_limit=0"])
    with pytest.raises(ConfigError, match="decision.min_recovery"):
        compose(["decision.min_recovery=1.5"])


def _row(low, estimate=0.9, high=1.0, status="ok"):
    if status != "ok":
        return {"status": status, "reason": "runtime cannot run here"}
    return {"status": "ok", "metric": "acc_norm", "samples": 64,
            "recovery": None if low is None else {"estimate": estimate, "low": low, "high": high}}


def _variant(kld, tps, rss, benchmarks):
    return {"status": "ok", "drift": {"kld_mean": kld, "kld_p99": 0.5, "flip_rate": 0.0, "pass_rate": 0.5},
            "speed": {"decode_tokens_per_s": tps}, "memory": {"peak_rss_mb": rss, "artifact_bytes": rss * 1e6},
            "benchmarks": benchmarks}


def test_min_recovery_fails_a_variant_on_the_lower_bound_of_its_recovery():
    d = DecisionConfig(min_recovery=0.95, max_pass_drop=None, confidence="point")
    variants = {
        "original": _variant(0.0, 10.0, 500, {"business_mc": _row(1.0, 1.0, 1.0)}),
        # the fastest, but its recovery's interval reaches down to 80 %: judged on the bound, not the estimate
        "fast": _variant(0.05, 30.0, 200, {"business_mc": _row(0.80, estimate=0.97)}),
        "good": _variant(0.02, 20.0, 300, {"business_mc": _row(0.96, estimate=0.99)}),
    }
    rec = decide(variants, d)
    assert rec["variant"] == "good", rec["summary"]
    assert rec["reasons"]["fast"].startswith("fails constraint: bench:business_mc recovery 97% [80%, 100%]")
    assert "lower bound 80.0% < 95%" in rec["reasons"]["fast"]
    assert not judge_constraints(variants["original"], d) and not judge_constraints(variants["good"], d)
    # off by default
    assert decide(variants, DecisionConfig(max_pass_drop=None, confidence="point"))["variant"] == "fast"
    # no recovery (no original's answers) or a task that did not run: reported, never judged
    for row in (_row(None), _row(0.0, status="skipped")):
        judged = judge_constraints(_variant(0.02, 20.0, 300, {"business_mc": row}), d)
        assert [c["verdict"] for c in judged] == ["not measurable"], judged
        assert "bench:business_mc recovery not measurable" in judged[0]["message"]


def _stage_manifests(root):
    return {str(p): json.loads(p.read_text())["created_unix"] for p in root.rglob("*.bench-*/manifest.json")}


@pytest.mark.slow
def test_a_bench_task_runs_on_each_variants_runtime_into_summary_and_report(tiny_cfg, tmp_path, monkeypatch):
    from pipeline.infra.files import read_jsonl
    from pipeline.stages.lmeval_tasks import bench_dir
    from pipeline.stages.variant_setup import load_result
    from pipeline.suites.lmeval.adapter import RuntimeLM

    variants = ["original", "gguf_f16"]
    extra = ("run.suites=[smoke,bench:business_mc]", "profile.bench_limit=6", "profile.speed.trials=1",
             "profile.speed.aa=false")
    assert run(tiny_cfg("variant=original", *extra)) == 0
    # the GGUF variant's task stopped after 10 of its 24 log-likelihood requests (6 questions × 4 options) ...
    inner, answered = RuntimeLM._loglikelihood_tokens, []

    def stopped(self, requests, *args, **kwargs):
        inner(self, requests[:10], *args, **kwargs)
        raise RuntimeError("stopped after 10 requests")

    monkeypatch.setattr(RuntimeLM, "_loglikelihood_tokens", stopped)
    run(tiny_cfg("variant=gguf_f16", *extra))
    assert load_result(tiny_cfg(*extra), "gguf_f16")["status"] == "failed"

    # ... resumes with the other 14
    def counted(self, requests, *args, **kwargs):
        answered.append(len(requests))
        return inner(self, requests, *args, **kwargs)

    monkeypatch.setattr(RuntimeLM, "_loglikelihood_tokens", counted)
    assert run(tiny_cfg("variant=gguf_f16", *extra)) == 0
    assert sum(answered) == 14, answered
    cfg = tiny_cfg("command=report", f"run.variants=[{','.join(variants)}]", *extra)
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    assert summary["run"]["suites"] == ["smoke"] and summary["run"]["bench_tasks"] == ["business_mc"]
    # the settings its token work was counted with, as it ran (a plan from this run reads them)
    assert summary["run"]["workload"] == {"max_conversations": cfg.profile.max_conversations,
                                          "max_new_tokens_cap": cfg.profile.max_new_tokens_cap,
                                          "per_suite": cfg.profile.per_suite}
    task = summary["benchmarks"]["business_mc"]
    assert task["variants"] == variants and task["limit"] == 6 and task["reference"] == "original"
    assert task["task"]["task"] == "business_mc" and len(task["task"]["data_sha256"]) == 64
    answers = {}
    for name, runtime in zip(variants, ("hf", "llamacpp")):
        folder = bench_dir(cfg, name, "business_mc")
        manifest = json.loads((folder / "manifest.json").read_text())
        # the variant's own runtime, plain greedy although the conversations decode with runtime.repeat_penalty
        assert manifest["key"]["runtime"] == runtime and manifest["key"]["limit"] == 6
        assert cfg.runtime.repeat_penalty > 1.0 and "decoding" not in manifest["key"]
        samples = read_jsonl(folder / "samples.jsonl")
        assert len(samples) == 6
        answers[name] = {s["id"]: s["correct"] for s in samples}
        row = summary["variants"][name]["benchmarks"]["business_mc"]
        assert row["status"] == "ok" and row["samples"] == 6 and row["metric"] == "acc_norm"
        assert row["accuracy"]["estimate"] == pytest.approx(sum(answers[name].values()) / 6)
        assert row["decoding"]["repeat_penalty"] == 1.0 and row["task_key"] == task["task"]
        # per category, joined from the data file: the first 6 questions are all units
        assert list(row["by_category"]) == ["units"] and row["by_category"]["units"]["samples"] == 6
    o, q = answers["original"], answers["gguf_f16"]
    row = summary["variants"]["gguf_f16"]["benchmarks"]["business_mc"]
    assert row["correct_to_wrong"] == sum(o[i] and not q[i] for i in o)
    assert row["wrong_to_correct"] == sum(q[i] and not o[i] for i in o)
    if row["correct_to_wrong"] + row["wrong_to_correct"]:
        assert 0 <= row["mcnemar_p"] <= row["mcnemar_p_adjusted"] <= 1
    else:                                   # no discordant answer: nothing to test
        assert row["mcnemar_p"] is None and row["mcnemar_p_adjusted"] is None
    if sum(o.values()):
        assert row["recovery"]["estimate"] == pytest.approx(sum(q.values()) / sum(o.values()))
    ref = summary["variants"]["original"]["benchmarks"]["business_mc"]
    assert ref["correct_to_wrong"] == ref["wrong_to_correct"] == 0 and ref["mcnemar_p_adjusted"] is None
    report = (cfg.results_dir / "report.md").read_text()
    section = report.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "**bench:business_mc**" in section and "the first 6 samples" in section
    assert "| variant | acc_norm accuracy [CI] | recovery [CI] | correct→wrong | wrong→correct |" in section
    assert "| gguf_f16 | " in section and "| original (reference) | " in section
    assert "| category | samples | original (reference) | gguf_f16 |" in section and "| units | 6 | " in section
    # a second run reuses every bench stage
    before = _stage_manifests(tmp_path / "artifacts")
    assert len(before) == 2
    for v in variants:
        assert run(tiny_cfg(f"variant={v}", *extra)) == 0
    assert _stage_manifests(tmp_path / "artifacts") == before, "an immediate second run must recompute nothing"


def test_the_report_states_what_ran_where_and_why_a_row_is_missing():
    from pipeline.report.bench_section import bench_section

    row = {"status": "ok", "metric": "pass_at_1", "samples": 3,
           "accuracy": {"estimate": 1 / 3, "low": 0.0, "high": 1.0},
           "recovery": {"estimate": 0.5, "low": 0.0, "high": 1.0}, "correct_to_wrong": 1, "wrong_to_correct": 0,
           "mcnemar_p": 1.0, "mcnemar_p_adjusted": 1.0, "wall_s": 42.0,
           "sandbox": {"sandboxed": True, "confinement": "network namespace without interfaces (unshare --net)",
                       "network_interfaces": ["lo"], "memory_mb": 2048, "timeout_s": 3.0}}
    summary = {"variants": {"original": {"status": "ok", "benchmarks": {"humaneval": {**row, "recovery": None}}},
                            "q4": {"status": "ok", "benchmarks": {"humaneval": row}},
                            "awq": {"status": "ok", "benchmarks": {"humaneval": {"status": "skipped",
                                                                                 "reason": "no kernel here"}}}},
               "benchmarks": {"humaneval": {"task": {"task": "humaneval", "version": "2", "data_sha256": "ab" * 32,
                                                     "lm_eval": "0.4.13", "max_gen_toks": 1024},
                                            "metric": "pass_at_1", "limit": None,
                                            "decoding": {"repeat_penalty": 1.0}, "reference": "original",
                                            "reference_accuracy": {"estimate": 2 / 3}, "no_signal_for_flips": False,
                                            "multiple_comparisons": "holm", "note": None,
                                            "variants": ["original", "q4", "awq"]}}}
    sid, _, blocks = bench_section(summary)
    assert sid == "benchmarks" and bench_section({"variants": {}, "benchmarks": {}}) is None
    head, rows = next(b for b in blocks if isinstance(b, tuple))
    assert head[1] == "pass_at_1 accuracy [CI]"
    assert rows[1] == ["q4", "33.3% [0.0%, 100.0%]", "50% [0%, 100%]", "1", "0", "1.000", "1.000", "3", "42"]
    assert rows[2][0] == "awq" and set(rows[2][1:]) == {"–"}
    text = " ".join(str(b) for b in blocks)
    assert "every sample" in text and "no signal" not in text
    assert "`awq`: bench:humaneval not run: no kernel here" in text
    # the reply cap it ran with, from the task's key
    assert ("Task `humaneval` version 2, data sha256 `abababababababab`, lm-eval 0.4.13; every sample; decoding: "
            "greedy (argmax, no repetition penalty), one sample per item, replies capped at 1024 tokens; a sample "
            "counts as correct by `pass_at_1`.") in text
    # a registry task: where it came from and what a sample is
    registry = {"task": "arc_easy", "version": "1.0", "data_sha256": "cd" * 32, "lm_eval": "0.4.13",
                "dataset": "allenai/ai2_arc (config ARC-Easy)", "source": "lm-eval registry"}
    from pipeline.report.bench_section import task_blocks

    line = task_blocks("arc_easy", {"task": registry, "metric": "acc_norm", "variants": []}, {})[0]
    assert line.startswith("Task `arc_easy` version 1.0 from lm-eval's registry (dataset allenai/ai2_arc (config "
                           "ARC-Easy); a sample is its doc_id), data sha256 `cdcdcdcdcdcdcdcd`")
    assert "capped" not in line and "correct by `acc_norm`" in line
    assert ("`q4`: HumanEval completions checked in a child process, network namespace without interfaces "
            "(unshare --net) (network interfaces seen: lo), memory limit 2048 MB, time limit 3.0 s per "
            "problem.") in text
