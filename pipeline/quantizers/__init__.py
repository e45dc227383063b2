"""Quantizers turn the original checkpoint into one artifact per weight variant; the registry lines are in
``pipeline.config.backends``. Modules are imported only when used."""

from __future__ import annotations

from pipeline.config.backends import QUANTIZERS

__all__ = ["QUANTIZERS", "quantizer_class"]


def quantizer_class(name: str):
    import importlib

    from pipeline.config.backends import lookup

    module, cls = lookup(QUANTIZERS, name, "quantizer")
    return getattr(importlib.import_module(module), cls)

