"""The version of the code that computes a figure, for stage keys: a stage whose figures come from a module's code
records that module's version in its key, so a change to the code recomputes what it affects and nothing else.

A module's version is a hash of what its top-level names are bound to now: each function and class by its source
with comments, docstrings and formatting left out (``ast``), each constant by its value. An edit that changes no
behaviour (a comment, a docstring, a line wrapped) keeps the version; any other edit changes it. The names are read
from the module's own source, their objects from the live module, so a function replaced at run time (a test's
monkeypatch) counts as the code it is now.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import textwrap
from types import ModuleType
from typing import Callable


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _normalized_source(obj) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    return ast.dump(_strip_docstrings(tree), annotate_fields=False, include_attributes=False)


def _canonical(value) -> str:
    """A value's text, the same in every process (set order does not depend on the hash seed)."""
    if isinstance(value, re.Pattern):
        return f"re({value.pattern!r}, {value.flags})"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_canonical(k)}: {_canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(_canonical(v) for v in value) + ")"
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return repr(value)
    if inspect.isfunction(value) or inspect.isclass(value):
        return _normalized_source(value)
    return type(value).__name__      # a logger, a module, ...: not code of this module


def _top_level_names(module: ModuleType) -> list[str]:
    tree = ast.parse(inspect.getsource(module))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if n not in ("log", "__all__")]


def module_version(module: ModuleType | str) -> str:
    """The version of one module's code (16 hex digits)."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    h = hashlib.sha256()
    for name in _top_level_names(module):
        h.update(f"{name}={_canonical(getattr(module, name, None))}\n".encode())
    return h.hexdigest()[:16]


def code_version(*code: ModuleType | str | Callable) -> dict[str, str]:
    """{name: version} for the code that computes a stage's figures (its key holds this): whole modules (by object
    or dotted name) and single functions or classes (where the rest of their module does not compute the figure)."""
    out = {}
    for c in code:
        if isinstance(c, str):
            c = importlib.import_module(c)
        if isinstance(c, ModuleType):
            out[c.__name__] = module_version(c)
        else:
            out[f"{c.__module__}.{c.__qualname__}"] = hashlib.sha256(_normalized_source(c).encode()).hexdigest()[:16]
    return out
