"""The report package: its public names, matplotlib kept out of import time, and its layers (the import graph is
tests.test_architecture's)."""

import subprocess
import sys
from pathlib import Path

import pipeline
from tests.test_architecture import find_cycle, import_graph

PKG = Path(pipeline.__file__).parent


def test_report_package_has_no_import_cycle_and_keeps_its_layers():
    """Rendering in layers: cells -> tables and sections -> plots -> markdown/html -> write, never back up."""
    graph = import_graph()
    report = {m for m in graph if m.startswith("pipeline.report.")}
    assert report >= {"pipeline.report.write", "pipeline.report.sections", "pipeline.report.markdown",
                      "pipeline.report.html", "pipeline.report.plots"}
    cycle = find_cycle({m: graph[m] & report for m in report})
    assert cycle is None, f"import cycle through the report: {cycle}"
    layer = {"pipeline.report.cells": 0, "pipeline.report.tables": 1, "pipeline.report.decision_section": 1,
             "pipeline.report.bench_section": 1, "pipeline.report.load_section": 1,
             "pipeline.report.run_time_section": 1, "pipeline.report.sections": 2,
             "pipeline.report.plots": 3, "pipeline.report.markdown": 4, "pipeline.report.html": 4,
             "pipeline.report.write": 5}
    for mod in report:
        for dep in graph[mod] & report:
            assert layer[dep] < layer[mod], (mod, dep)


def test_public_names_and_no_matplotlib_at_import():
    code = ("import sys; from pipeline.report.write import write_report; from pipeline.decide.summary import "
            "build_summary; from pipeline.report.sections import report_sections; from pipeline.report.markdown import "
            "render_markdown; from pipeline.report.html import render_html; "
            "from pipeline.report.plots import make_plots; from pipeline.cli import run; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported at import time'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (PKG / "report.py").exists()
