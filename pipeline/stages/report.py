"""Stage: the report of a run: summary.json (versioned), report.md, report.html (self-contained), plots,
samples.jsonl, rebuilt from the per-variant result files alone (``make report``): nothing is recomputed."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.report.html import render_html
from pipeline.report.markdown import render_markdown
from pipeline.report.plots import make_plots
from pipeline.report.summary import build_summary
from pipeline.stages.variant_job import load_result
from pipeline.infra.files import atomic_write_text, dumps, read_jsonl, write_json

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
    # in the order it was built (variants in run order, reasons in the decision's order): the report renders the
    # summary as it is read back, so report.md is reproducible from summary.json alone
    write_json(out_dir / "summary.json", summary, sort_keys=False)
    atomic_write_text(out_dir / "report.md", render_markdown(summary, plots))
    atomic_write_text(out_dir / "report.html", render_html(summary, out_dir, plots, samples))
    atomic_write_text(out_dir / "samples.jsonl", "".join(dumps(s, indent=None) + "\n" for s in samples))
    log.info("report written to %s", out_dir)
    return summary
