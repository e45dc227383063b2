"""Quantizers turn the original checkpoint into one artifact per weight variant.

The table maps a variant's ``quantizer`` name to its class; modules are imported only when used.
"""

from __future__ import annotations

import importlib

QUANTIZERS = {
    "none": "pipeline.quantizers.base:Passthrough",
    "gguf": "pipeline.quantizers.gguf:GGUFQuantizer",
    "gptqmodel": "pipeline.quantizers.gptq:GPTQModelQuantizer",
}


def quantizer_class(name: str):
    from pipeline.config import ConfigError

    if name not in QUANTIZERS:
        raise ConfigError(f"unknown quantizer {name!r}: expected one of {', '.join(sorted(QUANTIZERS))}")
    module, cls = QUANTIZERS[name].split(":")
    return getattr(importlib.import_module(module), cls)
