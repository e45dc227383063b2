"""The report's content, independent of its format: the tables and the sections that report.md and report.html
both render, with the shared cell formatting (``_fmt``, ``_ci``, ``_md_escape``).

The report is a list of sections; each is (id, title, blocks) and a block is a paragraph (str), a table
(head, rows), a bullet list (list of str) or a plot ({"plot": name, "file": png}).

The tables of figures are ``pipeline.report.tables``; the cell formatting ``pipeline.report.cells``; the decision,
benchmark and load sections their own ``*_section`` modules."""

from __future__ import annotations

from pipeline.config.summary_contract import BY_NAME
from pipeline.report.bench_section import bench_section
from pipeline.report.cells import _ci, _fmt, _md_escape, decoding_line, mark_notes
from pipeline.report.decision_section import decision_section
from pipeline.report.load_section import load_section
from pipeline.report.run_time_section import run_time_section
from pipeline.report.tables import (_capacity_section, _drift_sections, _llama_stats_section,
                                    _power_section, _recall_section, main_table, same_runtime_table, speed_table,
                                    suite_flip_table)


def _speed_noise_block(summary: dict) -> list:
    noise = summary.get("speed_noise")
    proto = summary.get("speed_protocol") or {}
    from pipeline.figures.speed_trials import WORKERS_KEPT, WORKERS_MIXED

    workers = "a fresh process per trial"
    if proto.get("workers") == WORKERS_KEPT:
        workers = "each variant's own probe process, loaded once for all rounds"
    elif proto.get("workers") == WORKERS_MIXED:
        workers = (f"a probe process loaded once for all rounds for {', '.join(proto.get('kept_workers') or [])} "
                   "(as many as the measured memory held), a fresh process per trial for the others")
    out = [f"Speed: every variant measured in {proto.get('rounds') or '?'} interleaved rounds (each round measures "
           f"every variant once, {workers}, the order rotated by one place per round), each trial "
           f"{proto.get('warmup', 1)} warm-up then {proto.get('repeats', 1)} timed generation(s) of "
           f"{proto.get('decode_tokens')} tokens after a {proto.get('prompt_tokens')}-token prompt. Figures: the "
           "median over trials [the narrowest order-statistic interval covering at least 95 %; its exact coverage "
           "with this many rounds is in the summary, e.g. 97.9 % at 10]; prefill (TTFT, compute-bound) and decode "
           "(memory-bound) separately. Two variants tie on speed unless a paired sign-flip permutation test over "
           "the rounds finds a difference at a family-wise adjusted p < `decision.alpha` and the difference exceeds "
           "the run's noise floor: the A/A pair's largest distance from 1, at least `decision.tie_tolerance` (a "
           "noisy A/A pair widens the floor; it never stops a ranking). Memory is one reading per process: compared "
           "as a difference against the tie tolerance, with no test."]
    if proto.get("extra_rounds"):
        secs = proto.get("extra_seconds")
        out.append(f"Then {proto['extra_rounds']} more rounds of {', '.join(proto.get('extra_labels') or [])} only"
                   + (f" ({secs / 60:.1f} min)" if secs else "") + f", so that the nightly gate can see a small "
                   f"slowdown against the other variants of their runtime: {proto.get('extra_stop')}. Comparisons with the other "
                   "variants pair the interleaved rounds only.")
    elif proto.get("extra_stop"):
        out.append(f"No extra rounds of the cheap runtimes: {proto['extra_stop']}.")
    if noise and noise.get("figures"):
        from pipeline.decide.recommendation import aa_negligible

        tol = (summary.get("decision_config") or {}).get("tie_tolerance") or 0.0
        f = noise["figures"]
        def verdict(x: dict) -> str:
            if x.get("single_reading"):
                return "one reading per process: no test"
            if x["tied"]:
                return "tied"
            return "NOT tied: " + ("within the tie tolerance" if aa_negligible(x, tol)
                                   else f"the noise floor widens to ±{x['floor']:.0%}")

        cells = [f"{BY_NAME[k].label if k in BY_NAME else k} ×{x['ratio']:.3f} [{x['low']:.3f}, {x['high']:.3f}], "
                 f"p={_fmt(x['p'], '.2f')} ({verdict(x)})" for k, x in f.items()]
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
    if m.get("system_role") in ("rejected", "dropped"):
        items.append("Chat template: it " + ("raises on a system message" if m["system_role"] == "rejected" else
                                             "renders no system message (the model would never see it)")
                     + ", so every conversation's system prompt was folded into its first user turn (system text, "
                     "a blank line, the user text); a deployment that sends a system message to this model gets "
                     "other behaviour than measured here.")
    folder = parity.get("folder_tokenizer") or {}
    if folder.get("diverging_texts"):
        ex = (folder.get("examples") or [{}])[0]
        items.append(f"Tokenizer: transformers loaded `{folder['loaded']}` for this model, which splits "
                     f"{folder['diverging_texts']} of {folder['texts']} suite texts differently from the folder's "
                     f"own `tokenizer.json` ({folder['diverging_tokens']} of {folder['hf_tokens']} tokens"
                     + (f"; first at `{_md_escape(ex.get('context', ''))}`" if ex else "") + "). Every runtime "
                     "here is fed the loaded tokenizer's ids; a server that reads `tokenizer.json` sees others.")
    elif folder.get("texts"):
        items.append(f"Tokenizer: `{folder['loaded']}` as loaded by transformers splits all {folder['texts']} "
                     "suite texts as the folder's own `tokenizer.json` does.")
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


def report_sections(summary: dict, plots: dict[str, str] | None = None) -> list[tuple]:
    plots = plots or {}
    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    bw = summary.get("bandwidth") or {}
    kld_iv = (next(iter(ok.values()), {}).get("intervals") or {}).get("kld_mean") or {}
    brackets = (f"95 % t intervals of the ratio estimators over {kld_iv.get('units', 0)} conversations, stratified "
                "by suite" if "t interval" in kld_iv.get("method", "") else
                f"95 % bootstrap intervals resampling conversations ({kld_iv.get('units', 0)} conversations, 2,000 "
                "replicates, fixed seed)")
    missing = summary.get("stages_missing") or {}
    variants_blocks: list = ([f"Not in this report: {'; '.join(f'{k} ({why})' for k, why in missing.items())}. "
                              "`quantdrift compare` measures what a run lacks; `quantdrift report` measures nothing."]
                             if missing else [])
    screened = {n: v["screened"]["reason"] for n, v in ok.items() if v.get("screened")}
    if screened:
        variants_blocks += ["Screened out after their teacher-forced scoring (decision.screen), so without flips, "
                            "speed or load figures:", [f"`{n}`: {why}" for n, why in screened.items()]]
    variants_blocks += [main_table(summary), *mark_notes(summary), (
        "KLD: mean token-level KL divergence (nats) of the variant's next-token distribution from the original's, "
        "teacher-forced on the original's own transcripts (top-K + tail bucket, exact where the tail is large). Pass/flips: machine checks on the "
        "variant's free-running replies; a flip is a check whose outcome differs from the original's (pass→fail / "
        f"fail→pass), tested with an exact McNemar test. Brackets: {brackets}; with this few conversations the "
        "intervals are wide, so read "
        "overlapping intervals as no measured difference. Degenerate: replies whose repeated 4-gram rate or "
        "looping tail crosses `decision.degeneration`."),
        speed_table(summary), *mark_notes(summary, speed=True),
        ("Peak RSS: each trial's own peak (the probe's high-water mark reset at the trial's start); load peak: the "
         "peak while the variant loaded; RSS after load: what stays resident once loaded. Roofline: bytes read per decoded token = all weights + the KV cache at the "
         "probe's mean context; BW share = decode tok/s × bytes/token ÷ measured bandwidth"
         + (f" ({bw['bytes_per_s'] / 1e9:.1f} GB/s: {bw['method']}"
            + (f"; other processes used {bw['cpu_noise']:.0%} of the CPU meanwhile"
               + (": NOISY, the share reads high" if bw.get("noisy") else "") if bw.get("cpu_noise") is not None
               else "") + ")" if bw else "")
         + "; the ceiling is the decode rate at 100 % of that bandwidth."), *_speed_noise_block(summary)]
    flips = suite_flip_table(summary)
    if flips:
        variants_blocks += ["Flips by suite against the original:", flips]
    same = same_runtime_table(summary)
    if same:
        variants_blocks += [
            "Flips against the original on the same runtime: a variant whose replies were generated on another "
            "runtime than the reference's is checked against the original's own replies on that runtime (its own "
            "change); the first row is the runtime switch's floor, the original there against the reference (what "
            "changing runtime alone flips). The decision judges these variants' flips and checks on this table.",
            same]
    sections = [decision_section(summary), ("variants", "Variants", variants_blocks)]
    sections += [s for s in (bench_section(summary),) if s]
    sections += [s for s in (_power_section(ok), _recall_section(ok), _capacity_section(summary, ok)) if s]
    sections += _drift_sections(ok)
    sections += [s for s in (load_section(summary), _llama_stats_section(ok), _bits_section(summary, ok),
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
                             run_time_section(summary)) if s]
    skipped = {n: v for n, v in summary["variants"].items() if v["status"] != "ok"}
    if skipped:
        sections.append(("skipped", "Skipped or failed",
                         [[f"`{n}`: **{v['status']}** — {v.get('reason')}" for n, v in skipped.items()]]))
    hw, ver = summary["hardware"], summary["versions"]
    sections.append(("environment", "Environment", [
        f"{hw['cpu']}, {hw['cores']} cores"
        + (f", {hw['memory_gib']} GiB, instruction set {hw['cpu_key']}" if hw.get("cpu_key") else "")
        + f"; threads {summary['run']['threads']}, device {summary['run']['device']}. "
        + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        decoding_line(summary),
        "Samples: `samples.jsonl` beside this file (one line per variant × conversation turn)."]))
    return sections
