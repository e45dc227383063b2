"""A variant reuses the reference transcripts only when it would generate exactly what the producer generated:
a KV-cache variant on the producer's own weights must generate its own replies (else it shows 0 flips and
chrF 100 by construction)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config.schema import VariantConfig
from pipeline.compose import load_variant
from pipeline.stages.evaluate import reuses_reference
from pipeline.quantizers.base import Artifact


def _artifact(name: str, h: str) -> Artifact:
    return Artifact(variant=name, path=Path("/nowhere"), bytes=1, info={}, hash=h)


ORIGINAL_PRODUCER = {"name": "original@hf", "variant": VariantConfig(name="original"), "hash": "W-orig"}


@pytest.fixture(scope="module")
def f16_producer():
    return {"name": "gguf_f16@llama_cpp", "variant": load_variant("gguf_f16"), "hash": "W-f16"}


@pytest.mark.parametrize("name, weights, reuses", [
    ("original", "W-orig", True),
    ("original+kv_int8", "W-orig", False),     # same weights, quantized cache: its own replies
    ("gguf_q8_0", "W-q8", False),
])
def test_original_producer(name, weights, reuses):
    cfg = SimpleNamespace(variant=load_variant(name))
    assert reuses_reference(cfg, _artifact(name, weights), ORIGINAL_PRODUCER) is reuses


def test_f16_producer(f16_producer):
    f16 = load_variant("gguf_f16")
    assert reuses_reference(SimpleNamespace(variant=f16), _artifact("gguf_f16", "W-f16"), f16_producer)
    kv = load_variant("gguf_f16", kv_cache="int8")
    assert kv.name == "gguf_f16+kv_q8_0" and kv.runtime_options != f16.runtime_options
    assert not reuses_reference(SimpleNamespace(variant=kv), _artifact(kv.name, "W-f16"), f16_producer)
    # the original is the reference by definition even when its F16 GGUF produced the transcripts
    assert reuses_reference(SimpleNamespace(variant=load_variant("original")), _artifact("original", "W-orig"),
                            f16_producer)
    assert not reuses_reference(SimpleNamespace(variant=load_variant("original+kv_int8")),
                                _artifact("original+kv_int8", "W-orig"), f16_producer)
