"""The layers of ``pipeline/`` hold: the package graph, read from the source with ``ast`` (imports at module level,
inside functions and under ``TYPE_CHECKING`` all count, relative imports resolved), has no cycle between packages
and no import from a lower layer to a higher one. The order is written once, here (``LAYERS``), and stated in
docs/architecture.md. No module holds more than 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"

# bottom to top: a layer may import its own and lower layers only
LAYERS = ("infra", "config", "figures", "runtimes", "servers", "suites", "instruments", "quantizers", "compose",
          "stages", "plan", "decide", "report", "commands", "cli")

# (from_module, to_module) imports that go up a layer and are not broken yet: the list can only shrink
KNOWN_UPWARD: tuple[tuple[str, str], ...] = ()

MAX_LINES = 400
# modules over MAX_LINES not split yet: the list can only shrink
OVER_400: tuple[str, ...] = ()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name ``name``'s source imports anywhere in its body, relative imports resolved."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def module_graph() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports (a name resolved to the longest module it names)."""
    mods = modules()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {resolve(t) for t in imported_names(name, path) if t == "pipeline" or t.startswith("pipeline.")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def layer_of(module: str) -> str:
    """``pipeline.X`` or ``pipeline.X.…`` -> ``X``; ``pipeline`` itself (a docstring and a version) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, set[str]], skip: tuple[tuple[str, str], ...] = ()) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if la and lb and la != lb and (a, b) not in skip:
                out.setdefault(la, set()).add(lb)
                out.setdefault(lb, set())
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None and (c := visit(n)):
            return c
    return None


def upward_imports(graph: dict[str, set[str]], order: tuple[str, ...]) -> set[tuple[str, str]]:
    """Every (from_module, to_module) whose target's layer is above its source's; a layer missing from ``order``
    fails loudly."""
    rank = {name: i for i, name in enumerate(order)}
    found = set()
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if not la or not lb or la == lb:
                continue
            missing = {la, lb} - set(rank)
            assert not missing, f"package(s) {sorted(missing)} have no place in LAYERS"
            if rank[lb] > rank[la]:
                found.add((a, b))
    return found


def test_every_package_has_a_layer():
    top = {p.stem for p in PIPELINE.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert top == set(LAYERS), (sorted(top - set(LAYERS)), sorted(set(LAYERS) - top))


def test_no_cycle_between_packages():
    graph = module_graph()
    assert "pipeline.infra.errors" in graph["pipeline.config.schema"]
    assert "pipeline.infra.model_source" in graph["pipeline.quantizers.base"]   # a TYPE_CHECKING import counts
    cycle = find_cycle(package_graph(graph, skip=KNOWN_UPWARD))
    assert cycle is None, " -> ".join(cycle)


def test_no_import_goes_up_a_layer():
    found = upward_imports(module_graph(), LAYERS)
    assert found <= set(KNOWN_UPWARD), "imports up a layer:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(found - set(KNOWN_UPWARD)))
    assert set(KNOWN_UPWARD) <= found, "no longer imported up a layer (remove from KNOWN_UPWARD): " + ", ".join(
        f"{a} -> {b}" for a, b in sorted(set(KNOWN_UPWARD) - found))


def test_nothing_in_pipeline_imports_dev():
    offenders = {name for name, path in modules().items()
                 if any(t == "dev" or t.startswith("dev.") for t in imported_names(name, path))}
    assert not offenders, sorted(offenders)


def test_no_module_is_over_400_lines():
    long = {module_name(p) for p in PIPELINE.rglob("*.py") if len(p.read_text().splitlines()) > MAX_LINES}
    assert long == set(OVER_400), {"split or list": sorted(long - set(OVER_400)),
                                   "now short, remove from OVER_400": sorted(set(OVER_400) - long)}


def test_the_order_is_the_one_the_architecture_doc_states():
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    start = lines.index("| layer | holds |") + 2
    stated = []
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        stated.append(line.split("`")[1])
    assert tuple(stated) == LAYERS, stated


# the checker itself: it must find what it is there to find


def test_the_checker_finds_a_cycle_between_packages():
    graph = {"pipeline.a.x": {"pipeline.b.y"}, "pipeline.b.y": {"pipeline.c.z"}, "pipeline.c.z": {"pipeline.a.w"},
             "pipeline.a.w": set()}
    assert find_cycle(package_graph(graph)) == ["a", "b", "c", "a"]
    assert find_cycle(package_graph(graph, skip=(("pipeline.c.z", "pipeline.a.w"),))) is None
    # imports inside one package are no cycle between packages
    assert find_cycle(package_graph({"pipeline.a.x": {"pipeline.a.y"}, "pipeline.a.y": {"pipeline.a.x"}})) is None


def test_the_checker_finds_an_upward_import():
    graph = {"pipeline.low.x": {"pipeline.high.y", "pipeline.low.z"}, "pipeline.high.y": {"pipeline.low.z"},
             "pipeline.low.z": set()}
    assert upward_imports(graph, ("low", "high")) == {("pipeline.low.x", "pipeline.high.y")}
    assert upward_imports(graph, ("high", "low")) == {("pipeline.high.y", "pipeline.low.z")}
    with pytest.raises(AssertionError, match="no place in LAYERS"):
        upward_imports(graph, ("low",))


def test_the_checker_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pipeline" / "p"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import m\n")
    src = ("from typing import TYPE_CHECKING\nimport pipeline.a.b\nfrom .sibling import f\nfrom ..q import r\n"
           "if TYPE_CHECKING:\n    from pipeline.t import T\n\ndef g():\n    from pipeline.lazy import h\n")
    (pkg / "m.py").write_text(src)
    names = imported_names("pipeline.p.m", pkg / "m.py")
    assert {"pipeline.a.b", "pipeline.p.sibling.f", "pipeline.q.r", "pipeline.t.T", "pipeline.lazy.h"} <= names
    assert "pipeline.p.m" in imported_names("pipeline.p", pkg / "__init__.py")
