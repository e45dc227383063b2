"""Quantizers turn the original checkpoint into one artifact per weight variant; the registry lines are in
``pipeline.infra.backends``. Modules are imported only when used."""

from __future__ import annotations

from pipeline.infra.backends import QUANTIZERS

__all__ = ["QUANTIZERS", "quantizer_class"]


def quantizer_class(name: str):
    import importlib

    from pipeline.infra.backends import lookup

    module, cls = lookup(QUANTIZERS, name, "quantizer")
    return getattr(importlib.import_module(module), cls)

