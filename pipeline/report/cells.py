"""The report's cell formatting, shared by every table and both renderings: numbers, intervals, metric headings
and cells, Markdown escaping."""

from __future__ import annotations

from pipeline.config.summary_contract import Metric, decoding_of, value

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
