"""report.md: the report's sections rendered as Markdown."""

from __future__ import annotations

from pipeline.report.cells import _md_escape
from pipeline.report.sections import report_sections


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _md_inline(text: str) -> str:
    """Prose we wrote may use **bold** and `code`; model and user text inside it is escaped."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace("\n", " ")


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
