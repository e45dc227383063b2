"""A finished run's llama.cpp stages set beside llama.cpp's own tools doing the same work: the work each stage did is
read from its own outputs (tokens prefilled and decoded per suite, tokens read and rows scored), the tools' rates
are asked for that work, and what cannot be costed says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.commands.stage_costs import extraction_seconds_per_row, format_costs, run_stage_costs
from pipeline.infra.files import write_json

SETTINGS = {"threads": 2, "n_batch": 512, "flash_attn": True, "cache_type_k": "f16", "cache_type_v": "f16",
            "kv_unified": False}


def _turn(prompt: int, prefill: int, reply: int) -> dict:
    return {"start": 0, "end": reply, "prompt_tokens": prompt, "prefill_tokens": prefill}


def _run(cfg, tmp_path: Path) -> None:
    """A run of four variants as a comparison leaves it: gguf_q8_0 free-ran and was scored on llama.cpp, gguf_f16
    reused the reference's replies, gguf_q4_0 was screened out after scoring, the original ran on transformers."""
    run = cfg.model_dir / "runs" / cfg.run.name
    refs = cfg.model_dir / "reference" / cfg.run.name
    # the references: long_output's from the F16 file on llama.cpp, multi_turn's from the original on transformers
    for suite, convs in {"long_output": {"a": 600, "b": 400}, "multi_turn": {"c": 300}}.items():
        (refs / suite).mkdir(parents=True)
        (refs / suite / "transcripts.jsonl").write_text(
            "".join(json.dumps({"id": cid, "suite": suite, "ids": [1] * n, "turns": [_turn(n - 100, n - 100, 100)]})
                    + "\n" for cid, n in convs.items()))
        producer = "gguf_f16@llamacpp" if suite == "long_output" else "original@hf"
        write_json(refs / suite / "manifest.json", {"wall_s": 40.0, "producer": producer})
        write_json(refs / f"{suite}-logprobs" / "manifest.json", {"wall_s": 20.0})
    (cfg.model_dir / "variants" / "gguf_f16").mkdir(parents=True)
    (cfg.model_dir / "variants" / "gguf_f16" / "model-f16.gguf").write_bytes(b"GGUF")
    info = {"runtime_info": {**SETTINGS, "runtime": "llamacpp"}}
    # the first scoring stage (gguf_f16's, ending at t=1000) built the original's exact rows of both suites inside it
    ends = {"gguf_f16": 1000.0, "gguf_q8_0": 1100.0, "gguf_q4_0": 1200.0, "original": 900.0}
    for suite, at in (("long_output", 980.0), ("multi_turn", 990.0)):
        write_json(refs / f"{suite}-exact_sample" / "manifest.json", {"wall_s": 4.0, "created_unix": at})
    facts = {"vocab_size": 1000}

    def variant(name: str, free: dict | None, reused: bool = False, runtime: str = "llamacpp") -> None:
        ev = {"scores_dir": str(run / f"{name}.scores"), "free_running_dir": str(run / name) if free or reused else None}
        write_json(run / f"{name}.result.json", {"status": "ok", "runtime": runtime, "model": {"facts": facts},
                                                 "artifact": {"path": f"/files/{name}" + (".gguf" if runtime == "llamacpp" else "")}, "evaluation": ev})
        exactness = {"long_output": {"sample": "long_output/a", "tokens": 40}} if name == "gguf_q8_0" else None
        write_json(run / f"{name}.scores" / "manifest.json", {**info, "wall_s": 30.0, "created_unix": ends[name],
                                                              "kld_exactness": exactness})
        write_json(run / f"{name}.scores" / "teacher_forced.json",
                   {"long_output": {"a": {"kld": [0.0] * 200}, "b": {"kld": [0.0] * 100}},
                    "multi_turn": {"c": {"kld": [0.0] * 50}}})
        if free or reused:
            write_json(run / name / "manifest.json", {**info, "wall_s": 60.0, "reused_reference": reused})
            (run / name / "transcripts.jsonl").write_text(
                "".join(json.dumps({"id": cid, "suite": s, "turns": turns}) + "\n" for (s, cid), turns in
                        (free or {}).items()))

    variant("gguf_q8_0", {("long_output", "a"): [_turn(400, 400, 200)], ("long_output", "b"): [_turn(300, 300, 100)],
                          ("multi_turn", "c"): [_turn(100, 100, 20), _turn(200, 80, 30)]})
    variant("gguf_f16", None, reused=True)
    variant("gguf_q4_0", None)
    variant("original", None, runtime="hf")


def test_each_llama_cpp_stage_is_costed_at_the_tools_rates_for_the_work_it_did(tiny_cfg, tmp_path, capsys):
    cfg = tiny_cfg("run.variants=[gguf_q8_0,gguf_f16,gguf_q4_0,original,awq_w4]", "profile.batch=8",
                   "run.suites=[long_output,multi_turn]")
    _run(cfg, tmp_path)
    prompt_calls, batched_calls = [], []

    def prompt_rate(gguf, settings, prompt):
        prompt_calls.append((gguf.name, settings, prompt))
        return 100.0                                     # tokens/s

    def batched_rates(gguf, settings, prompt, reply, sequences):
        batched_calls.append((gguf.name, prompt, reply, sequences))
        return 200.0, 10.0                               # prefill, decode tokens/s

    row_calls = []

    def row_cost(gguf, settings):
        row_calls.append(gguf.name)
        return {"row_s": 0.01}                           # llama-perplexity's seconds per computed row

    out = run_stage_costs(cfg, prompt_rate, batched_rates, row_seconds=0.001, row_cost=row_cost)
    rows = {(r["variant"], r["stage"]): r for r in out["rows"]}
    # the reference produced on llama.cpp: its free-running (two sequences at once: 800 prefilled, 200 decoded) and
    # its log-probs (1,000 tokens read, 200 rows' top-K kept at the selection's measured cost per row)
    ref_free, ref_lp = rows[("reference long_output", "free-running")], rows[("reference long_output", "log-probs")]
    assert [c for c in batched_calls if c[0] == "model-f16.gguf"] == [("model-f16.gguf", 400, 100, 2)]
    assert [c[::2] for c in prompt_calls if c[0] == "model-f16.gguf"] == [("model-f16.gguf", 500)]
    assert ref_free["tool_s"] == pytest.approx(800 / 200 + 200 / 10) and ref_free["stage_s"] == 40.0
    assert ref_free["settings"]["cache_type_k"] == "f16" and ref_free["settings"]["threads"] == cfg.runtime.n_threads
    assert ref_lp["tool_s"] == pytest.approx(1000 / 100 + 200 * out["select_row_seconds"]) and ref_lp["stage_s"] == 20.0
    # beside it, the engine computing each of those 200 rows at llama-perplexity's cost per row, and the selection
    # of each row's top K beyond the normaliser and gather (which llama-perplexity does not do)
    engine = 1000 / 100 + 200 * (0.01 + max(0.0, out["select_row_seconds"] - 0.001))
    assert ref_lp["engine_rows_s"] == pytest.approx(engine) and ref_lp["ratio_engine_rows"] == pytest.approx(20 / engine)
    assert out["select_row_seconds"] > 0
    assert "produced by original@hf, not a GGUF file" in rows[("reference multi_turn", "-")]["reason"]
    batched_calls[:] = [c for c in batched_calls if c[0] != "model-f16.gguf"]
    prompt_calls[:] = [c for c in prompt_calls if c[0] != "model-f16.gguf"]
    # free-running, per suite: long_output's two conversations decoded together (700 prefilled, 300 decoded);
    # multi_turn's one conversation, each turn prefilling only what is new (180 prefilled, 50 decoded)
    assert sorted(batched_calls) == [("gguf_q8_0.gguf", 150, 25, 1), ("gguf_q8_0.gguf", 350, 150, 2)]
    free = rows[("gguf_q8_0", "free-running")]
    assert free["tool_s"] == pytest.approx(700 / 200 + 300 / 10 + 180 / 200 + 50 / 10)
    assert free["ratio"] == pytest.approx(60.0 / free["tool_s"])
    assert free["work"] == "880 prefilled + 350 decoded tokens"
    # scoring: every reference transcript read once (1,300 tokens), 350 rows, and the exactness check's sample once
    # more (600 tokens, 40 rows), at the rate for the mean transcript
    assert prompt_calls == [("gguf_q8_0.gguf", SETTINGS, 475), ("gguf_f16.gguf", SETTINGS, 433),
                            ("gguf_q4_0.gguf", SETTINGS, 433)]
    score = rows[("gguf_q8_0", "scoring")]
    assert score["tool_s"] == pytest.approx(1900 / 100 + 390 * 0.001) and score["ratio"] == pytest.approx(30.0 / 19.39)
    assert score["engine_rows_s"] == pytest.approx(1900 / 100 + 390 * 0.01)
    assert score["ratio_engine_rows"] == pytest.approx(30.0 / 22.9)
    # llama-perplexity asked once per file costed (the reference's F16 file, then each variant's)
    assert sorted(row_calls) == sorted(["model-f16.gguf", "gguf_q8_0.gguf", "gguf_f16.gguf", "gguf_q4_0.gguf"])
    # what cannot be costed says why
    f16 = rows[("gguf_f16", "scoring")]                  # the exact rows built inside it are not its work
    assert f16["stage_s"] == 30.0 - 8.0 and f16["nested_s"] == 8.0 and "less 8.0 s" in f16["work"]
    assert score["nested_s"] == 0
    assert "reference's" in rows[("gguf_f16", "free-running")]["reason"]
    assert "screened out" in rows[("gguf_q4_0", "free-running")]["reason"]
    assert "on hf, not a GGUF file" in rows[("original", "-")]["reason"]
    assert "no result file" in rows[("awq_w4", "-")]["reason"]
    assert json.loads((cfg.results_dir / "stage_costs.json").read_text())["rows"] == out["rows"]
    table = format_costs(out)
    assert "| gguf_q8_0 | scoring | 1,900 tokens read, 390 rows scored | 30.0 | 19.4 | 1.55 | 22.9 | 1.31 |" in table
    assert "| original | - | not costed: on hf, not a GGUF file" in table


def test_the_least_work_per_scored_row_grows_with_the_vocabulary_and_the_selection_of_the_top_k():
    small, large = extraction_seconds_per_row(4096, 64), extraction_seconds_per_row(65536, 64)
    assert 0 < small < large < extraction_seconds_per_row(65536, 64, select=True)


@pytest.mark.slow
def test_a_tiny_runs_stages_are_costed_by_the_real_llama_bench_and_batched_bench(tiny_cfg):
    """The tools run on the variant's own file with its stage's settings (a run of the tiny model's Q8_0)."""
    from pipeline.cli import run

    assert run(tiny_cfg("variant=gguf_q8_0")) == 0
    out = run_stage_costs(tiny_cfg("command=stage_costs", "run.variants=[gguf_q8_0]"))
    rows = {(r["variant"], r["stage"]): r for r in out["rows"]}
    assert set(rows) == {("gguf_q8_0", "free-running"), ("gguf_q8_0", "scoring"), ("reference smoke", "free-running"),
                         ("reference smoke", "log-probs")}
    assert all(r["status"] == "ok" for r in rows.values())
    score, free = rows[("gguf_q8_0", "scoring")], rows[("gguf_q8_0", "free-running")]
    assert score["tool_prompt_tokens_per_s"] > 0 and score["tokens_read"] > 0
    for suite in free["suites"].values():
        assert suite["tool_prefill_tokens_per_s"] > 0 and suite["tool_decode_tokens_per_s"] > 0
    assert all(r["stage_s"] > 0 and r["ratio"] > 0 for r in rows.values())
    assert score["settings"]["threads"] == free["settings"]["threads"] >= 1
    assert rows[("reference smoke", "log-probs")]["file"] == "model-f16.gguf"
    # llama-perplexity on the same file: a chunk of 2 x n_batch tokens takes longer than prompt processing of as
    # many tokens (it computes n_batch output rows), and the engine's figure with every scored row is the larger
    ppl = score["perplexity"]
    assert ppl["chunk_tokens"] == 2 * score["settings"]["n_batch"] and ppl["chunk_rows"] == score["settings"]["n_batch"]
    assert ppl["chunk_s"] > 0 and ppl["prompt_s"] > 0 and ppl["row_s"] >= 0
    assert score["engine_rows_s"] >= score["tokens_read"] / score["tool_prompt_tokens_per_s"]
