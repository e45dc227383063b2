"""Stage 5, report: summary.json (versioned), report.md, report.html (self-contained), plots, samples.jsonl.

Rebuilt from the per-variant result files alone (``make report``): nothing is recomputed.

Modules, each depending only on those before it (no cycles): ``summary`` (build_summary), ``sections`` (the
tables and sections both formats render, the cell formatting), ``plots`` (matplotlib, imported inside
``make_plots``), ``markdown`` and ``html`` (the two renderings), then this package's ``write_report``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config import Config
from pipeline.report.html import render_html, samples_viewer
from pipeline.report.markdown import render_markdown
from pipeline.report.plots import make_plots, variant_colors
from pipeline.report.sections import main_table, multi_turn_suites, report_sections, speed_table, suite_flip_table
from pipeline.report.summary import build_summary
from pipeline.run import load_result
from pipeline.store import atomic_write_text, dumps, read_jsonl, write_json

__all__ = ["write_report", "build_summary", "report_sections", "render_markdown", "render_html", "make_plots",
           "main_table", "speed_table", "suite_flip_table", "samples_viewer", "variant_colors", "multi_turn_suites"]

log = logging.getLogger(__name__)


def write_report(cfg: Config) -> dict:
    out_dir = cfg.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("report: summarising %d variant(s) into %s", len(cfg.run.variants or [cfg.variant.name]), out_dir)
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
