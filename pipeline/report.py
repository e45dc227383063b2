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

from pipeline.aggregate import SCHEMA_VERSION, decide, variant_summary
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
    variants = {name: variant_summary(r) for name, r in results.items()}
    ok = [r for r in results.values() if r.get("status") == "ok"]
    first = ok[0] if ok else {}
    facts = (first.get("model") or {}).get("facts", {})
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
        "versions": library_versions(),
        "hardware": hardware(),
    }
    return summary


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _md_escape(text: str) -> str:
    """Inert in Markdown tables and HTML renderers: no tags, no table breaks, no line breaks."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|").replace("\n", " ")


def main_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["variant", "status", "mean KLD", "p99 KLD", "top-1", "ΔNLL", "pass", "flips", "chrF", "TTFT s",
            "prefill tok/s", "decode tok/s", "ITL p99 ms", "artifact MiB", "peak RSS MB", "KV B/token"]
    rows = []
    for name, v in summary["variants"].items():
        if v["status"] != "ok":
            rows.append([name, v["status"]] + [""] * (len(head) - 2))
            continue
        d, s, m, fr = v["drift"], v["speed"], v["memory"], v["free_running"]
        rows.append([
            name, "ok" + (" (noisy)" if s.get("noisy") else ""),
            _fmt(d["kld_mean"], ".4f"), _fmt(d["kld_p99"], ".3f"), _fmt(d["top1_agreement"], ".1%"),
            _fmt(d["delta_nll"], "+.4f"), _fmt(d["pass_rate"], ".0%"), f"{fr['flips']}/{fr['checks']}",
            _fmt(fr["chrf_mean"], ".1f"), _fmt(s["ttft_s"], ".3f"), _fmt(s["prefill_tokens_per_s"], ".0f"),
            _fmt(s["decode_tokens_per_s"], ".1f"), _fmt(s["itl_p99_s"] and s["itl_p99_s"] * 1000, ".1f"),
            _fmt(m["artifact_bytes"] / 2**20, ".1f"), _fmt(m["peak_rss_mb"], ".0f"),
            _fmt(m["kv_bytes_per_token"], ".0f") + ("" if not m["kv_gap_flagged"] else " ⚠"),
        ])
    return head, rows


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(summary: dict, plots: dict[str, str]) -> str:
    m, rec, ref = summary["model"], summary["recommendation"], summary["reference"]
    lines = [f"# quantdrift report: {m['name']} ({summary['run']['profile']} profile)", ""]
    lines += ["## Recommendation", ""]
    if rec["variant"]:
        lines.append(f"**Ship `{rec['variant']}`** (decision `{rec['decision']}`, objective `{rec['objective']}`): "
                     f"{_md_escape(rec['summary'])}.")
    else:
        lines.append(f"**No recommendation**: {_md_escape(rec['summary'])}.")
    lines += ["", "Why the others lost:", ""]
    lines += [f"- `{n}`: {_md_escape(r)}" for n, r in rec["reasons"].items() if n != rec["variant"]]
    head, rows = main_table(summary)
    lines += ["", "## Variants", "", _md_table(head, rows), ""]
    lines += [
        "KLD: mean token-level KL divergence (nats) of the variant's next-token distribution from the original's, "
        "teacher-forced on the original's own transcripts (top-K + tail bucket). Pass/flips: machine checks on the "
        "variant's free-running replies; a flip is a check whose outcome differs from the original's. Speed: "
        "a separate probe in a fresh process (median of repeats after warm-up); prefill (TTFT) and decode reported "
        "separately. Peak RSS: the probe process.", ""]
    lines += ["## Model and reference", ""]
    lines += [f"- Source: `{m['source']}`; {m.get('origin', '')}.",
              f"- {m.get('architecture')}: {m.get('params', 0) / 1e6:.1f}M parameters, {m.get('layers')} layers, "
              f"{m.get('attention_heads')} heads / {m.get('kv_heads')} KV heads, head dim {m.get('head_dim')}, "
              f"vocab {m.get('vocab_size')}, context {m.get('context_length')}."]
    if "dequantized" in (m.get("origin") or ""):
        lines.append("- **Note:** this original is itself a dequantized GGUF (the embedded demo model ships as "
                     "Q4_1). Drift figures are relative to it; that origin is a property of the demo model, not of "
                     "the method. Point `model.source` at a full-precision checkpoint for production decisions.")
    lines.append(f"- Reference transcripts generated by `{ref['runtime']}`; log-probs (top-{ref['top_k']} + tail) "
                 "always from the original on the hf runtime.")
    parity = ref.get("parity") or {}
    if parity.get("skipped"):
        lines.append(f"- Parity: GGUF skipped ({_md_escape(parity['skipped'])}).")
    elif parity:
        lines.append(f"- Parity: tokenizer identical on {parity['tokenizer_texts'] - len(parity['tokenizer_mismatches'])}"
                     f"/{parity['tokenizer_texts']} suite texts; F16 GGUF mean KLD vs original "
                     f"{parity['f16_kld_mean']:.2e} (limit {parity['max_kld']:.0e}), top-1 agreement "
                     f"{parity['f16_top1_agreement']:.1%} → {'PASS' if parity['ok'] else 'FAIL'}.")
    lines += ["", "## Drift by output position (mean KLD)", ""]
    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    buckets = sorted({b for v in ok.values() for b in v["drift_detail"]["kld_by_position"]},
                     key=lambda b: int(b.split("-")[0]))
    if buckets:
        rows = [[n] + [_fmt(v["drift_detail"]["kld_by_position"].get(b, {}).get("mean"), ".4f") for b in buckets]
                for n, v in ok.items()]
        lines += [_md_table(["variant"] + buckets, rows), ""]
    turns = sorted({t for v in ok.values() for t in v["drift_detail"]["kld_by_turn"] if t.startswith("multi_turn:")},
                   key=lambda t: int(t.split(":")[1]))
    if turns:
        lines += ["## Multi-turn drift by turn (mean KLD)", ""]
        rows = [[n] + [_fmt(v["drift_detail"]["kld_by_turn"].get(t, {}).get("mean"), ".4f") for t in turns]
                for n, v in ok.items()]
        lines += [_md_table(["variant"] + [t.split(":")[1] for t in turns], rows), ""]
    lines += ["## Artifacts", ""]
    rows = []
    for n, v in ok.items():
        a = v["artifact"]
        types = ", ".join(f"{k}×{c}" for k, c in (a.get("tensor_types") or {}).items())
        requested = a.get("gguf_type") or (f"{a['quantize_settings']['bits']}-bit, group {a['group_size']}"
                                           if a.get("quantize_settings") else "")
        rows.append([n, a.get("format") or "", requested, types, v.get("kernel") or "",
                     _fmt(a.get("quantize_wall_s"), ".1f"), _fmt(a.get("quantize_peak_rss_mb"), ".0f")])
    lines += [_md_table(["variant", "format", "requested type", "tensor types in file", "kernel", "quantize s",
                         "quantize peak MB"], rows), ""]
    lines.append("K-quant names are recipes: on models whose row sizes are not multiples of 256, llama.cpp falls back "
                 "to other types, so the file's real tensor types are listed, and drift need not be monotonic "
                 "across K-quant names.")
    notes = [(n, v["paths"]) for n, v in ok.items() if v["paths"].get("dequantized_check")]
    if notes:
        lines += ["", "### Which path produced which number", ""]
        for n, p in notes:
            c = p["dequantized_check"]
            lines.append(f"- `{n}`: teacher-forced drift, speed and memory on the real kernel ({_md_escape(p['teacher_forced'])}); "
                         f"free-running checks, flips and chrF from {_md_escape(p['free_running'])}. Check on "
                         f"{c.get('tokens', 0)} reference tokens: mean KLD kernel {c.get('kld_kernel', 0):.4g} vs "
                         f"dequantized {c.get('kld_dequantized', 0):.4g} (gap {c.get('kld_gap', 0):.1%}, limit 5%), "
                         f"greedy agreement {c.get('top1_agreement', 0):.1%} (limit 90%).")
    if any(v["artifact"].get("quantize_settings") for v in ok.values()):
        lines += ["", "GPTQ/AWQ calibration: business prose from `prompts/calibration.jsonl`, kept apart from every "
                  "scored evaluation turn (or the source set in the variant's `quantize.calibration`)."]
    skipped = {n: v for n, v in summary["variants"].items() if v["status"] != "ok"}
    if skipped:
        lines += ["", "## Skipped or failed", ""]
        lines += [f"- `{n}`: **{v['status']}** — {_md_escape(v.get('reason'))}" for n, v in skipped.items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{k}]({p})" for k, p in plots.items()]
    hw, ver = summary["hardware"], summary["versions"]
    lines += ["", "## Environment", "",
              f"{hw['cpu']}, {hw['cores']} cores; threads {summary['run']['threads']}, device {summary['run']['device']}. "
              + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
              "Samples: `samples.jsonl` beside this file (one line per variant × conversation turn)."]
    return "\n".join(lines) + "\n"


def make_plots(summary: dict, out_dir: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    plots: dict[str, str] = {}
    if not ok:
        return plots
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, v in ok.items():
        x, y = v["speed"]["decode_tokens_per_s"], v["drift"]["kld_mean"]
        if x is None or y is None:
            continue
        size = max(20.0, (v["memory"]["peak_rss_mb"] or 100) / 4)
        ax.scatter([x], [max(y, 1e-7)], s=size, alpha=0.6)
        ax.annotate(n, (x, max(y, 1e-7)), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens/s (higher is better)")
    ax.set_ylabel("mean KLD vs original, nats (log; lower is better)")
    ax.set_title("Drift vs decode speed (marker size: peak RSS)")
    ax.grid(alpha=0.3)
    _save(fig, out_dir / "pareto.png")
    plots["pareto"] = "pareto.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, v in ok.items():
        b = v["drift_detail"]["kld_by_position"]
        if not b or n == "original":
            continue
        xs = [int(k.split("-")[0]) for k in b]
        ax.plot(xs, [max(b[k]["mean"], 1e-7) for k in b], marker="o", label=n)
    ax.set_yscale("log")
    ax.set_xlabel("output position (token index within the reply, bucket start)")
    ax.set_ylabel("mean KLD, nats")
    ax.set_title("KLD by output position")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, out_dir / "kld_by_position.png")
    plots["kld_by_position"] = "kld_by_position.png"
    return plots


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def render_html(summary: dict, markdown_tables: tuple, out_dir: Path, plots: dict[str, str]) -> str:
    head, rows = markdown_tables
    rec = summary["recommendation"]
    esc = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>quantdrift report</title>",
             "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
             "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td:first-child,th:first-child"
             "{text-align:left}.rec{background:#eef7ee;padding:1em;border-left:4px solid #4a4}img{max-width:100%}</style>",
             "</head><body>", f"<h1>quantdrift: {esc(summary['model']['name'])}</h1>"]
    if rec["variant"]:
        parts.append(f"<div class='rec' id='decision'><b>Ship {esc(rec['variant'])}</b>: {esc(rec['summary'])}</div>")
    else:
        parts.append(f"<div class='rec' id='decision'><b>No recommendation</b>: {esc(rec['summary'])}</div>")
    parts.append("<ul>" + "".join(f"<li><code>{esc(n)}</code>: {esc(r)}</li>" for n, r in rec["reasons"].items()
                                  if n != rec["variant"]) + "</ul>")
    parts.append("<table id='main'><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
    parts.append("</table>")
    for name, rel in plots.items():
        data = base64.b64encode((out_dir / rel).read_bytes()).decode()
        parts.append(f"<h2>{esc(name)}</h2><img id='plot-{esc(name)}' alt='{esc(name)}' src='data:image/png;base64,{data}'>")
    parts.append("<p>Full tables: report.md; per-sample texts: samples.jsonl.</p></body></html>")
    return "\n".join(parts)


def write_report(cfg: Config) -> dict:
    out_dir = cfg.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(cfg)
    plots = make_plots(summary, out_dir)
    write_json(out_dir / "summary.json", summary)
    atomic_write_text(out_dir / "report.md", render_markdown(summary, plots))
    atomic_write_text(out_dir / "report.html", render_html(summary, main_table(summary), out_dir, plots))
    samples = []
    for name in summary["variants"]:
        r = load_result(cfg, name)
        if r and r.get("status") == "ok":
            samples += read_jsonl(Path(r["evaluation"]["dir"]) / "samples.jsonl")
    atomic_write_text(out_dir / "samples.jsonl", "".join(dumps(s, indent=None) + "\n" for s in samples))
    log.info("report written to %s", out_dir)
    return summary
