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
from pipeline.stages.variant_setup import load_result
from pipeline.infra.files import atomic_write_text, dumps, read_jsonl, write_json

log = logging.getLogger(__name__)


def _history(cfg: Config) -> list[dict]:
    """The nightly gate's history lines the report's trend plot draws ([] before the first)."""
    path = Path(cfg.paths.results) / "history.jsonl"
    return read_jsonl(path) if path.is_file() else []


def write_report(cfg: Config) -> dict:
    out_dir = cfg.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("report: summarising %d variant(s) into %s", len(cfg.run.variants or [cfg.variant.name]), out_dir)
    summary = build_summary(cfg)
    plots = make_plots(summary, out_dir, _history(cfg))
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


def redecide_report(cfg: Config) -> dict:
    """The decision of a finished run taken again from its summary.json alone, with ``cfg.decision`` and the
    deployment target of ``cfg.workload`` (on the run's recorded hardware), and its report rendered again: every
    figure is the run's own; nothing is measured. The summary records that it was re-decided and when."""
    import time

    from pipeline.config.summary_contract import validate_summary
    from pipeline.decide.recommendation import decide
    from pipeline.decide.target import make_target
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.files import read_json

    out_dir = cfg.results_dir
    path = out_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"run.name={cfg.run.name!r}: no summary.json in {out_dir}: expected a finished run "
                          "(make compare, then quantdrift report)")
    summary = read_json(path)
    headroom = (summary.get("capacity") or {}).get("headroom", cfg.capacity.headroom)     # the run's own
    target = make_target(cfg.workload, cfg.decision, headroom, summary.get("hardware"),
                         summary.get("model"), (summary.get("capacity") or {}).get("context_tokens"))
    summary["recommendation"] = decide(summary["variants"], cfg.decision, summary.get("speed_noise"), target)
    summary["decision_config"] = cfg.decision.__dict__
    summary["redecided_unix"] = time.time()
    validate_summary(summary)
    plots = make_plots(summary, out_dir, _history(cfg))
    samples_path = out_dir / "samples.jsonl"
    samples = read_jsonl(samples_path) if samples_path.is_file() else []
    write_json(out_dir / "summary.json", summary, sort_keys=False)
    atomic_write_text(out_dir / "report.md", render_markdown(summary, plots))
    html = render_html(summary, out_dir, plots, samples)
    if not samples and (out_dir / "report.html").is_file():
        html = _keep_samples_viewer(html, (out_dir / "report.html").read_text())
    atomic_write_text(out_dir / "report.html", html)
    log.info("report re-decided and written to %s", out_dir)
    return summary


def _keep_samples_viewer(html: str, previous: str) -> str:
    """The per-sample viewer of the report as it was rendered, where the samples themselves stay local
    (``samples.jsonl`` is not committed): a re-decided report keeps what it showed."""
    import re

    old = re.search(r"<section id='samples'>.*?</section>\n?(?=</body>)", previous, re.S)
    if not old or "<section id='samples'>" in html:
        return html
    head, tail = html.rsplit("</body>", 1)
    return head + old.group(0) + "</body>" + tail
