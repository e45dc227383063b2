"""Name -> class tables for quantizers and runtimes, imported lazily so heavy libraries load only when used."""

from __future__ import annotations

import importlib


def load_class(table: dict, name: str, kind: str):
    from pipeline.errors import ConfigError

    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}: expected one of {', '.join(sorted(table))}")
    module, cls = table[name].target.split(":")
    return getattr(importlib.import_module(module), cls)
