"""Quantizers turn the original checkpoint into one artifact per weight variant.

The table maps a variant's ``quantizer`` name to its class; modules are imported only when used.
"""

from __future__ import annotations

QUANTIZERS = {
    "none": "pipeline.quantizers.base:Passthrough",
    "gguf": "pipeline.quantizers.gguf:GGUFQuantizer",
    "gptqmodel": "pipeline.quantizers.gptq:GPTQModelQuantizer",
}


def quantizer_class(name: str):
    from pipeline.registry import load_class

    return load_class(QUANTIZERS, name, "quantizer")
