"""The report's tables of figures: drift and checks, speed, flips per suite, the decision, recall, the capacity
plan, drift by turn and position, llama-perplexity-style statistics, the stored KLD's exactness and the statistical
power."""

from __future__ import annotations

from pipeline.config.summary_contract import BY_NAME
from pipeline.report.cells import (NO_KERNEL_MARK, _ci, _fmt, _md_escape, metric_cell, metric_head,
                                   variant_label)


# The accuracy table's catalogue columns, in order (the others are free-running counts, not catalogue metrics).
_MAIN_METRICS = ("kld_mean", "kld_p99", "top1_agreement", "delta_nll", "pass_rate", "flip_rate")
_SPEED_METRICS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s", "itl_p99_s")
_MEMORY_METRICS = ("artifact_bytes", "peak_rss_mb", "load_peak_rss_mb", "steady_rss_mb")


def _p_pair(raw: float | None, adjusted: float | None) -> str:
    """A p-value beside its family-wise adjusted value."""
    return _fmt(raw, ".3f") + (f" ({adjusted:.3f})" if adjusted is not None else "")


def main_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Accuracy and drift, every difference with its 95 % interval; labels and formats from the catalogue."""
    ms = [BY_NAME[n] for n in _MAIN_METRICS]
    pass_rate = BY_NAME["pass_rate"]
    method = (summary.get("recommendation") or {}).get("multiple_comparisons") or "holm"
    head = (["variant", "status"] + [metric_head(m, bool(m.interval)) for m in ms]
            + [f"Δ{pass_rate.label} vs original [CI]", "flips p→f / f→p", f"McNemar p ({method})", "chrF",
               "degenerate"])
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            rows.append([name, v["status"]] + [""] * (len(head) - 2))
            continue
        fr, iv = v["free_running"], v.get("intervals") or {}
        rows.append([variant_label(name, v), "ok"] + [metric_cell(v, m) for m in ms] + [
            _ci(iv.get("pass_rate_delta"), "+" + pass_rate.fmt.lstrip("+")),
            f"{fr['pass_to_fail']} / {fr['fail_to_pass']} of {fr['checks']}",
            _p_pair(fr["mcnemar_p"], fr.get("mcnemar_p_adjusted")), _fmt(fr["chrf_mean"], ".1f"),
            f"{fr.get('degenerate_replies', 0)}/{fr['replies']}",
        ])
    return head, rows


def same_runtime_table(summary: dict) -> tuple | None:
    """The variants whose replies came from another runtime than the reference's: their checks against the original's
    own replies on that runtime, beside the runtime switch's own floor (the original there against the reference)."""
    rows = []
    method = (summary.get("recommendation") or {}).get("multiple_comparisons") or "holm"
    for runtime, f in (summary.get("runtime_floor") or {}).items():
        t = f.get("conversation_test") or {}
        rows.append([f"the original on {runtime} (runtime switch floor)", "reference",
                     _fmt(f["pass_rate"], ".0%"), "–", f"{f['pass_to_fail']} / {f['fail_to_pass']} of {f['checks']}",
                     _fmt(f["mcnemar_p"], ".3f"), _fmt(t.get("p"), ".3f")])
    for name, v in summary["variants"].items():
        sr = (v.get("free_running") or {}).get("same_runtime") if v.get("status") == "ok" else None
        if not sr:
            continue
        own, iv = sr["vs_original_same_runtime"], v.get("intervals_same_runtime") or {}
        t = own.get("conversation_test") or {}
        rows.append([variant_label(name, v), f"the original on {sr['runtime']}", _fmt(own["pass_rate"], ".0%"),
                     _ci(iv.get("flip_rate"), ".1%"), f"{own['pass_to_fail']} / {own['fail_to_pass']} of {own['checks']}",
                     _p_pair(own["mcnemar_p"], own.get("mcnemar_p_adjusted")), _fmt(t.get("p"), ".3f")])
    if not rows:
        return None
    return (["replies of", "checked against", "pass rate", "flip rate [CI]", "flips p→f / f→p",
             f"McNemar p ({method})", "conversation-level p"], rows)


def speed_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Speed, roofline and memory; catalogue metrics with the catalogue's labels and formats. A variant measured on
    no native kernel of this device shows none of them (its figures are another model's)."""
    speed = [BY_NAME[n] for n in _SPEED_METRICS]
    memory = [BY_NAME[n] for n in _MEMORY_METRICS]
    kv = BY_NAME["kv_bytes_per_token"]
    head = (["variant"] + [metric_head(m, bool(m.interval)) for m in speed]
            + ["bytes/token MiB", "BW share", "decode ceiling tok/s"]
            + [metric_head(m, bool(m.interval)) for m in memory] + ["KV cache", metric_head(kv)])
    on_gpu = any((v.get("device_memory") or {}).get("peak_mb") is not None for v in summary["variants"].values())
    if on_gpu:
        head.append("device peak MB [95 % CI]")
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            continue
        s, m, rf = v["speed"], v["memory"], v.get("roofline") or {}
        noisy = f" ({s['noisy_trials']} noisy trials)" if s.get("noisy_trials") else ""
        label = variant_label(name, v, speed=True) + noisy
        if v.get("no_native_kernel"):
            hidden = f"– {NO_KERNEL_MARK}"
            rows.append([label] + [hidden] * (len(speed) + 3) + [metric_cell(v, memory[0])]
                        + [hidden] * (len(memory) - 1) + [str(m.get("kv_cache") or ""), metric_cell(v, kv)]
                        + ([hidden] if on_gpu else []))
            continue
        rows.append([label] + [metric_cell(v, x) for x in speed] + [
            _fmt(rf.get("bytes_per_token") and rf["bytes_per_token"] / 2**20, ".1f"), _fmt(rf.get("share"), ".0%"),
            _fmt(rf.get("ceiling_tokens_per_s"), ".0f")] + [metric_cell(v, x) for x in memory] + [
            str(m.get("kv_cache") or ""),
            metric_cell(v, kv) + ("" if not m["kv_gap_flagged"] else " ⚠"),
        ] + ([_ci((v.get("intervals") or {}).get("device_peak_mb"), ".0f")] if on_gpu else []))
    return head, rows


def suite_flip_table(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok" or name == "original":
            continue
        for suite, f in (v["free_running"].get("by_suite") or {}).items():
            rows.append([variant_label(name, v), suite, str(f["checks"]), _fmt(f["reference_pass_rate"], ".0%"),
                         _fmt(f["pass_rate"], ".0%"), str(f["pass_to_fail"]), str(f["fail_to_pass"]),
                         _fmt(f["mcnemar_p"], ".3f"), _fmt((f.get("conversation_test") or {}).get("p"), ".3f")])
    if not rows:
        return None
    return ["variant", "suite", "checks", "original pass", "variant pass", "pass→fail", "fail→pass",
            "exact McNemar p", "conversation-level p"], rows


# ------------------------------------------------------------------------------------------ sections

def _recall_section(ok: dict) -> tuple | None:
    with_recall = {n: v["recall"] for n, v in ok.items() if v.get("recall")}
    if not with_recall:
        return None
    depths = sorted({d for r in with_recall.values() for d in r["by_depth"]}, key=float)
    lengths = sorted({d for r in with_recall.values() for d in r["by_length"]}, key=float)
    rows = [[n, _fmt(r["recall"], ".0%")] + [_fmt(r["by_depth"].get(d, {}).get("recall"), ".0%") for d in depths]
            + [str(sum(g["flips"] for g in r["by_depth"].values()))] for n, r in with_recall.items()]
    kld_rows = [[n] + [_fmt(r["by_depth"].get(d, {}).get("kld_mean"), ".4f") for d in depths]
                for n, r in with_recall.items()]
    len_rows = [[n] + [_fmt(r["by_length"].get(k, {}).get("recall"), ".0%") for k in lengths]
                for n, r in with_recall.items()]
    docs = next(iter(with_recall.values()))["documents"]
    return ("recall", "Long-context recall", [
        f"{docs} generated business documents, one fact (invoice number, amount, date or name) planted at each depth "
        "among look-alike distractors; the question at the end is checked exactly. Flips: answers whose outcome "
        "differs from the original's. KV-cache quantization damages this kind of precise recall first.",
        (["variant", "recall"] + [f"depth {float(d):.0%}" for d in depths] + ["flips"], rows),
        "Mean KLD on the answer tokens by depth (teacher-forced on the original's answer):",
        (["variant"] + [f"{float(d):.0%}" for d in depths], kld_rows),
        "Recall by document length (tokens):",
        (["variant"] + lengths, len_rows),
    ])


def _capacity_section(summary: dict, ok: dict) -> tuple | None:
    if not ok:
        return None
    cap = summary["capacity"]
    budgets = [str(b) for b in cap["memory_budget_gb"]]
    device_budget = next((v["capacity"]["device_budget_gb"] for v in ok.values()
                          if (v.get("capacity") or {}).get("device_budget_gb")), None)
    if device_budget is not None and str(device_budget) not in budgets:
        budgets.append(str(device_budget))
    kv_rows, cap_rows, big_rows = [], [], []
    for n, v in ok.items():
        m = v["memory"]
        at_report = m.get("kv_formula_at_report")
        kv_rows.append([n, str(m.get("kv_cache") or ""), _fmt(m["kv_bytes_per_token"], ",.0f"),
                        (_fmt(at_report, ",.0f") + (f" at {m['kv_report_context']:,}" if m.get("kv_report_context")
                                                    else "")) if at_report is not None else "–",
                        _fmt(m["kv_bytes_per_token_reported"], ",.0f"),
                        _fmt(m["kv_formula_gap"], ".1%") + (" ⚠ over 10%" if m["kv_gap_flagged"] else ""),
                        str(m.get("kv_reported_source") or "")])
        plan = v.get("capacity") or {}
        cap_rows.append([n, _fmt(plan.get("weights_bytes", 0) / 2**20, ",.0f"),
                         _fmt(plan.get("overhead_bytes", 0) / 2**20, ",.0f"), str(plan.get("memory_basis") or "")]
                        + [f"{plan['max_sequences'][b]:,}" if b in plan.get("max_sequences", {}) else "–"
                           for b in budgets])
        if plan.get("scaled"):
            sc = plan["scaled"]
            big_rows.append([n, _fmt(sc["weights_bytes"] / 1e9, ",.1f"), _fmt(sc["kv_bytes_per_token"] / 1024, ",.0f")]
                            + [f"{sc['max_sequences'][b]:,}" if b in sc["max_sequences"] else "–" for b in budgets])
    blocks = [
        "KV bytes per token: the formula 2 × layers × KV heads × head dim × bytes per element (q8_0: 34/32, with "
        "its block scale; hf int8: 1 + 2/head_dim, with the per-token fp16 scale and zero point of V) against what "
        "the runtime reports (llama.cpp: its KV buffer size from its log ÷ cells; hf: the cache tensors it holds "
        "÷ quantized tokens, the full-precision residual window excluded). The gap compares the report with the "
        "formula at the context the report counts (sliding-window layers keep at most their window there); a gap "
        "over 10 % is flagged.",
        (["variant", "KV cache", "formula B/token", "formula at the report's context (tokens)", "reported B/token",
          "gap", "reported by"], kv_rows),
        f"Concurrent sequences of {cap['context_tokens']:,} tokens that fit each memory budget with "
        f"{cap['headroom']:.0%} headroom: (budget × (1 − headroom) − weights − runtime overhead) ÷ (KV bytes per "
        "token × context). Overhead is measured: the probe's peak memory minus weights and the KV it held — the "
        "device's (NVML per process, torch's reserved peak) where the variant ran on a GPU, whose own memory is then "
        "a budget too, else the host's RSS (on a CPU mostly the runtime's libraries).",
        (["variant", "weights MiB", "overhead MiB", "measured on"]
         + [f"{b} GB" + (" (this device)" if b == str(device_budget) else "") for b in budgets], cap_rows),
    ]
    if big_rows:
        sc = next(v["capacity"]["scaled"] for v in ok.values() if (v.get("capacity") or {}).get("scaled"))
        blocks += [f"The same plan for a {sc['params_b']:g}B-parameter model ({sc['layers']} layers, {sc['kv_heads']} "
                   f"KV heads, head dim {sc['head_dim']}: capacity.params_b/layers/kv_heads/head_dim): weights scale "
                   "by each variant's measured bytes per parameter, KV by that geometry at each variant's bytes per "
                   "element.",
                   (["variant", "weights GB", "KV KiB/token"] + [f"{b} GB" for b in budgets], big_rows)]
    return ("capacity", "KV cache and capacity", blocks)


def multi_turn_suites(ok: dict) -> dict[str, list[str]]:
    """The multi-turn suites and their turn keys (``"SUITE:N"``, N from 1), in turn order.

    Decided from the data: a suite is multi-turn when some variant has a ``kld_by_turn`` key for its turn 2 or
    later, whatever the suite is called. Suites in the order they first appear; every turn any variant has."""
    turns: dict[str, set[int]] = {}
    for v in ok.values():
        for key in ((v.get("drift_detail") or {}).get("kld_by_turn") or {}):
            suite, _, n = key.rpartition(":")
            if suite and n.isdigit():
                turns.setdefault(suite, set()).add(int(n))
    return {s: [f"{s}:{n}" for n in sorted(ns)] for s, ns in turns.items() if max(ns) >= 2}


def _drift_sections(ok: dict) -> list[tuple]:
    out = []
    buckets = sorted({b for v in ok.values() for b in v["drift_detail"]["kld_by_position"]},
                     key=lambda b: int(b.split("-")[0]))
    if buckets:
        rows = [[n] + [_fmt(v["drift_detail"]["kld_by_position"].get(b, {}).get("mean"), ".4f") for b in buckets]
                for n, v in ok.items()]
        out.append(("by-position", "Drift by output position (mean KLD)", [(["variant"] + buckets, rows)]))
    suites = multi_turn_suites(ok)
    if suites:
        blocks: list = []
        for suite, turns in suites.items():      # one table per multi-turn suite: columns are its turns
            rows = [[n] + [_fmt(v["drift_detail"]["kld_by_turn"].get(t, {}).get("mean"), ".4f") for t in turns]
                    for n, v in ok.items()]
            blocks += [f"Suite `{_md_escape(suite)}`, by turn:", (["variant"] + [t.rpartition(":")[2] for t in turns],
                                                                   rows)]
        out.append(("by-turn", "Multi-turn drift by turn (mean KLD)", blocks))
    return out


def _llama_stats_section(ok: dict) -> tuple | None:
    """The statistics llama.cpp's perplexity tool prints with --kl-divergence, from the stored per-token data."""
    rows = []
    for n, v in ok.items():
        d = v.get("drift_detail") or {}
        kp, dp = d.get("kld_percentiles"), d.get("delta_p")
        if not kp or not dp:
            continue
        pp = dp.get("percentiles") or {}
        rows.append([n, _fmt(v["drift"]["kld_mean"], ".5f")] + [_fmt(kp.get(q), ".5f") for q in ("99.9", "99", "90", "50",
                                                                                                   "10", "5", "1")]
                    + [_fmt(dp["mean"] * 100, "+.3f"), _fmt(dp["rms"] * 100, ".3f")]
                    + [_fmt((pp.get(q) or 0) * 100 if q in pp else None, "+.3f") for q in ("99", "1")]
                    + [_fmt(v["drift"]["top1_agreement"], ".2%"), _fmt(v["drift"].get("tail_mass_mean"), ".2%"),
                       _exactness_cell(d.get("kld_exactness"))])
    if not rows:
        return None
    return ("llama-stats", "KLD and Δp, as llama-perplexity reports them", [
        (["variant", "mean KLD", "99.9%", "99%", "90%", "median", "10%", "5%", "1%", "mean Δp %", "RMS Δp %",
          "Δp 99% %", "Δp 1% %", "same top", "ref. tail mass", "stored / exact KLD (sample)"], rows),
        "Percentiles of the per-token KLD and of Δp (the probability of the reference's next token under the "
        "variant minus under the original, in percentage points), as `llama-perplexity --kl-divergence` prints "
        "them; 'same top' is the top-1 agreement. Tail mass: the original's probability outside the stored "
        "top-K ids, which the stored KLD merges into one bucket (a lower bound of the full-vocabulary KLD) except where "
        "it exceeds `reference.exact_tail_mass`: there the original's whole distribution is kept and the KLD is "
        "exact. Stored / exact: every run recomputes, on evenly spaced positions of each suite's longest "
        "transcript, the exact full-vocabulary KLD (the original on transformers against the variant on its own "
        "runtime) beside the stored figure at the same positions; 1.000 means the stored figure is exact. 'Top-K "
        "only' is the ratio the one-bucket figure alone would read.",
        *([(["variant", "suite", "sampled tokens", "K", "exact rows", "stored KLD", "exact KLD", "stored / exact",
             "top-K only / exact", "suite tail mass"], ex_rows)] if (ex_rows := _exactness_rows(ok)) else [])])


def _exactness_rows(ok: dict) -> list[list[str]]:
    """Per variant and suite: the sample's stored and exact mean KLD, their ratio, and the suite's tail mass."""
    rows = []
    for n, v in ok.items():
        d = v.get("drift_detail") or {}
        for suite, e in (d.get("kld_exactness") or {}).items():
            if not e:
                continue
            tail = ((d.get("kld_by_suite") or {}).get(suite) or {}).get("tail_mass_mean")
            rows.append([n, suite, str(e["tokens"]), str(e.get("top_k", "")), str(e.get("exact_rows", 0)),
                         _fmt(e["kld_stored_mean"], ".5f"), _fmt(e["kld_exact_mean"], ".5f"), _fmt(e.get("ratio"), ".3f"),
                         _fmt(e.get("ratio_topk_only", e.get("ratio")), ".3f"), _fmt(tail, ".2%")])
    return rows


def _exactness_cell(ex: dict | None) -> str:
    from pipeline.decide.variant_summary import pooled_exactness

    pooled = pooled_exactness(ex)
    if not pooled or pooled["ratio"] is None:
        return "–"
    return f"{pooled['ratio']:.3f} ({pooled['exact_mean']:.4f} exact, {pooled['tokens']} tok)"


def _power_section(ok: dict) -> tuple | None:
    """Per suite, what 'no difference' is worth with this many conversations."""
    suites: dict = {}
    for v in ok.values():
        for suite, p in (v.get("power") or {}).items():
            g = suites.setdefault(suite, {"conversations": p.get("conversations"), "checks": p.get("checks"),
                                          "reference_pass_rate": p.get("reference_pass_rate"),
                                          "mde_pass_rate": p.get("mde_pass_rate"),
                                          "no_signal": p.get("no_signal_for_flips"), "kld": []})
            if p.get("mde_kld_ratio"):
                g["kld"].append(p["mde_kld_ratio"])
    if not suites:
        return None
    rows = []
    for suite, g in suites.items():
        kld = sorted(g["kld"])
        rows.append([suite, str(g["conversations"]), str(g["checks"] or "–"),
                     _fmt(g["reference_pass_rate"], ".0%") + (" ⚠ no signal for flips" if g["no_signal"] else ""),
                     _fmt(g["mde_pass_rate"], ".0%"), _fmt(kld[len(kld) // 2] if kld else None, ".2f") + "×"])
    return ("power", "What this run can detect", [
        (["suite", "conversations", "checks", "original pass rate", "smallest detectable pass-rate change",
          "smallest detectable mean-KLD ratio"], rows),
        "At 80 % power and 5 % two-sided, conversations as units (normal approximation): a pass-rate change or a "
        "ratio of two variants' mean KLD smaller than this is not distinguishable from no difference with this "
        "many conversations. A suite whose checks the original passes less than 20 % of the time is flagged: "
        "its flips are mostly a variant's lucky passes, not damage. The KLD figure is the median over variants "
        "of exp(2.80 × SD(log per-conversation "
        "mean KLD) × √(2/n)). Checks within a conversation are not independent, so beside the check-level exact "
        "McNemar test every variant also gets a conversation-level sign-flip permutation test on per-conversation "
        "pass-rate differences (shown; the decision judges the checks' non-inferiority on the pass-rate change's "
        "interval against `decision.max_pass_drop`)."])
