"""report.html: the report's sections as one self-contained page (plots inlined, no script), and the per-sample
viewer (each reply beside the original's, the first divergence highlighted)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from pipeline.report.sections import report_sections

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
                first = not any(isinstance(x, tuple) for x in blocks[:i])   # the variants' first table: main
                tid = "main" if sid == "variants" and first else f"{sid}-{i}"
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

