"""The report of a run: report.md, report.html (self-contained), plots and samples.jsonl rendered from its
summary.json. Rendering measures nothing and decides nothing: ``quantdrift report`` takes the summary from the run's
finished stages (``pipeline.decide.summary``) where they are on disk, else renders the committed summary.json as it
was."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.report.html import render_html
from pipeline.report.markdown import render_markdown
from pipeline.report.plots import make_plots
from pipeline.infra.files import atomic_write_text, dumps, read_jsonl

log = logging.getLogger(__name__)


def _history(cfg: Config) -> list[dict]:
    """The nightly gate's history lines the report's trend plot draws ([] before the first)."""
    path = Path(cfg.paths.results) / "history.jsonl"
    return read_jsonl(path) if path.is_file() else []


def _samples(cfg: Config, summary: dict) -> list[dict] | None:
    """Every evaluated variant's samples from its evaluation folder; None where none of them is on disk."""
    from pipeline.stages.variant_setup import load_result

    samples, found = [], False
    for name, v in summary["variants"].items():
        r = load_result(cfg, name) if v.get("status") == "ok" else None
        ev_dir = ((r or {}).get("evaluation") or {}).get("dir")
        path = Path(ev_dir) / "samples.jsonl" if ev_dir else None
        if path is not None and path.is_file():
            found = True
            samples += read_jsonl(path)
    return samples if found else None


def render_report(cfg: Config, summary: dict) -> None:
    """report.md, report.html, the plots and samples.jsonl of ``summary`` in ``cfg.results_dir``. The samples come
    from the variants' evaluation folders; where those are not on disk (a committed run in a fresh clone) the
    samples.jsonl beside the summary, and the report's per-sample viewer as it was rendered, are kept."""
    out_dir = cfg.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = make_plots(summary, out_dir, _history(cfg))
    samples = _samples(cfg, summary)
    kept = samples is None
    if kept:
        path = out_dir / "samples.jsonl"
        samples = read_jsonl(path) if path.is_file() else []
    atomic_write_text(out_dir / "report.md", render_markdown(summary, plots))
    html = render_html(summary, out_dir, plots, samples)
    if kept and not samples and (out_dir / "report.html").is_file():
        html = _keep_samples_viewer(html, (out_dir / "report.html").read_text())
    atomic_write_text(out_dir / "report.html", html)
    if not kept:
        atomic_write_text(out_dir / "samples.jsonl", "".join(dumps(s, indent=None) + "\n" for s in samples))
    log.info("report written to %s", out_dir)


def write_report(cfg: Config) -> dict:
    """``quantdrift report``: the summary of the run's finished stages where any variant's result is on disk (taken
    again, so that a load or calibration sweep run since is in it), else the run's summary.json as it is; then
    rendered. Returns the summary."""
    from pipeline.decide.summary import write_summary
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.files import read_json
    from pipeline.stages.variant_setup import load_result

    names = cfg.run.variants or [cfg.variant.name]
    path = cfg.results_dir / "summary.json"
    if any(load_result(cfg, n) is not None for n in names):
        summary = write_summary(cfg)
    elif path.is_file():
        summary = read_json(path)
        log.info("report: no stage of this run on disk; rendering %s as it is", path)
    else:
        raise ConfigError(f"run.variants={names}: no result of this run under {cfg.model_dir} and no summary.json "
                          f"in {cfg.results_dir}: expected a run made with `quantdrift compare` (make compare)")
    render_report(cfg, summary)
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
