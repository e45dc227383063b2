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


# Marks on a variant's name wherever figures of something other than its own kernel appear
STANDIN_MARK = "†"      # free-running replies from the dequantized F16-GGUF stand-in
NO_KERNEL_MARK = "‡"    # no native kernel on this device: speed and memory not the format's


def standin_used(v: dict) -> bool:
    return bool(((v.get("paths") or {}).get("dequantized_check") or {}).get("used"))


def variant_label(name: str, v: dict, speed: bool = False) -> str:
    """The variant's name with the marks of what its figures in this table come from: † (checks and flips of
    free-running replies from the stand-in), ‡ (speed and memory: no native kernel here; ``speed`` tables)."""
    marks = (STANDIN_MARK if standin_used(v) and not speed else "") + \
        (NO_KERNEL_MARK if speed and v.get("no_native_kernel") else "")
    return name + (f" {marks}" if marks else "")


def mark_notes(summary: dict, speed: bool = False) -> list[str]:
    """The footnotes of the marks a table uses (nothing when no variant carries one)."""
    ok = {n: v for n, v in summary["variants"].items() if v.get("status") == "ok"}
    notes = []
    if not speed:
        for n, v in ok.items():
            if standin_used(v):
                c = v["paths"]["dequantized_check"]
                notes.append(f"{STANDIN_MARK} `{n}`: its free-running replies (pass rate, flips, chrF) come from the "
                             f"stand-in, its exact dequantized weights as an F16 GGUF on llama.cpp, which matched "
                             f"the loaded model on a teacher-forced sample of {c.get('tokens')} tokens (top-1 "
                             f"agreement {c.get('top1_agreement', 0):.1%}, KLD gap {c.get('kld_gap', 0):.1%}); its "
                             "drift (KLD) is its own.")
    else:
        for n, v in ok.items():
            if v.get("no_native_kernel"):
                notes.append(f"{NO_KERNEL_MARK} `{n}`: {v['no_native_kernel']}. Its speed and memory here are a dense "
                             "model's, not the format's: not shown, not ranked, not planned with; its drift is its "
                             "own.")
    return notes
