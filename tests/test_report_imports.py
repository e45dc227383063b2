"""The report package: its public names, matplotlib kept out of import time, and an import graph without cycles
(every ``import`` in the ``pipeline`` package, those inside functions included)."""

import ast
import subprocess
import sys
from pathlib import Path

import pipeline

PKG = Path(pipeline.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the pipeline modules it imports anywhere in its body (relative imports resolved)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges |= {t for t in map(resolve, targets) if t and t != mod}
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_report_package_has_no_import_cycle_and_keeps_its_layers():
    graph = import_graph()
    report = {m for m in graph if m == "pipeline.report" or m.startswith("pipeline.report.")}
    assert report >= {"pipeline.report", "pipeline.report.summary", "pipeline.report.sections",
                      "pipeline.report.markdown", "pipeline.report.html", "pipeline.report.plots"}
    bad = [c for c in cycles(graph) if report & set(c)]
    assert not bad, f"import cycles through the report package: {bad}"
    # summary/plots/sections -> markdown/html -> __init__, never back up
    layer = {"pipeline.report.summary": 0, "pipeline.report.sections": 0, "pipeline.report.plots": 1,
             "pipeline.report.markdown": 2, "pipeline.report.html": 2, "pipeline.report": 3}
    for mod in report:
        for dep in graph[mod] & report:
            assert layer[dep] < layer[mod], (mod, dep)


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_public_names_and_no_matplotlib_at_import():
    code = ("import sys; from pipeline.report import write_report, build_summary, report_sections, render_markdown,"
            " render_html, make_plots; from pipeline.cli import run; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported at import time'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (PKG / "report.py").exists()
