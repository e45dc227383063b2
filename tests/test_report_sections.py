"""The report's content on hand-built summaries (no model runs): the schema check in build_summary, the tables'
labels and formats from the metric catalogue, and the multi-turn tables decided from the data."""

import re

import pytest

from pipeline.config.summary_contract import BY_NAME, METRICS, SCHEMA_VERSION, validate_summary
from pipeline.infra.errors import ConfigError
from pipeline.report.html import render_html
from pipeline.report.markdown import render_markdown
from pipeline.report.sections import report_sections
from pipeline.report.tables import main_table, multi_turn_suites, speed_table
from pipeline.report.cells import metric_head


def _iv(est, spread=0.1):
    return {"estimate": est, "low": est * (1 - spread) if est > 0 else est - spread,
            "high": est * (1 + spread) if est > 0 else est + spread, "level": 0.95, "units": 4}


def ok_variant(kld: float, tps: float, rss: float, turns: dict | None = None, recall: bool = False) -> dict:
    """A summary entry shaped like aggregate.variant_summary's, numbers made up."""
    drift = {"kld_mean": kld, "kld_median": kld / 2, "kld_p90": kld * 2, "kld_p99": kld * 4, "kld_p99_9": kld * 6, "kld_max": kld * 8, "kld_stored_exact_ratio": 0.99,
             "top1_agreement": 1 - kld, "delta_nll": kld / 3, "delta_p_mean": -kld / 10, "delta_p_rms": kld / 5,
             "tail_mass_mean": 0.01, "scored_tokens": 500,
             "pass_rate": 0.75, "flip_rate": 0.125}
    assert set(drift) == {m.name for m in METRICS if m.section == "drift"}
    turns = turns if turns is not None else {"smoke:1": {"mean": kld, "n": 10}}
    return {
        "status": "ok", "reason": None, "description": None, "runtime": "hf", "kernel": "torch", "runtime_info": {},
        "no_native_kernel": None,
        "drift": drift,
        "intervals": {"kld_mean": _iv(kld), "top1_agreement": _iv(1 - kld, 0.01), "delta_nll": _iv(kld / 3),
                      "pass_rate": _iv(0.75), "pass_rate_delta": _iv(-0.01, 0.03), "flip_rate": _iv(0.125),
                      "decode_tokens_per_s": _iv(tps), "peak_rss_mb": _iv(rss, 0.02)},
        "speed_trials": {"rounds": 6, "values": {"decode_tokens_per_s": [tps * f for f in (0.9, 1.0, 1.1, 0.95, 1.05, 1.0)],
                                                 "peak_rss_mb": [rss] * 6}, "failed": []},
        "drift_detail": {"kld_by_position": {"0-127": {"mean": kld, "n": 300}, "128-255": {"mean": kld * 2, "n": 200}},
                         "kld_by_turn": turns, "kld_by_suite": {},
                         "kld_percentiles": {"99.9": kld * 6, "99": kld * 4, "90": kld * 2, "50": kld / 2, "10": 0.0,
                                             "5": 0.0, "1": 0.0},
                         "delta_p": {"mean": -kld / 10, "rms": kld / 5, "min": -0.5, "max": 0.2, "n": 500,
                                     "percentiles": {"99": 0.1, "50": 0.0, "1": -0.3}}},
        "power": {"smoke": {"conversations": 4, "checks": 8, "reference_pass_rate": 0.875, "mde_pass_rate": 0.6,
                            "mde_kld_ratio": 2.5}},
        "free_running": {"checks": 8, "pass_rate": 0.75, "reference_pass_rate": 0.875, "pass_to_fail": 1,
                         "fail_to_pass": 0, "mcnemar_p": 1.0, "mcnemar_p_adjusted": 1.0, "chrf_mean": 81.5, "replies": 4,
                         "degenerate_replies": 0, "by_suite": {}, "source": "hf",
                         "conversation_test": {"conversations": 4, "mean_difference": -0.125, "p": 0.5,
                                               "test": "sign-flip"}},
        "recall": ({"recall": 0.8, "documents": 3, "by_depth": {
            d: {"recall": r, "kld_mean": kld * (i + 1), "flips": 0}
            for i, (d, r) in enumerate((("0.1", 1.0), ("0.5", 0.75), ("0.9", 0.5)))},
            "by_length": {"512": {"recall": 0.8}}} if recall else None),
        "deployment": None,
        "speed": {"ttft_s": 0.0421, "prefill_tokens_per_s": 950.0, "decode_tokens_per_s": tps, "itl_p50_s": 1 / tps,
                  "itl_p99_s": 1.5 / tps, "prompt_tokens": 64, "decode_tokens": 32, "repeats": 1, "cpu_noise": 0.02,
                  "trials": 3, "noisy_trials": 0, "load_s": 0.4},
        "memory": {"artifact_bytes": int(rss * 2**19), "peak_rss_mb": rss, "load_peak_rss_mb": rss * 1.5,
                   "steady_rss_mb": rss * 0.9, "kv_bytes_per_token": 4096.0,
                   "kv_bytes_per_token_reported": 4100.0, "kv_reported_source": "hf cache tensors",
                   "kv_cache": "float32", "kv_formula_gap": 0.001, "kv_gap_flagged": False,
                   "kv_formula_at_report": 4096.0, "kv_report_context": 96},
        "artifact": {"path": "/x", "format": "safetensors", "gguf_type": None, "tensor_types": {"F32": 3},
                     "group_size": None, "quantize_settings": None, "quantize_wall_s": 1.0,
                     "quantize_peak_rss_mb": 100.0},
        "paths": {"teacher_forced": "hf (torch)", "speed_memory": "hf (torch), fresh process", "free_running": "hf",
                  "dequantized_check": None},
        "roofline": {"bytes_per_token": 8 * 2**20, "share": 0.4, "ceiling_tokens_per_s": 500.0},
        "capacity": {"weights_bytes": 8 * 2**20, "overhead_bytes": 2**28, "max_sequences": {"16": 12}},
    }


def make_summary(variants: dict, history_run: str = "smoke") -> dict:
    import dataclasses

    from pipeline.config.commands import DecisionConfig
    from pipeline.decide.recommendation import decide

    names = [n for n, v in variants.items() if v["status"] == "ok"]
    noise = {"control": names[0] if names else None, "rounds": 6, "alpha": 0.05, "test": "sign-flip",
             "figures": {"decode_tokens_per_s": {"ratio": 1.01, "low": 0.95, "high": 1.07, "rounds": 6,
                                                 "p": 0.75, "tied": True, "floor": 0.07}}}
    return {
        "schema_version": SCHEMA_VERSION, "created_unix": 0.0,
        "run": {"name": history_run, "profile": "smoke", "suites": ["smoke"], "threads": 2, "device": "cpu"},
        "model": {"name": "hand", "source": "hand/built", "origin": "hand-built test summary", "architecture": "llama",
                  "params": 3.5e6, "layers": 2, "attention_heads": 4, "kv_heads": 2, "head_dim": 16,
                  "vocab_size": 49152, "context_length": 2048},
        "reference": {"runtime": "hf", "top_k": 32, "parity": None},
        "variants": variants,
        "recommendation": decide(variants, DecisionConfig(max_kld_mean=0.1), noise),
        "decision_config": dataclasses.asdict(DecisionConfig(max_kld_mean=0.1)),
        "capacity": {"memory_budget_gb": [16], "context_tokens": 4096, "headroom": 0.2},
        "bandwidth": {"bytes_per_s": 2e10, "method": "numpy copy"},
        "speed_noise": noise,
        "speed_protocol": {"rounds": 3, "order": [], "prompt_tokens": 64, "decode_tokens": 32, "repeats": 1,
                           "warmup": 1, "max_cpu_noise": 0.15},
        "versions": {"torch": "0"}, "hardware": {"cpu": "test cpu", "cores": 2},
    }


def skipped(reason="not evaluated in this run (no result file)"):
    return {"status": "skipped", "reason": reason, "runtime": None, "description": None}


def three_variants(turns: dict[str, dict] | None = None, recall: bool = False) -> dict:
    turns = turns or {}
    return make_summary({
        "original": ok_variant(0.0, 50.0, 400.0, turns.get("original"), recall),
        "q8": ok_variant(0.002, 80.0, 250.0, turns.get("q8"), recall),
        "awq": skipped(),
        "q4": ok_variant(0.03, 120.0, 180.0, turns.get("q4"), recall),
    })


def _turns(kld, **suites):
    """kld_by_turn for suites given as name=number of turns."""
    return {f"{s}:{t}": {"mean": kld * t, "n": 5} for s, n in suites.items() for t in range(1, n + 1)}


# ------------------------------------------------------------------------------------------ schema


def test_hand_built_summary_matches_the_published_schema():
    validate_summary(three_variants())
    broken = three_variants()
    del broken["variants"]["q8"]["intervals"]
    with pytest.raises(ConfigError, match="variants/q8"):
        validate_summary(broken)


def test_every_committed_summary_and_the_nightly_baseline_still_match_the_contract():
    """The nightly gate validates the committed baseline against today's schema: a field added to the contract
    must not make it unreadable (it did once: two descriptive KV fields made required failed the first night on a
    fresh clone with exit 2). A metric the gate reads stays required."""
    import json

    from tests.conftest import PROJECT_ROOT

    paths = sorted((PROJECT_ROOT / "results").glob("*/*/summary.json")) + sorted(
        (PROJECT_ROOT / "results").glob("*/baseline/*/summary.json"))
    assert any("baseline" in str(p) for p in paths)
    for path in paths:
        summary = json.loads(path.read_text())
        if summary.get("schema_version") == SCHEMA_VERSION:
            validate_summary(summary, str(path))
    broken = three_variants()
    del broken["variants"]["q8"]["memory"]["kv_bytes_per_token"]
    with pytest.raises(ConfigError, match="variants/q8"):
        validate_summary(broken)


def test_build_summary_validates_before_returning(tmp_path, monkeypatch):
    import pipeline.decide.summary as mod
    from tests.conftest import compose

    cfg = compose(["model.source=/nonexistent", "model.name=hand", "profile=smoke", "run.suites=[smoke]",
                   f"paths.artifacts={tmp_path / 'a'}", f"paths.results={tmp_path / 'r'}", "command=report",
                   "run.variants=[original,q8,awq]"])
    entries = {"original": ok_variant(0.0, 50.0, 400.0), "q8": ok_variant(0.002, 80.0, 250.0), "awq": skipped()}
    monkeypatch.setattr(mod, "load_result", lambda cfg, name: None if name == "awq" else
                        {"status": "ok", "name": name, "model": {"facts": {"origin": "hand"}}})
    monkeypatch.setattr(mod, "variant_summary", lambda r, *a: dict(entries[r["name"]]) if r["status"] == "ok"
                        else dict(entries["awq"]))
    monkeypatch.setattr(mod, "capacity_plan", lambda v, facts, cap, latent=False: {"max_sequences": {}})
    monkeypatch.setattr("pipeline.instruments.bandwidth.load_bandwidth",
                        lambda cfg: {"bytes_per_s": 1e10, "method": "test"})
    summary = mod.build_summary(cfg)
    assert list(summary["variants"]) == ["original", "q8", "awq"]
    validate_summary(summary)
    entries["q8"] = {k: v for k, v in entries["q8"].items() if k != "free_running"}
    with pytest.raises(ConfigError, match="at variants/q8: "):
        mod.build_summary(cfg)


def test_the_report_states_how_free_running_replies_were_decoded(tmp_path):
    s = three_variants()
    assert "greedy (argmax)" in render_markdown(s, {})       # a summary from before run.decoding: plain greedy
    s["run"]["decoding"] = {"repeat_penalty": 1.1, "repeat_last_n": 64, "repeat_scope": "reply"}
    assert "repetition penalty of 1.1 on the reply's last 64 tokens" in render_markdown(s, {})
    assert "repetition penalty of 1.1 on the reply" in render_html(s, tmp_path, {}, [])   # ' is escaped there


def test_the_run_time_table_names_the_short_sweep_and_lists_make_loads_sweep_outside_the_total(tmp_path):
    from pipeline.decide.stage_times import other_sweeps
    from pipeline.infra.stage_cache import run_stage
    from pipeline.infra.files import write_json

    run = tmp_path / "run"
    for name, body in (("load", {"profile": "short", "trials_wall_s": 600.0}),
                       ("load-full", {"profile": "full", "trials_wall_s": 14040.0}),
                       ("load-wide", {"profile": "wide"})):       # a sweep from before trial times were kept
        run_stage("load", run / name, {"n": name}, lambda tmp, body=body: write_json(tmp / "load.json", body))
    (run / "load-full-logs").mkdir()
    sweeps = other_sweeps(run)
    assert set(sweeps) == {"full", "wide"} and sweeps["full"] == {"s": 14040.0, "covers": "trials"}
    assert sweeps["wide"]["covers"] == "last sitting" and sweeps["wide"]["s"] >= 0
    s = three_variants()
    s["stage_times"] = {"references_s": {"smoke": 60.0}, "variants_s": {"q8": {"free_running": 30.0, "scoring": 30.0}},
                        "run_s": {"speed": 120.0, "load": 600.0}, "total_s": 840.0, "other_sweeps": sweeps}
    md = render_markdown(s, {})
    assert "| load stage: short sweep of `make compare` (all variants) | 10.0 |" in md
    total, full = md.index("| **total** | **14.0** |"), md.index("full sweep of `make load`")
    assert total < full and "every sitting) | 234.0 |" in md[full:]
    assert "kept no trial times) | 0.0 |" in md[full:]


# ------------------------------------------------------------------------------------------ tables


def test_main_and_speed_tables_take_labels_and_formats_from_the_catalogue():
    s = three_variants()
    head, rows = main_table(s)
    for name in ("kld_mean", "kld_p99", "top1_agreement", "delta_nll", "pass_rate", "flip_rate"):
        m = BY_NAME[name]
        assert metric_head(m, bool(m.interval)) in head and m.label in metric_head(m), name
    assert len(head) == 13 and all(len(r) == len(head) for r in rows)
    q8 = rows[[r[0] for r in rows].index("q8")]
    assert q8[head.index(metric_head(BY_NAME["top1_agreement"], True))] == "99.8% [98.8%, 100.8%]"   # ".1%"
    assert q8[head.index(metric_head(BY_NAME["kld_mean"], True))] == "0.0020 [0.0018, 0.0022]"     # ".4f"
    assert q8[head.index(metric_head(BY_NAME["kld_p99"]))] == "0.008"                              # ".3f"
    assert rows[[r[0] for r in rows].index("awq")][1] == "skipped"
    head, rows = speed_table(s)
    assert [r[0] for r in rows] == ["original", "q8", "q4"]
    for name in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s", "itl_p99_s", "artifact_bytes",
                 "peak_rss_mb", "kv_bytes_per_token"):
        m = BY_NAME[name]
        col = head.index(metric_head(m, bool(m.interval)))
        cell = format(s["variants"]["q8"][m.section][name] * m.display_scale, m.fmt)
        iv = s["variants"]["q8"]["intervals"].get(m.interval or "")
        assert rows[1][col] == (cell if not iv else f"{cell} [{format(iv['low'] * m.display_scale, m.fmt)}, "
                                                    f"{format(iv['high'] * m.display_scale, m.fmt)}]"), name
    assert "TTFT s [CI]" in head and "decode tok/s [CI]" in head and "peak RSS MB [CI]" in head
    assert "ITL p50 ms [CI]" in head and "artifact size MiB" in head     # display units, not the summary's s and bytes


# ------------------------------------------------------------------------------------------ fix 1: multi-turn


def test_a_user_multi_turn_suite_gets_its_drift_by_turn_table():
    """Old code kept only suites literally named multi_turn: a user's support_chat got no by-turn table."""
    s = three_variants({n: _turns(k, smoke=1, support_chat=3) for n, k in (("q8", 0.01), ("q4", 0.05))})
    sections = {sid: blocks for sid, _, blocks in report_sections(s)}
    assert "by-turn" in sections
    tables = [b for b in sections["by-turn"] if isinstance(b, tuple)]
    assert len(tables) == 1 and tables[0][0] == ["variant", "1", "2", "3"]
    assert "support_chat" in sections["by-turn"][0]
    q4 = next(r for r in tables[0][1] if r[0] == "q4")
    assert q4[1:] == ["0.0500", "0.1000", "0.1500"]


def test_every_multi_turn_suite_is_shown_and_single_turn_suites_are_not():
    turns = {"q8": _turns(0.01, multi_turn=4, long_output=1, support_chat=2),
             "q4": {**_turns(0.05, multi_turn=2, long_output=1), "onboarding:1": {"mean": 0.1, "n": 3},
                    "onboarding:2": {"mean": 0.2, "n": 3}, "multi_turn_but_one:1": {"mean": 0.1, "n": 3}}}
    s = three_variants(turns)
    ok = {n: v for n, v in s["variants"].items() if v["status"] == "ok"}
    assert multi_turn_suites(ok) == {"multi_turn": [f"multi_turn:{t}" for t in range(1, 5)],
                                     "support_chat": ["support_chat:1", "support_chat:2"],
                                     "onboarding": ["onboarding:1", "onboarding:2"]}
    # one table per suite, after a line naming it; a variant without the suite shows dashes
    blocks = next(b for sid, _, b in report_sections(s) if sid == "by-turn")
    named = [re.search(r"`(.+?)`", b).group(1) for b in blocks if isinstance(b, str)]
    assert named == ["multi_turn", "support_chat", "onboarding"]
    tables = [b for b in blocks if isinstance(b, tuple)]
    assert [t[0][1:] for t in tables] == [["1", "2", "3", "4"], ["1", "2"], ["1", "2"]]
    assert next(r for r in tables[0][1] if r[0] == "q4")[1:] == ["0.0500", "0.1000", "–", "–"]
    md = render_markdown(s, {})
    assert "Suite `support_chat`, by turn:" in md and "long_output" not in md and "multi_turn_but_one" not in md


def test_a_suite_named_multi_turn_with_one_turn_is_not_multi_turn():
    s = three_variants({"q8": _turns(0.01, multi_turn=1)})
    assert "by-turn" not in [sid for sid, _, _ in report_sections(s)]


def test_markdown_and_html_render_the_by_turn_tables(tmp_path):
    s = three_variants({"q8": _turns(0.01, support_chat=2), "q4": _turns(0.05, support_chat=2)})
    page = render_html(s, tmp_path, {}, [])
    section = re.search(r"<section id='by-turn'>(.*?)</section>", page, re.S).group(1)
    assert "<code>support_chat</code>" in section and section.count("<table") == 1
    assert "<td>0.1000</td>" in section
    md = render_markdown(s, {})
    assert "## Multi-turn drift by turn (mean KLD)" in md and "| q4 | 0.0500 | 0.1000 |" in md


def test_the_bits_section_flags_fallback_tensors_and_states_the_importance_matrix_effect():
    s = three_variants()
    s["variants"]["q8"]["artifact"].update(bits_per_weight=6.17, gguf_type="Q4_K_M",
                                           fallback_tensors={"Q5_0": 166, "Q8_0": 15})
    s["variants"]["q4"]["artifact"].update(bits_per_weight=6.17, gguf_type="Q4_K_M", imatrix={"chunks": 24, "ctx": 512})
    s["imatrix_effects"] = [{"type": "Q4_K_M", "plain": "q8", "imatrix": "q4", "kld_plain": 0.029, "kld_imatrix": 0.025,
                             "delta": -0.004, "low": -0.006, "high": -0.002, "relative": -0.138, "p_value": 0.001,
                             "significant": True}]
    md = render_markdown(s, {})
    assert "## Bits per weight and the importance matrix" in md
    assert "`q8`: 181 tensors are not Q4_K_M but Q5_0 (166), Q8_0 (15)" in md
    assert "| q4 | Q4_K_M | 6.17 |" in md and "24 chunks × 512 tokens" in md
    assert "-0.0040 [-0.0060, -0.0020]" in md and "yes: lower with the importance matrix" in md
    s["imatrix_effects"][0].update(low=-0.006, high=0.001, significant=False)
    assert "no (inside this run's resolution)" in render_markdown(s, {})


def test_the_committed_default_report_is_what_its_summary_renders():
    """results/<model>/quick/report.md is rendered from summary.json alone: the committed pair must agree line for
    line (the plots are placed where the committed report placed them). A change in the report code that moves a
    figure, a reason or a table shows here before it reaches a reader."""
    import json

    from pipeline.config.schema import PROJECT_ROOT

    runs = sorted((PROJECT_ROOT / "results").glob("*/quick/summary.json"))
    assert runs, "no committed default run under results/"
    for path in runs:
        committed = (path.parent / "report.md").read_text()
        plots = dict(re.findall(r"^!\[([^\]]+)\]\(([^)]+)\)$", committed, re.M))
        rendered = render_markdown(json.loads(path.read_text()), plots)
        assert rendered == committed, next(f"{path.parent}: line {i + 1}: {a!r} != {b!r}" for i, (a, b) in
                                           enumerate(zip(rendered.splitlines() + [""], committed.splitlines() + [""]))
                                           if a != b)


_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:%|×)?(?![\w])")


def reason_numbers_missing_from_tables(md: str) -> dict[str, list[str]]:
    """Every number the recommendation and the reasons of the ok variants state, that no table of the report shows
    (a reason that quotes a figure must quote one of the tables' own): {line: [missing numbers]}."""
    lines = md.splitlines()
    in_tables = {tok for line in lines if line.startswith("|") for tok in _NUMBER.findall(line)}
    reasons = [line for line in lines if line.startswith("**Ship `")]
    start = lines.index("Why the others lost:") if "Why the others lost:" in lines else len(lines)
    for line in lines[start + 1:]:
        if not line.strip():
            if reasons and len(reasons) > 1:
                break
            continue
        if not line.startswith("- `"):
            break
        reason = line.split(": ", 1)[1]
        if not reason.startswith(("skipped:", "failed:")):        # a variant that did not run quotes its error
            reasons.append(line)
    missing = {}
    for line in reasons:
        gone = [tok for tok in _NUMBER.findall(line.split(": ", 1)[1]) if tok not in in_tables]
        if gone:
            missing[line] = gone
    return missing


def test_every_number_a_reason_states_is_in_the_reports_tables():
    s = three_variants()
    s["variants"]["q4"]["drift"]["kld_mean"] = 0.2                  # fails the default limit
    s["variants"]["q4"]["intervals"]["kld_mean"] = _iv(0.2)
    from pipeline.config.commands import DecisionConfig
    from pipeline.decide.recommendation import decide

    s["recommendation"] = decide(s["variants"], DecisionConfig(max_kld_mean=0.1), s["speed_noise"])
    md = render_markdown(s, {})
    assert "Why the others lost:" in md and s["recommendation"]["variant"] == "q8"
    assert reason_numbers_missing_from_tables(md) == {}
    # the check can fail: a reason quoting a figure no table shows
    broken = md.replace("Why the others lost:\n\n- `", "Why the others lost:\n\n- `original`: decode 123.4 tok/s\n- `")
    assert reason_numbers_missing_from_tables(broken) == {"- `original`: decode 123.4 tok/s": ["123.4"]}


def test_every_number_a_reason_of_the_committed_report_states_is_in_its_tables():
    from pathlib import Path

    from pipeline.config.schema import PROJECT_ROOT

    for path in sorted((PROJECT_ROOT / "results").glob("*/quick/report.md")):
        assert reason_numbers_missing_from_tables(Path(path).read_text()) == {}, path


def test_the_speed_protocol_line_names_the_kept_probes_when_memory_held_only_some():
    from pipeline.report.sections import _speed_noise_block
    from pipeline.figures.speed_trials import WORKERS_KEPT, WORKERS_MIXED

    text = " ".join(map(str, _speed_noise_block({"speed_protocol": {"workers": WORKERS_MIXED, "kept_workers": ["a"],
                                                                       "rounds": 3}})))
    assert "loaded once for all rounds for a (as many as the measured memory held)" in text
    assert "a fresh process per trial for the others" in text
    kept = " ".join(map(str, _speed_noise_block({"speed_protocol": {"workers": WORKERS_KEPT, "rounds": 3}})))
    assert "each variant's own probe process, loaded once for all rounds" in kept


def test_the_speed_protocol_line_states_the_extra_rounds_and_why_they_stopped():
    from pipeline.report.sections import _speed_noise_block

    proto = {"rounds": 10, "extra_rounds": 31, "extra_labels": ["gguf_q4_0", "gguf_q8_0"], "extra_seconds": 312.0,
             "extra_stop": "41 rounds reach a 10% detectable regression at this run's spread"}
    text = " ".join(map(str, _speed_noise_block({"speed_protocol": proto})))
    assert ("Then 31 more rounds of gguf_q4_0, gguf_q8_0 only (5.2 min), so that the nightly gate can see a small "
            "slowdown against the other variants of their runtime: 41 rounds reach a 10% detectable regression") in text
    none = {"rounds": 10, "extra_rounds": 0, "extra_stop": "10 rounds reach a 10% detectable regression at this "
                                                           "run's spread"}
    assert "No extra rounds of the cheap runtimes: 10 rounds reach" in " ".join(
        map(str, _speed_noise_block({"speed_protocol": none})))
    assert "more rounds" not in " ".join(map(str, _speed_noise_block({"speed_protocol": {"rounds": 10}})))
