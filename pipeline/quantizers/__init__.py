"""Quantizers turn the original checkpoint into one artifact per weight variant; the registry lines are in
``pipeline.backends``. Modules are imported only when used."""

from __future__ import annotations

from pipeline.backends import QUANTIZERS

__all__ = ["QUANTIZERS", "quantizer_class", "build_artifact"]


def quantizer_class(name: str):
    from pipeline.registry import load_class

    return load_class(QUANTIZERS, name, "quantizer")


def build_artifact(variant, original, cfg):
    """The variant's artifact (built once, cached by its inputs): the registry's quantizer for it, run."""
    return quantizer_class(variant.quantizer)(variant, original, cfg).run()
