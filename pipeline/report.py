"""Stage 5, report: summary.json (versioned), report.md, report.html (self-contained), plots, samples.jsonl.

Rebuilt from the per-variant result files alone (``make report``): nothing is recomputed.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import time
from pathlib import Path

from pipeline.aggregate import SCHEMA_VERSION, capacity_plan, decide, variant_summary
from pipeline.config import Config
from pipeline.run import load_result
from pipeline.store import atomic_write_bytes, atomic_write_text, dumps, hardware, library_versions, read_jsonl, write_json

log = logging.getLogger(__name__)


def build_summary(cfg: Config) -> dict:
    names = cfg.run.variants or [cfg.variant.name]
    results = {}
    for name in names:
        r = load_result(cfg, name)
        results[name] = r or {"status": "skipped", "reason": "not evaluated in this run (no result file)"}
    from pipeline.roofline import load_bandwidth, resolve_device, run_bandwidth

    bandwidth = load_bandwidth(cfg)
    if bandwidth is None and any(r.get("status") == "ok" for r in results.values()):
        bandwidth = run_bandwidth(cfg, resolve_device(cfg.runtime.device))   # a run from before bandwidth existed
    variants = {name: variant_summary(r, bandwidth, cfg.decision.degeneration, cfg.seed)
                for name, r in results.items()}
    ok = [r for r in results.values() if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    facts = (first.get("model") or {}).get("facts", {})
    for v in variants.values():
        if v["status"] == "ok":
            v["capacity"] = capacity_plan(v, facts, cfg.capacity)
    origin = facts.get("origin", "")
    summary = {
        "schema_version": SCHEMA_VERSION,
        "created_unix": time.time(),
        "run": {"name": cfg.run.name, "profile": cfg.profile.name, "suites": cfg.run.suites,
                "threads": cfg.runtime.n_threads, "device": cfg.runtime.device},
        "model": {"name": cfg.model.name, "source": cfg.model.source, "origin": origin,
                  **{k: v for k, v in facts.items() if k != "chat_template"}},
        "reference": {"runtime": (first.get("reference") or {}).get("producer"),
                      "top_k": cfg.reference.top_k, "parity": first.get("parity")},
        "variants": variants,
        "recommendation": decide(variants, cfg.decision),
        "decision_config": cfg.decision.__dict__,
        "capacity": cfg.capacity.__dict__,
        "bandwidth": bandwidth,
        "versions": library_versions(),
        "hardware": hardware(),
    }
    return summary


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


def main_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Accuracy and drift, every difference with its 95 % interval."""
    head = ["variant", "status", "mean KLD [95% CI]", "p99 KLD", "top-1 agree [CI]", "ΔNLL [CI]", "pass [CI]",
            "Δpass vs original [CI]", "flips p→f / f→p", "McNemar p", "chrF", "degenerate"]
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            rows.append([name, v["status"]] + [""] * (len(head) - 2))
            continue
        d, fr, iv = v["drift"], v["free_running"], v.get("intervals") or {}
        rows.append([
            name, "ok",
            _ci(iv.get("kld_mean"), ".4f"), _fmt(d["kld_p99"], ".3f"), _ci(iv.get("top1_agreement"), ".1f", 100),
            _ci(iv.get("delta_nll"), "+.3f"), _ci(iv.get("pass_rate"), ".0f", 100),
            _ci(iv.get("pass_rate_delta"), "+.0f", 100), f"{fr['pass_to_fail']} / {fr['fail_to_pass']} of {fr['checks']}",
            _fmt(fr["mcnemar_p"], ".2f"), _fmt(fr["chrf_mean"], ".1f"),
            f"{fr.get('degenerate_replies', 0)}/{fr['replies']}",
        ])
    return head, rows


def speed_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "TTFT s", "prefill tok/s", "decode tok/s", "ITL p50 ms", "ITL p99 ms", "bytes/token MiB",
            "BW share", "decode ceiling tok/s", "artifact MiB", "peak RSS MB", "KV cache", "KV B/token"]
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            continue
        s, m, rf = v["speed"], v["memory"], v.get("roofline") or {}
        rows.append([
            name + (" (noisy)" if s.get("noisy") else ""), _fmt(s["ttft_s"], ".3f"), _fmt(s["prefill_tokens_per_s"], ".0f"),
            _fmt(s["decode_tokens_per_s"], ".1f"), _fmt(s["itl_p50_s"] and s["itl_p50_s"] * 1000, ".1f"),
            _fmt(s["itl_p99_s"] and s["itl_p99_s"] * 1000, ".1f"),
            _fmt(rf.get("bytes_per_token") and rf["bytes_per_token"] / 2**20, ".1f"), _fmt(rf.get("share"), ".0%"),
            _fmt(rf.get("ceiling_tokens_per_s"), ".0f"), _fmt(m["artifact_bytes"] / 2**20, ".1f"),
            _fmt(m["peak_rss_mb"], ".0f"), str(m.get("kv_cache") or ""),
            _fmt(m["kv_bytes_per_token"], ".0f") + ("" if not m["kv_gap_flagged"] else " ⚠"),
        ])
    return head, rows


def suite_flip_table(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok" or name == "original":
            continue
        for suite, f in (v["free_running"].get("by_suite") or {}).items():
            rows.append([name, suite, str(f["checks"]), _fmt(f["reference_pass_rate"], ".0%"), _fmt(f["pass_rate"], ".0%"),
                         str(f["pass_to_fail"]), str(f["fail_to_pass"]), _fmt(f["mcnemar_p"], ".3f")])
    if not rows:
        return None
    return ["variant", "suite", "checks", "original pass", "variant pass", "pass→fail", "fail→pass",
            "exact McNemar p"], rows


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ sections
# The report is a list of sections; each is (id, title, blocks) and a block is a paragraph (str), a table
# (head, rows) or a bullet list (list of str). report.md and report.html render the same sections.

def _decision_section(summary: dict) -> tuple:
    rec = summary["recommendation"]
    if rec["variant"]:
        lead = (f"**Ship `{rec['variant']}`** (decision `{rec['decision']}`, objective `{rec['objective']}`): "
                f"{rec['summary']}.")
    else:
        lead = f"**No recommendation**: {rec['summary']}."
    others = [f"`{n}`: {r}" for n, r in rec["reasons"].items() if n != rec["variant"]]
    front = ", ".join(f"`{n}`" for n in rec.get("pareto_front") or [])
    return ("decision", "Recommendation", [lead, "Why the others lost:", others,
                                           f"Pareto front over (mean KLD, decode tokens/s, peak RSS): {front}."])


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
    kv_rows, cap_rows, big_rows = [], [], []
    for n, v in ok.items():
        m = v["memory"]
        kv_rows.append([n, str(m.get("kv_cache") or ""), _fmt(m["kv_bytes_per_token"], ",.0f"),
                        _fmt(m["kv_bytes_per_token_reported"], ",.0f"),
                        _fmt(m["kv_formula_gap"], ".1%") + (" ⚠ over 10%" if m["kv_gap_flagged"] else ""),
                        str(m.get("kv_reported_source") or "")])
        plan = v.get("capacity") or {}
        cap_rows.append([n, _fmt(plan.get("weights_bytes", 0) / 2**20, ",.0f"),
                         _fmt(plan.get("overhead_bytes", 0) / 2**20, ",.0f")]
                        + [f"{plan['max_sequences'][b]:,}" for b in budgets])
        if plan.get("scaled"):
            sc = plan["scaled"]
            big_rows.append([n, _fmt(sc["weights_bytes"] / 1e9, ",.1f"), _fmt(sc["kv_bytes_per_token"] / 1024, ",.0f")]
                            + [f"{sc['max_sequences'][b]:,}" for b in budgets])
    blocks = [
        "KV bytes per token: the formula 2 × layers × KV heads × head dim × bytes per element (q8_0: 34/32, with "
        "its block scale; hf int8: 1 + 2/head_dim, with the per-token fp16 scale and zero point of V) against what "
        "the runtime reports (llama.cpp: its KV buffer size from its log ÷ cells; hf: the cache tensors it holds "
        "÷ quantized tokens, the full-precision residual window excluded). A gap over 10 % is flagged.",
        (["variant", "KV cache", "formula B/token", "reported B/token", "gap", "reported by"], kv_rows),
        f"Concurrent sequences of {cap['context_tokens']:,} tokens that fit each memory budget with "
        f"{cap['headroom']:.0%} headroom: (budget × (1 − headroom) − weights − runtime overhead) ÷ (KV bytes per "
        "token × context). Overhead is measured: the probe's peak RSS minus weights and the KV it held "
        "(on a CPU this is mostly the runtime's libraries).",
        (["variant", "weights MiB", "overhead MiB"] + [f"{b} GB" for b in budgets], cap_rows),
    ]
    if big_rows:
        sc = next(v["capacity"]["scaled"] for v in ok.values() if (v.get("capacity") or {}).get("scaled"))
        blocks += [f"The same plan for a {sc['params_b']:g}B-parameter model ({sc['layers']} layers, {sc['kv_heads']} "
                   f"KV heads, head dim {sc['head_dim']}: capacity.params_b/layers/kv_heads/head_dim): weights scale "
                   "by each variant's measured bytes per parameter, KV by that geometry at each variant's bytes per "
                   "element.",
                   (["variant", "weights GB", "KV KiB/token"] + [f"{b} GB" for b in budgets], big_rows)]
    return ("capacity", "KV cache and capacity", blocks)


def _multi_turn_keys(ok: dict) -> list[str]:
    """'multi_turn:N' turn keys present in any variant, in turn order."""
    return sorted({t for v in ok.values() for t in v["drift_detail"]["kld_by_turn"] if t.startswith("multi_turn:")},
                  key=lambda t: int(t.split(":")[1]))


def _drift_sections(ok: dict) -> list[tuple]:
    out = []
    buckets = sorted({b for v in ok.values() for b in v["drift_detail"]["kld_by_position"]},
                     key=lambda b: int(b.split("-")[0]))
    if buckets:
        rows = [[n] + [_fmt(v["drift_detail"]["kld_by_position"].get(b, {}).get("mean"), ".4f") for b in buckets]
                for n, v in ok.items()]
        out.append(("by-position", "Drift by output position (mean KLD)", [(["variant"] + buckets, rows)]))
    turns = _multi_turn_keys(ok)
    if turns:
        rows = [[n] + [_fmt(v["drift_detail"]["kld_by_turn"].get(t, {}).get("mean"), ".4f") for t in turns]
                for n, v in ok.items()]
        out.append(("by-turn", "Multi-turn drift by turn (mean KLD)",
                    [(["variant"] + [t.split(":")[1] for t in turns], rows)]))
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


def _artifact_section(ok: dict) -> tuple:
    rows = []
    for n, v in ok.items():
        a = v["artifact"]
        types = ", ".join(f"{k}×{c}" for k, c in (a.get("tensor_types") or {}).items())
        requested = a.get("gguf_type") or (f"{a['quantize_settings']['bits']}-bit, group {a['group_size']}"
                                           if a.get("quantize_settings") else "")
        rows.append([n, a.get("format") or "", requested, types, v.get("kernel") or "",
                     _fmt(a.get("quantize_wall_s"), ".1f"), _fmt(a.get("quantize_peak_rss_mb"), ".0f")])
    blocks: list = [(["variant", "format", "requested type", "tensor types in file", "kernel", "quantize s",
                      "quantize peak MB"], rows),
                    "K-quant names are recipes: on models whose row sizes are not multiples of 256, llama.cpp falls "
                    "back to other types, so the file's real tensor types are listed, and drift need not be "
                    "monotonic across K-quant names."]
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
        blocks += ["Which path produced which number:", notes]
    if any(v["artifact"].get("quantize_settings") for v in ok.values()):
        blocks.append("GPTQ/AWQ calibration: business prose from `prompts/calibration.jsonl`, kept apart from every "
                      "scored evaluation turn (or the source set in the variant's `quantize.calibration`).")
    return ("artifacts", "Artifacts", blocks)


def report_sections(summary: dict, plots: dict[str, str] | None = None) -> list[tuple]:
    plots = plots or {}
    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    bw = summary.get("bandwidth") or {}
    variants_blocks: list = [main_table(summary), (
        "KLD: mean token-level KL divergence (nats) of the variant's next-token distribution from the original's, "
        "teacher-forced on the original's own transcripts (top-K + tail bucket). Pass/flips: machine checks on the "
        "variant's free-running replies; a flip is a check whose outcome differs from the original's (pass→fail / "
        "fail→pass), tested with an exact McNemar test. Brackets: 95 % bootstrap intervals resampling "
        f"conversations ({(next(iter(ok.values()), {}).get('intervals') or {}).get('kld_mean', {}).get('units', 0)} "
        "conversations, 2,000 replicates, fixed seed); with this few conversations the intervals are wide, so read "
        "overlapping intervals as no measured difference. Degenerate: replies whose repeated 4-gram rate or "
        "looping tail crosses `decision.degeneration`."),
        speed_table(summary),
        ("Speed: a separate probe in a fresh process (median of repeats after warm-up); prefill (TTFT, compute-"
         "bound) and decode (memory-bound) reported separately. Peak RSS: the probe process. Roofline: bytes read "
         "per decoded token = all weights + the KV cache at the probe's mean context; BW share = decode tok/s × "
         "bytes/token ÷ measured bandwidth"
         + (f" ({bw['bytes_per_s'] / 1e9:.1f} GB/s: {bw['method']})" if bw else "")
         + "; the ceiling is the decode rate at 100 % of that bandwidth. Speed figures carry no interval: they "
         f"are medians of {next(iter(ok.values()), {}).get('speed', {}).get('repeats') or 'a few'} repeats and move "
         "by 10–30 % between runs on a shared CPU, so the decision treats objective values within "
         "`decision.tie_tolerance` of the best as a tie (the lower drift wins).")]
    flips = suite_flip_table(summary)
    if flips:
        variants_blocks += ["Flips by suite against the original:", flips]
    sections = [_decision_section(summary), ("variants", "Variants", variants_blocks)]
    sections += [s for s in (_recall_section(ok), _capacity_section(summary, ok)) if s]
    sections += _drift_sections(ok)
    where = {"pareto": "decision", "kld_by_position": "by-position", "kld_by_turn": "by-turn",
             "recall_by_depth": "recall"}
    for name in plots:      # each plot goes into its section (a plot without one gets its own)
        target = next((sec for sec in sections if sec[0] == where.get(name)), None)
        if target is None:
            target = (f"plot-{name}", name.replace("_", " "), [])
            sections.append(target)
        target[2].append({"plot": name, "file": plots[name]})
    sections += [s for s in (_model_section(summary), _deployment_section(ok), _artifact_section(ok)) if s]
    skipped = {n: v for n, v in summary["variants"].items() if v["status"] != "ok"}
    if skipped:
        sections.append(("skipped", "Skipped or failed",
                         [[f"`{n}`: **{v['status']}** — {v.get('reason')}" for n, v in skipped.items()]]))
    hw, ver = summary["hardware"], summary["versions"]
    sections.append(("environment", "Environment", [
        f"{hw['cpu']}, {hw['cores']} cores; threads {summary['run']['threads']}, device {summary['run']['device']}. "
        + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        "Samples: `samples.jsonl` beside this file (one line per variant × conversation turn)."]))
    return sections


def render_markdown(summary: dict, plots: dict[str, str]) -> str:
    lines = [f"# quantdrift report: {summary['model']['name']} ({summary['run']['profile']} profile)", ""]
    for _, title, blocks in report_sections(summary, plots):
        lines += [f"## {title}", ""]
        for b in blocks:
            if isinstance(b, dict):
                lines += [f"![{b['plot']}]({b['file']})", ""]
            elif isinstance(b, tuple):
                lines += [_md_table(*b), ""]
            elif isinstance(b, list):
                lines += [f"- {_md_inline(x)}" for x in b] + [""]
            else:
                lines += [_md_inline(b), ""]
    return "\n".join(lines)


def _md_inline(text: str) -> str:
    """Prose we wrote may use **bold** and `code`; model and user text inside it is escaped."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace("\n", " ")


def _trend_plot(plt, history: list[dict], summary: dict, out_dir: Path) -> str | None:
    """Key metrics of this model and run over the nightly history (results/history.jsonl)."""
    rows = [h for h in history if h.get("model") == summary["model"]["name"] and h.get("run") == summary["run"]["name"]]
    if len(rows) < 2:
        return None
    names = sorted({n for h in rows for n, v in h["variants"].items() if v.get("status") == "ok"})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        pts = [(i, h["variants"][n]) for i, h in enumerate(rows) if h["variants"].get(n, {}).get("status") == "ok"]
        if n != "original":
            ax1.plot([i for i, _ in pts], [max(v["kld_mean"] or 0, 1e-7) for _, v in pts], marker="o", label=n)
        ax2.plot([i for i, _ in pts], [v["decode_tokens_per_s"] or 0 for _, v in pts], marker="o", label=n)
    labels = [h["time"][:10] + (f"\n{h['commit'][:7]}" if h.get("commit") else "") for h in rows]
    for ax, title in ((ax1, "mean KLD over runs (log)"), (ax2, "decode tokens/s over runs")):
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax2.legend(fontsize=7)
    _save(fig, out_dir / "trend.png")
    return "trend.png"


def _kld_lines(plt, series: dict[str, list[tuple[int, float]]], xlabel: str, ylabel: str, title: str,
               legend_size: int, path: Path) -> None:
    """One log-scale KLD line per variant (points (x, mean KLD); empty series are left out)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, pts in series.items():
        if pts:
            ax.plot([x for x, _ in pts], [max(y, 1e-7) for _, y in pts], marker="o", label=n)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size)
    _save(fig, path)


def make_plots(summary: dict, out_dir: Path, history: list[dict] | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    plots: dict[str, str] = {}
    if not ok:
        return plots
    front = set(summary["recommendation"].get("pareto_front") or [])
    chosen = summary["recommendation"].get("variant")
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, v in ok.items():
        x, y = v["speed"]["decode_tokens_per_s"], v["drift"]["kld_mean"]
        if x is None or y is None:
            continue
        y = max(y, 1e-7)
        size = max(20.0, (v["memory"]["peak_rss_mb"] or 100) / 4)
        iv = (v.get("intervals") or {}).get("kld_mean")
        if iv and n != "original":
            ax.errorbar([x], [y], yerr=[[max(y - max(iv["low"], 1e-7), 0)], [max(iv["high"] - y, 0)]], fmt="none",
                        ecolor="#999", elinewidth=1, capsize=2)
        ax.scatter([x], [y], s=size, alpha=0.75 if n in front else 0.3, edgecolors="k" if n == chosen else "none",
                   linewidths=2, color="#2a7" if n in front else "#888")
        ax.annotate(n + (" (ship)" if n == chosen else ""), (x, y), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_ylabel("mean KLD vs original, nats (log; lower is better)")
    ax.set_title("Drift vs decode speed (green: Pareto front; marker size: peak RSS; bars: 95% CI)")
    ax.grid(alpha=0.3)
    _save(fig, out_dir / "pareto.png")
    plots["pareto"] = "pareto.png"
    drifting = {n: v["drift_detail"] for n, v in ok.items() if n != "original"}
    _kld_lines(plt, {n: [(int(k.split("-")[0]), b["mean"]) for k, b in d["kld_by_position"].items()]
                     for n, d in drifting.items()},
               "output position (token index within the reply, bucket start)", "mean KLD, nats",
               "KLD by output position", 8, out_dir / "kld_by_position.png")
    plots["kld_by_position"] = "kld_by_position.png"
    turns = _multi_turn_keys(ok)
    if turns:
        _kld_lines(plt, {n: [(int(t.split(":")[1]), d["kld_by_turn"][t]["mean"]) for t in turns if t in d["kld_by_turn"]]
                         for n, d in drifting.items()},
                   "turn of the multi-turn conversation", "mean KLD of the reply, nats", "Multi-turn drift by turn", 7,
                   out_dir / "kld_by_turn.png")
        plots["kld_by_turn"] = "kld_by_turn.png"
    trend = _trend_plot(plt, history or [], summary, out_dir)
    if trend:
        plots["trend"] = trend
    recall = {n: v["recall"] for n, v in ok.items() if v.get("recall")}
    if recall:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for n, r in recall.items():
            depths = sorted(r["by_depth"], key=float)
            xs = [100 * float(d) for d in depths]
            ax1.plot(xs, [100 * (r["by_depth"][d]["recall"] or 0) for d in depths], marker="o", label=n)
            if n != "original":
                ax2.plot(xs, [max(r["by_depth"][d]["kld_mean"] or 0, 1e-7) for d in depths], marker="o", label=n)
        ax1.set_xlabel("depth of the planted fact in the document (%)")
        ax1.set_ylabel("recall (% of questions answered exactly)")
        ax1.set_ylim(-5, 105)
        ax1.set_title("Recall by depth")
        ax2.set_yscale("log")
        ax2.set_xlabel("depth of the planted fact in the document (%)")
        ax2.set_ylabel("mean KLD on answer tokens, nats")
        ax2.set_title("Answer-token KLD by depth")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=7)
        _save(fig, out_dir / "recall_by_depth.png")
        plots["recall_by_depth"] = "recall_by_depth.png"
    return plots


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1280px;color:#222}"
        "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}"
        ".rec{background:#eef7ee;padding:1em;border-left:4px solid #4a4}img{max-width:100%}"
        "code{background:#f3f3f3;padding:0 3px}mark.div{background:#fd8}table.pair{width:100%;table-layout:fixed}"
        "table.pair td{text-align:left;vertical-align:top}pre{white-space:pre-wrap;font-size:12px;margin:0}"
        ".sample{margin:.6em 0}.meta{font-size:12px;color:#555}")


def _html_inline(text: str) -> str:
    """Escape everything, then turn our own **bold** and `code` markers into tags."""
    import re

    out = html.escape(str(text))
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def _divergence_html(ref: str, var: str) -> tuple[str, str]:
    """Both texts escaped, the first differing word (from the first differing character) highlighted."""
    i = next((k for k, (a, b) in enumerate(zip(ref, var)) if a != b), min(len(ref), len(var)))

    def mark(text: str) -> str:
        if i >= len(text) and len(ref) == len(var):
            return html.escape(text)
        end = i
        while end < len(text) and not text[end].isspace():
            end += 1
        end = max(end, min(i + 1, len(text)))
        return (html.escape(text[:i]) + "<mark class='div'>" + html.escape(text[i:end] or "⏎ (ends here)")
                + "</mark>" + html.escape(text[end:]))

    return mark(ref), mark(var)


def samples_viewer(samples: list[dict]) -> str:
    """Per variant, every reply beside the original's, the first divergence highlighted (no script needed)."""
    by_variant: dict[str, list[dict]] = {}
    for smp in samples:
        if smp["variant"] != "original":
            by_variant.setdefault(smp["variant"], []).append(smp)
    if not by_variant:
        return ""
    esc = html.escape
    parts = ["<section id='samples'><h2>Samples: original vs variant</h2><p>Each reply beside the original's; "
             "the first divergent word is highlighted. Checks: ✓ pass, ✗ fail (original → variant).</p>"]
    for name, rows in by_variant.items():
        changed = sum(1 for r in rows if r["first_divergence"] is not None)
        parts.append(f"<details class='variant'><summary><code>{esc(name)}</code>: {changed}/{len(rows)} replies "
                     "differ</summary>")
        for r in rows:
            ref, var = _divergence_html(r["reference_text"], r["variant_text"])
            checks = " ".join(f"{esc(label)}: {'✓' if a else '✗'}→{'✓' if b else '✗'}"
                              for label, a, b in zip(r["check_labels"], r["checks_reference"], r["checks_variant"]))
            parts.append(f"<div class='sample'><div class='meta'>{esc(r['suite'])} / {esc(r['conversation'])} turn "
                         f"{r['turn'] + 1}; first divergent token: {esc(str(r['first_divergence']))}; chrF "
                         f"{r['chrf']:.1f}{'; ' + checks if checks else ''}</div><table class='pair'><tr><th>original"
                         f"</th><th>{esc(name)}</th></tr><tr><td><pre>{ref}</pre></td><td><pre>{var}</pre></td></tr>"
                         "</table></div>")
        parts.append("</details>")
    parts.append("</section>")
    return "\n".join(parts)


def render_html(summary: dict, out_dir: Path, plots: dict[str, str], samples: list[dict] | None = None) -> str:
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>quantdrift report: {esc(summary['model']['name'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>quantdrift: {esc(summary['model']['name'])} ({esc(summary['run']['profile'])} profile)</h1>"]
    for sid, title, blocks in report_sections(summary, plots):
        parts.append(f"<section id='{esc(sid)}'><h2>{esc(title)}</h2>")
        for i, b in enumerate(blocks):
            if isinstance(b, dict):
                data = base64.b64encode((out_dir / b["file"]).read_bytes()).decode()
                parts.append(f"<figure id='plot-{esc(b['plot'])}'><img alt='{esc(b['plot'])}' "
                             f"src='data:image/png;base64,{data}'></figure>")
            elif isinstance(b, tuple):
                head, rows = b
                tid = "main" if sid == "variants" and i == 0 else f"{sid}-{i}"
                parts.append(f"<table id='{esc(tid)}'><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
                parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
                parts.append("</table>")
            elif isinstance(b, list):
                parts.append("<ul>" + "".join(f"<li>{_html_inline(x)}</li>" for x in b) + "</ul>")
            else:
                cls = " class='rec'" if sid == "decision" and i == 0 else ""
                parts.append(f"<p{cls}>{_html_inline(b)}</p>")
        parts.append("</section>")
    parts.append(samples_viewer(samples or []))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(cfg: Config) -> dict:
    out_dir = cfg.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(cfg)
    history_path = Path(cfg.paths.results) / "history.jsonl"
    history = read_jsonl(history_path) if history_path.is_file() else []
    plots = make_plots(summary, out_dir, history)
    samples = []
    for name in summary["variants"]:
        r = load_result(cfg, name)
        if r and r.get("status") == "ok":
            samples += read_jsonl(Path(r["evaluation"]["dir"]) / "samples.jsonl")
    write_json(out_dir / "summary.json", summary)
    atomic_write_text(out_dir / "report.md", render_markdown(summary, plots))
    atomic_write_text(out_dir / "report.html", render_html(summary, out_dir, plots, samples))
    atomic_write_text(out_dir / "samples.jsonl", "".join(dumps(s, indent=None) + "\n" for s in samples))
    log.info("report written to %s", out_dir)
    return summary
