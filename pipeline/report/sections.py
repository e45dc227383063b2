"""The report's content, independent of its format: the tables and the sections that report.md and report.html
both render, with the shared cell formatting (``_fmt``, ``_ci``, ``_md_escape``).

The report is a list of sections; each is (id, title, blocks) and a block is a paragraph (str), a table
(head, rows), a bullet list (list of str) or a plot ({"plot": name, "file": png}).
"""

from __future__ import annotations

from pipeline.catalogue import BY_NAME, Metric, decoding_of, value

# Units a label may already carry in short form: "decode tok/s" needs no " tokens/s".
_UNIT_SHORT = {"tokens/s": "tok/s"}


def decoding_line(summary: dict) -> str:
    """How the free-running replies were decoded (a summary from before the setting existed: plain greedy)."""
    d = decoding_of(summary)
    if d["repeat_penalty"] == 1.0:
        return "Free-running replies: greedy (argmax), the same on every runtime."
    window = "the reply's" if d["repeat_scope"] == "reply" else "the prompt's and the reply's"
    return (f"Free-running replies: greedy with a repetition penalty of {d['repeat_penalty']:g} on {window} last "
            f"{d['repeat_last_n']} tokens (`runtime.repeat_*`), applied to the logits the same way on every runtime; "
            "teacher-forced KLD and top-1 agreement use the raw logits.")


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _md_escape(text: str) -> str:
    """Inert in Markdown tables and HTML renderers: no tags, no table breaks, no line breaks."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


def _ci(iv: dict | None, spec: str, scale: float = 1.0) -> str:
    if not iv or iv.get("estimate") is None:
        return "–"
    return (f"{format(iv['estimate'] * scale, spec)} [{format(iv['low'] * scale, spec)}, "
            f"{format(iv['high'] * scale, spec)}]")


def metric_head(m: Metric, interval: bool = False) -> str:
    """A column head from the catalogue: its label, its unit where the label does not already say it, and
    ``[CI]`` for a column that shows the 95 % interval."""
    unit = m.display_unit or _UNIT_SHORT.get(m.unit, m.unit)
    head = m.label if not unit or unit in m.label else f"{m.label} {unit}"
    return head + (" [CI]" if interval else "")


def metric_cell(variant: dict, m: Metric) -> str:
    """A catalogue metric of a variant in the catalogue's format, with its 95 % interval where it has one."""
    iv = (variant.get("intervals") or {}).get(m.interval) if m.interval else None
    if iv and iv.get("estimate") is not None:
        return _ci(iv, m.fmt, m.display_scale)
    x = value(variant, m.name)
    if m.integer and isinstance(x, float) and x.is_integer():
        x = int(x)
    return _fmt(x if x is None or m.display_scale == 1 else x * m.display_scale, m.fmt)


# The accuracy table's catalogue columns, in order (the others are free-running counts, not catalogue metrics).
_MAIN_METRICS = ("kld_mean", "kld_p99", "top1_agreement", "delta_nll", "pass_rate")
_SPEED_METRICS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s", "itl_p99_s")
_MEMORY_METRICS = ("artifact_bytes", "peak_rss_mb")


def main_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Accuracy and drift, every difference with its 95 % interval; labels and formats from the catalogue."""
    ms = [BY_NAME[n] for n in _MAIN_METRICS]
    pass_rate = BY_NAME["pass_rate"]
    head = (["variant", "status"] + [metric_head(m, bool(m.interval)) for m in ms]
            + [f"Δ{pass_rate.label} vs original [CI]", "flips p→f / f→p", "McNemar p", "chrF", "degenerate"])
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            rows.append([name, v["status"]] + [""] * (len(head) - 2))
            continue
        fr, iv = v["free_running"], v.get("intervals") or {}
        rows.append([name, "ok"] + [metric_cell(v, m) for m in ms] + [
            _ci(iv.get("pass_rate_delta"), "+" + pass_rate.fmt.lstrip("+")),
            f"{fr['pass_to_fail']} / {fr['fail_to_pass']} of {fr['checks']}",
            _fmt(fr["mcnemar_p"], ".2f"), _fmt(fr["chrf_mean"], ".1f"),
            f"{fr.get('degenerate_replies', 0)}/{fr['replies']}",
        ])
    return head, rows


def speed_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Speed, roofline and memory; catalogue metrics with the catalogue's labels and formats."""
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
        rows.append([name + noisy] + [metric_cell(v, x) for x in speed] + [
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
            rows.append([name, suite, str(f["checks"]), _fmt(f["reference_pass_rate"], ".0%"), _fmt(f["pass_rate"], ".0%"),
                         str(f["pass_to_fail"]), str(f["fail_to_pass"]), _fmt(f["mcnemar_p"], ".3f"),
                         _fmt((f.get("conversation_test") or {}).get("p"), ".3f")])
    if not rows:
        return None
    return ["variant", "suite", "checks", "original pass", "variant pass", "pass→fail", "fail→pass",
            "exact McNemar p", "conversation-level p"], rows


# ------------------------------------------------------------------------------------------ sections

def _decision_section(summary: dict) -> tuple:
    rec = summary["recommendation"]
    confidence = rec.get("confidence", "point")
    if rec["variant"]:
        lead = (f"**Ship `{rec['variant']}`** (decision `{rec['decision']}`, objective `{rec['objective']}`, limits "
                f"judged on {'95 % upper/lower bounds' if confidence == 'upper' else 'point estimates'}): "
                f"{rec['summary']}.")
    else:
        lead = f"**No recommendation**: {rec['summary']}."
    blocks: list = [lead]
    if rec.get("undecided"):
        blocks.append("**Undecided** (a limit lies inside the 95 % interval, so this run cannot say whether the "
                      "variant meets it; more conversations narrow the interval): "
                      + ", ".join(f"`{n}`" for n in rec["undecided"]) + ".")
    others = [f"`{n}`: {r}" for n, r in rec["reasons"].items() if n != rec["variant"]]
    front = ", ".join(f"`{n}`" for n in rec.get("pareto_front") or [])
    blocks += ["Why the others lost:", others,
               f"Pareto front over (mean KLD, decode tokens/s, peak RSS): {front}."]
    return ("decision", "Recommendation", blocks)


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
        kv_rows.append([n, str(m.get("kv_cache") or ""), _fmt(m["kv_bytes_per_token"], ",.0f"),
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
        "÷ quantized tokens, the full-precision residual window excluded). A gap over 10 % is flagged.",
        (["variant", "KV cache", "formula B/token", "reported B/token", "gap", "reported by"], kv_rows),
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
    from pipeline.aggregate import pooled_exactness

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
        "pass-rate differences (the decision uses it: `decision.max_pass_drop_p`)."])


def _run_time_section(summary: dict):
    """Minutes per stage of the run (each stage's own build time: a stage reused from an earlier run counts
    that build; quantizing, once per model, is in the artifacts table)."""
    t = summary.get("stage_times")
    if not t or not t.get("total_s"):
        return None
    m = lambda s: "-" if s is None else f"{s / 60:.1f}"  # noqa: E731
    rows = [[f"references: {suite}", m(w), "", ""] for suite, w in t["references_s"].items()]
    rows += [[f"`{n}`", m(r.get("free_running")), m(r.get("scoring")), m(r.get("deployment"))]
             for n, r in t["variants_s"].items()]
    label = {"load": "load stage: short sweep of `make compare` (all variants)"}
    rows += [[label.get(k, f"{k} stage (all variants)"), m(w), "", ""] for k, w in t["run_s"].items()]
    rows.append(["**total**", f"**{m(t['total_s'])}**", "", ""])
    covers = {"trials": "its trials, every sitting", "last sitting": "its last sitting only, from a resumed sweep "
              "that kept no trial times"}
    rows += [[f"load stage: {p} sweep of `make load` (all variants; not in the total; {covers[o['covers']]})",
              m(o["s"]), "", ""] for p, o in (t.get("other_sweeps") or {}).items()]
    return ("run-time", "Run time", [
        "Minutes per stage, each stage's own build time from its manifest (a stage reused from an earlier run counts "
        "that build, so the total is what these results cost, not this invocation's wall time); quantizing, once "
        "per model, is in the artifacts table. Where the report's load section shows `make load`'s sweep instead "
        "of the short one, that sweep's time is listed below the total.",
        (["stage", "free-running (or the stage)", "teacher-forced scoring", "deployment path"], rows)])


def _speed_noise_block(summary: dict) -> list:
    noise = summary.get("speed_noise")
    proto = summary.get("speed_protocol") or {}
    from pipeline.speed import WORKERS_KEPT

    workers = ("each variant's own probe process, loaded once for all rounds"
               if proto.get("workers") == WORKERS_KEPT else "a fresh process per trial")
    out = [f"Speed: every variant measured in {proto.get('rounds') or '?'} interleaved rounds (each round measures "
           f"every variant once, {workers}, the order rotated by one place per round), each trial "
           f"{proto.get('warmup', 1)} warm-up then {proto.get('repeats', 1)} timed generation(s) of "
           f"{proto.get('decode_tokens')} tokens after a {proto.get('prompt_tokens')}-token prompt. Figures: the "
           "median over trials [95 % interval from order statistics]; prefill (TTFT, compute-bound) and decode "
           "(memory-bound) separately. Two variants tie on speed unless a paired sign-flip permutation test over "
           "the rounds finds a difference at p < `decision.alpha` (and larger than `decision.tie_tolerance`)."]
    if noise and noise.get("figures"):
        f = noise["figures"]
        cells = [f"{BY_NAME[k].label} ×{x['ratio']:.3f} [{x['low']:.3f}, {x['high']:.3f}], p={x['p']:.2f}"
                 f" ({'tied' if x['tied'] else 'NOT tied: this run is too noisy to compare speeds'})"
                 for k, x in f.items()]
        floor = f.get("decode_tokens_per_s", {}).get("floor")
        out.append(f"Noise floor (A/A): `{noise['control']}` measured twice per round under two labels: "
                   + "; ".join(cells) + "." + (f" Decode-speed differences under ±{floor:.0%} are inside this "
                                               "run's noise." if floor is not None else ""))
    return out


def _model_section(summary: dict) -> tuple:
    m, ref = summary["model"], summary["reference"]
    items = [f"Source: `{m['source']}`; {m.get('origin', '')}.",
             f"{m.get('architecture')}: {m.get('params', 0) / 1e6:.1f}M parameters, {m.get('layers')} layers, "
             f"{m.get('attention_heads')} heads / {m.get('kv_heads')} KV heads, head dim {m.get('head_dim')}, "
             f"vocab {m.get('vocab_size')}, context {m.get('context_length')}."]
    if "dequantized" in (m.get("origin") or ""):
        items.append("**Note:** this original is itself a dequantized GGUF (the embedded demo model ships as "
                     "Q4_1). Drift figures are relative to it; that origin is a property of the demo model, not of "
                     "the method. Point `model.source` at a full-precision checkpoint for production decisions.")
    items.append(f"Reference transcripts generated by `{ref['runtime']}`; log-probs (top-{ref['top_k']} + tail) "
                 "always from the original on the hf runtime.")
    parity = ref.get("parity") or {}
    if parity.get("skipped"):
        items.append(f"Parity: GGUF skipped ({parity['skipped']}).")
    elif parity:
        items.append(f"Parity of the conversion: F16 GGUF mean KLD vs original {parity['f16_kld_mean']:.2e} (limit "
                     f"{parity['max_kld']:.0e}), top-1 agreement {parity['f16_top1_agreement']:.1%} → "
                     f"{'PASS' if parity['ok'] else 'FAIL: GGUF variants are not measured'}.")
        if parity.get("tokenizer"):
            items.append(_tokenizer_line(parity["tokenizer"]))
    repair = m.get("tokenizer_repair")
    if repair:
        items.append(f"Tokenizer repaired at prepare: transformers rebuilt this GGUF's tokenizer with a plain "
                     f"ByteLevel pre-tokenizer, ignoring its `tokenizer.ggml.pre` = "
                     f"`{_md_escape(repair['gguf_pre_tokenizer'])}`, so a whitespace run before a digit split "
                     "differently from llama.cpp (`\\n\\n1.`: `\\n`, `\\n`, `1` against `\\n\\n`, `1`); the original's "
                     f"tokenizer was given {_md_escape(repair['to'])}, the model's own.")
    return ("model", "Model and reference", [items])


def _tokenizer_line(tok: dict) -> str:
    """The GGUF tokenizer's divergence from the HF tokenizer, with its cause: a reported property of every GGUF
    file of this model, not a gate (the measurement feeds every runtime the HF ids)."""
    pre = (f"llama.cpp applies the pre-tokenizer named in the GGUF (`tokenizer.ggml.pre` = "
           f"`{_md_escape(tok.get('gguf_pre_tokenizer'))}`, a regex of llama.cpp's own), the HF tokenizer applies "
           f"`{_md_escape(tok.get('hf_pre_tokenizer'))}`")
    if not tok["diverging_texts"]:
        return (f"Tokenizer parity: the GGUF tokenizer splits all {tok['texts']} suite texts ({tok['hf_tokens']} "
                f"tokens) exactly as the HF tokenizer does ({pre}).")
    ex = tok["examples"][0]
    return (f"Tokenizer divergence: the GGUF tokenizer splits {tok['diverging_texts']} of {tok['texts']} suite texts "
            f"differently from the HF tokenizer, {tok['diverging_tokens']} of {tok['hf_tokens']} prompt tokens "
            f"({tok['diverging_tokens'] / max(tok['hf_tokens'], 1):.2%}); first in suite `{ex['suite']}` at token "
            f"{ex['first_diff_token']}, around `{_md_escape(repr(ex['context']))}`: hf {ex['hf']} vs gguf "
            f"{ex['gguf']}. Cause: {pre}. Every drift figure feeds all runtimes the HF ids, so it is measured on one "
            "token stream; what the divergence costs a user whose server tokenizes text is the deployment path "
            "below.")


def _deployment_section(ok: dict) -> tuple | None:
    rows = []
    for n, v in ok.items():
        d = v.get("deployment")
        if not d:
            continue
        rows.append([n, ", ".join(d["suites"]), f"{d['identical_replies']}/{d['replies']}",
                     _fmt(d["pass_rate_ids"], ".0%"), _fmt(d["pass_rate_served"], ".0%"),
                     f"{d['pass_to_fail']} / {d['fail_to_pass']} of {d['checks']}", _fmt(d["mcnemar_p"], ".2f"),
                     _fmt(d["chrf_mean"], ".1f")])
    if not rows:
        return None
    return ("deployment", "Deployment path: the server's own tokenizer", [
        (["variant", "suites", "identical replies", "pass (HF ids)", "pass (served)", "flips p→f / f→p",
          "McNemar p", "chrF served vs HF ids"], rows),
        "Each GGUF variant answers the same conversations twice: on the measurement path (the HF token ids, as "
        "every other figure here) and as a server runs it (each turn's chat rendered to text, tokenized and "
        "detokenized by llama.cpp's own tokenizer, as llama-server, Ollama or LM Studio do). Flips count checks "
        "whose outcome differs between the two paths; chrF compares the two replies (100 = identical). "
        "`profile.deployment_path` says where it runs: `diverging` (the suites with a text the two tokenizers "
        "split differently), `auto` (those and the multi-turn suites, where a server re-tokenizes the model's own "
        "earlier replies), `always`, `never`."])


def _bits_section(summary: dict, ok: dict) -> tuple | None:
    """Bits per weight for every weight format, the 32-wide fallbacks in K/IQ files, and per GGUF type the
    importance matrix's effect on mean KLD with its interval."""
    rows = []
    for n, v in ok.items():
        a = v.get("artifact") or {}
        if a.get("bits_per_weight") is None or "+" in n:
            continue
        fb = a.get("fallback_tensors") or {}
        im = a.get("imatrix") or {}
        rows.append([n, a.get("gguf_type") or a.get("format") or "", _fmt(a["bits_per_weight"], ".2f"),
                     _ci((v.get("intervals") or {}).get("kld_mean"), ".4f"),
                     ", ".join(f"{t}×{c}" for t, c in fb.items()) or "–",
                     f"{im.get('chunks')} chunks × {im.get('ctx')} tokens" if im else "–"])
    if not rows:
        return None
    blocks: list = [(["variant", "type", "bits/weight", "mean KLD [95 % CI]", "fallback tensors", "importance matrix"],
                     rows),
                    "Bits per weight: the artifact's stored tensor bytes × 8 over its weights (GGUF: the file's "
                    "tensors, scales and fallback types included; safetensors: packed weights, zeros, scales and "
                    "the unquantized embeddings and norms over the original's parameter count). KV-cache variants "
                    "share their weights' figure."]
    warn = [f"`{n}`: {sum(a['fallback_tensors'].values())} tensors are not {a.get('gguf_type')} but "
            + ", ".join(f"{t} ({c})" for t, c in a["fallback_tensors"].items())
            + ": their rows are not a multiple of llama.cpp's 256-wide super-block, so the file is mostly another "
              "type than its name, and drift need not follow the type names"
            for n, v in ok.items() if "+" not in n and (a := v.get("artifact") or {}).get("fallback_tensors")]
    if warn:
        blocks += ["**Warning: K/IQ types that fell back on this model:**", warn]
    effects = summary.get("imatrix_effects") or []
    if effects:
        blocks += ["The importance matrix, per type (mean KLD with minus without, paired over the same reference "
                   "conversations: 95 % bootstrap interval and sign-flip test; negative is better):",
                   (["type", "plain", "with imatrix", "mean KLD plain", "mean KLD imatrix", "Δ [95 % CI]",
                     "relative", "p", "significant"],
                    [[e["type"], e["plain"], e["imatrix"], _fmt(e["kld_plain"], ".4f"), _fmt(e["kld_imatrix"], ".4f"),
                      f"{e['delta']:+.4f} [{e['low']:+.4f}, {e['high']:+.4f}]", _fmt(e.get("relative"), "+.1%"),
                      _fmt(e.get("p_value"), ".3f"),
                      ("yes: lower with the importance matrix" if e["high"] < 0 else "yes: higher with it")
                      if e["significant"] else "no (inside this run's resolution)"] for e in effects])]
    return ("bits", "Bits per weight and the importance matrix", blocks)


def _calibration_section(summary: dict) -> tuple | None:
    """`quantdrift calibration`'s sweep of this run: mean KLD per variant at each calibration sample count."""
    sweep = summary.get("calibration_sweep")
    if not sweep or not (sweep.get("rows") or sweep.get("skipped")):
        return None
    rows = []
    for r in sweep["rows"]:
        delta = (f"{r['delta']:+.4f} [{r['delta_low']:+.4f}, {r['delta_high']:+.4f}]"
                 + (" (significant)" if r["significant"] else " (inside the noise)")) if "delta" in r else "–"
        p = r.get("producer") or {}
        rows.append([r["variant"], str(r["samples"]), f"{_fmt(r.get('calibration_samples'), 'd')} / "
                     f"{_fmt(r.get('calibration_tokens'), 'd')}",
                     f"{r['kld_mean']:.4f} [{r['kld_low']:.4f}, {r['kld_high']:.4f}]", delta,
                     _fmt(r.get("bits_per_weight"), ".2f"), _fmt(r.get("quantize_wall_s"), ".0f"),
                     f"{p.get('tool', '')} {p.get('version') or ''}".strip() or "–"])
    blocks: list = [(["variant", "calibration texts", "texts / tokens used", "mean KLD [95 % CI]",
                      "Δ vs the largest count [95 % CI]", "bits/weight", "quantize s", "produced by"], rows),
                    "Each variant quantized again with only its number of calibration texts changed, scored "
                    "teacher-forced on this run's reference like every other figure here. Δ is paired over the same "
                    "conversations and token positions; a significant negative Δ at a smaller count would be "
                    "impossible, a significant positive one says the smaller count limits the result."]
    if sweep.get("skipped"):
        blocks.append([f"`{s['variant']}` at {s['samples']} texts: skipped — {s['reason']}" for s in sweep["skipped"]])
    return ("calibration", "Calibration sensitivity (is the recipe what limits a result?)", blocks)


def _artifact_section(ok: dict) -> tuple:
    rows = []
    for n, v in ok.items():
        a = v["artifact"]
        types = ", ".join(f"{k}×{c}" for k, c in (a.get("tensor_types") or {}).items())
        requested = a.get("gguf_type") or (f"{a['quantize_settings']['bits']}-bit, group {a['group_size']}"
                                           if a.get("quantize_settings") else "")
        p = a.get("producer") or {}
        made_by = f"{p['tool']} {p.get('version') or ''}: {p['recipe']}" if p else "–"
        rows.append([n, a.get("format") or "", requested, made_by, types, v.get("kernel") or "",
                     _fmt(a.get("quantize_wall_s"), ".1f"), _fmt(a.get("quantize_peak_rss_mb"), ".0f")])
    blocks: list = [(["variant", "format", "requested type", "produced by", "tensor types in file", "kernel",
                      "quantize s", "quantize peak MB"], rows),
                    "K-quant names are recipes: on models whose row sizes are not multiples of 256, llama.cpp falls "
                    "back to other types, so the file's real tensor types are listed, and drift need not be "
                    "monotonic across K-quant names."]
    path_rows = []
    for n, v in ok.items():
        p = v["paths"]
        free = str(p.get("free_running") or "")
        kind = ("reference transcript" if free.startswith("reference transcripts")
                else "dequantized stand-in" if "dequantized" in free else "real kernel")
        path_rows.append([n, f"real kernel: {p['teacher_forced']}", f"{kind}: {free}",
                          f"real kernel: {p['speed_memory']}"])
    blocks += ["Which path produced which figure:",
               (["variant", "drift (KLD, top-1, ΔNLL, Δp)", "free-running (checks, flips, chrF)",
                 "speed and memory"], path_rows)]
    notes = []
    for n, v in ok.items():
        p = v["paths"]
        c = p.get("dequantized_check")
        if c:
            notes.append(f"`{n}`: teacher-forced drift, speed and memory on the real kernel ({p['teacher_forced']}); "
                         f"free-running checks, flips and chrF from {p['free_running']}. Check on {c.get('tokens', 0)} "
                         f"reference tokens: mean KLD kernel {c.get('kld_kernel', 0):.4g} vs dequantized "
                         f"{c.get('kld_dequantized', 0):.4g} (gap {c.get('kld_gap', 0):.1%}, limit 5%), greedy "
                         f"agreement {c.get('top1_agreement', 0):.1%} (limit 90%).")
    if notes:
        blocks += ["The dequantized stand-in, checked against the kernel:", notes]
    if any(v["artifact"].get("quantize_settings") for v in ok.values()):
        blocks.append("GPTQ/AWQ calibration: business prose from `prompts/calibration.jsonl`, kept apart from every "
                      "scored evaluation turn (or the source set in the variant's `quantize.calibration`).")
    return ("artifacts", "Artifacts", blocks)


def _load_section(summary: dict) -> tuple | None:
    """`quantdrift load`'s sweep: per variant the level table at each context depth, the knee, the largest
    concurrency meeting the workload's targets and throughput_at_slo; skipped variants with their reasons."""
    sweep = summary.get("load")
    if not sweep or not sweep.get("variants"):
        return None
    wl = sweep["workload"]
    targets = ", ".join(f"{k.removeprefix('max_').replace('_', ' ')} ≤ {v:g} s" for k, v in wl.items()
                        if k.startswith("max_") and v is not None) or "no latency targets (throughput only)"
    ok = {n: v for n, v in sweep["variants"].items() if v["status"] == "ok"}
    iv = lambda f, k, spec, scale=1.0: "–" if f.get(k) is None else (  # noqa: E731
        format(f[k] * scale, spec) + (f" [{format(f[k + '_interval']['low'] * scale, spec)}, "
                                      f"{format(f[k + '_interval']['high'] * scale, spec)}]"
                                      if f.get(k + "_interval") else ""))
    head = ["variant", "context", "concurrency", "output tok/s", "req/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
            "ITL p99 ms", "e2e p99 s", "peak MB", "targets"]
    rows = []
    from pipeline.load import numeric_order

    for name, v in ok.items():
        for depth, block in numeric_order(v["depths"]):
            for c, f in numeric_order(block["levels"]):
                peak = f.get("device_peak_mb") if f.get("device_peak_mb") is not None else f.get("peak_rss_mb")
                rows.append([name, depth, c, iv(f, "output_tokens_per_s", ".1f"), iv(f, "requests_per_s", ".2f"),
                             iv(f, "ttft_p50_s", ".2f"), iv(f, "ttft_p99_s", ".2f"), iv(f, "itl_p50_s", ".0f", 1e3),
                             iv(f, "itl_p99_s", ".0f", 1e3), iv(f, "e2e_p99_s", ".2f"), _fmt(peak, ".0f"),
                             block["operating_point"]["verdicts"][c]["verdict"]])
    from pipeline.load import advice

    lines = []
    for name, v in sorted(ok.items(), key=lambda kv: -(kv[1].get("throughput_at_slo") or -1)):
        noise = [x for x in v.get("cpu_noise_rounds") or [] if x is not None]
        noise_txt = (f"; other processes used up to {max(noise):.0%} of the CPU during its rounds"
                     + (" (noisy: read its figures with care)" if max(noise) > 0.1 else "")) if noise else ""
        lines.append(f"`{name}` on {v['engine']} ({v.get('engine_version') or 'version not reported'}): "
                     f"{advice(v, bold='**')}{noise_txt}.")
    blocks: list = [
        f"Workload **{wl['name']}** ({wl.get('description') or ''}): {targets}, at {wl['context_tokens']} tokens "
        f"of context. Sweep `{sweep['profile']}`: concurrency {sweep['concurrency']} (capped by the capacity plan), "
        f"context {sweep['depths']}, {sweep['output_tokens']} output tokens per request, {sweep['repeats']} "
        f"interleaved rounds (a fresh server per variant and round); load generator {sweep['generator']}.",
        lines, (head, rows),
        "Medians over rounds with the range of the rounds in brackets (order statistics; with 3 rounds the range "
        "covers the median with 75 % probability). Output tok/s: aggregate over all concurrent requests. A level "
        "\"meets\" the targets when every target's range lies under its limit, \"fails\" when a range lies wholly "
        "above it, and is \"undecided\" otherwise. Knee: the first concurrency after which doubling adds less than "
        f"{sweep['knee_gain']:.0%} aggregate throughput (median of the paired per-round gains). The advice is to "
        "operate at or left of the knee and within the targets. Peak MB: the server process's resident memory (its "
        "device memory from NVML on CUDA) sampled while the level ran."
        + (" A round stops climbing after two doublings that each added less than the knee gain, or after a level "
           "that completed no request: a higher level's figures come from the rounds that reached it."
           if sweep.get("stop_past_knee") else "")]
    if any(v["slo_depth"] != wl["context_tokens"] for v in ok.values()):
        blocks.append(f"This sweep did not measure the workload's own context ({wl['context_tokens']} tokens): the "
                      "targets were judged at the deepest context measured, which is optimistic (prefill and KV "
                      "reads grow with context). `make load` measures it.")
    other = {n: v for n, v in sweep["variants"].items() if v["status"] != "ok"}
    if other:
        blocks.append([f"`{n}`: {v['status']} — {v['reason']}" for n, v in other.items()])
    return ("load", "Served under load (continuous batching)", blocks)


def report_sections(summary: dict, plots: dict[str, str] | None = None) -> list[tuple]:
    plots = plots or {}
    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    bw = summary.get("bandwidth") or {}
    variants_blocks: list = [main_table(summary), (
        "KLD: mean token-level KL divergence (nats) of the variant's next-token distribution from the original's, "
        "teacher-forced on the original's own transcripts (top-K + tail bucket, exact where the tail is large). Pass/flips: machine checks on the "
        "variant's free-running replies; a flip is a check whose outcome differs from the original's (pass→fail / "
        "fail→pass), tested with an exact McNemar test. Brackets: 95 % bootstrap intervals resampling "
        f"conversations ({(next(iter(ok.values()), {}).get('intervals') or {}).get('kld_mean', {}).get('units', 0)} "
        "conversations, 2,000 replicates, fixed seed); with this few conversations the intervals are wide, so read "
        "overlapping intervals as no measured difference. Degenerate: replies whose repeated 4-gram rate or "
        "looping tail crosses `decision.degeneration`."),
        speed_table(summary),
        ("Peak RSS: the trial process. Roofline: bytes read per decoded token = all weights + the KV cache at the "
         "probe's mean context; BW share = decode tok/s × bytes/token ÷ measured bandwidth"
         + (f" ({bw['bytes_per_s'] / 1e9:.1f} GB/s: {bw['method']}"
            + (f"; other processes used {bw['cpu_noise']:.0%} of the CPU meanwhile"
               + (": NOISY, the share reads high" if bw.get("noisy") else "") if bw.get("cpu_noise") is not None
               else "") + ")" if bw else "")
         + "; the ceiling is the decode rate at 100 % of that bandwidth."), *_speed_noise_block(summary)]
    flips = suite_flip_table(summary)
    if flips:
        variants_blocks += ["Flips by suite against the original:", flips]
    sections = [_decision_section(summary), ("variants", "Variants", variants_blocks)]
    sections += [s for s in (_power_section(ok), _recall_section(ok), _capacity_section(summary, ok)) if s]
    sections += _drift_sections(ok)
    sections += [s for s in (_load_section(summary), _llama_stats_section(ok), _bits_section(summary, ok),
                             _calibration_section(summary)) if s]
    where = {"pareto": "decision", "kld_by_position": "by-position", "kld_by_turn": "by-turn",
             "recall_by_depth": "recall", "kld_vs_bits": "bits", "load_throughput": "load", "load_itl": "load"}
    for name in plots:      # each plot goes into its section (a plot without one gets its own)
        target = next((sec for sec in sections if sec[0] == where.get(name)), None)
        if target is None:
            target = (f"plot-{name}", name.replace("_", " "), [])
            sections.append(target)
        target[2].append({"plot": name, "file": plots[name]})
    sections += [s for s in (_model_section(summary), _deployment_section(ok), _artifact_section(ok),
                             _run_time_section(summary)) if s]
    skipped = {n: v for n, v in summary["variants"].items() if v["status"] != "ok"}
    if skipped:
        sections.append(("skipped", "Skipped or failed",
                         [[f"`{n}`: **{v['status']}** — {v.get('reason')}" for n, v in skipped.items()]]))
    hw, ver = summary["hardware"], summary["versions"]
    sections.append(("environment", "Environment", [
        f"{hw['cpu']}, {hw['cores']} cores; threads {summary['run']['threads']}, device {summary['run']['device']}. "
        + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        decoding_line(summary),
        "Samples: `samples.jsonl` beside this file (one line per variant × conversation turn)."]))
    return sections

