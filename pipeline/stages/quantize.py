"""Stage 2, quantize: the original turned into one artifact per weight variant by the variant's quantizer
(``pipeline.quantizers``), cached by its inputs; KV-cache variants share their weights' artifact."""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.files import dir_bytes
from pipeline.infra.stage_cache import run_stage
from pipeline.quantizers import quantizer_class
from pipeline.quantizers.base import Artifact


def build_artifact(variant, original, cfg) -> Artifact:
    """The variant's artifact (built once, cached by its inputs): the registry's quantizer for it, run as a stage."""
    quantizer = quantizer_class(variant.quantizer)(variant, original, cfg)
    ready = quantizer.ready_made()
    if ready is not None:
        return ready
    key = {"original": original.hash, "variant": variant.base, **quantizer.key()}
    manifest = run_stage(f"quantize:{variant.base}", quantizer.out_dir, key, quantizer.checked_build, force=cfg.force)
    path = quantizer.out_dir / manifest["artifact"]
    info = {k: v for k, v in manifest.items() if k not in ("key", "versions", "hardware")}
    return Artifact(variant=variant.name, path=path, bytes=dir_bytes(path), hash=manifest["key_hash"],
                    info={**info, "producer": quantizer.producer(manifest)})


def bits_per_weight(path: Path, params: int | None) -> float | None:
    """Stored bits per weight of an artifact. A GGUF file: 8 x its tensors' bytes / their elements (scales and
    the fallback types included; llama.cpp's own "BPW" also counts the vocabulary and metadata). A safetensors
    folder (the original, GPTQ, AWQ): 8 x its tensors' bytes (packed weights, zeros, scales, unquantized
    embeddings and norms) / the original's parameter count ``params``. None when neither applies."""
    import json
    import struct

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from pipeline.infra.gguf_file import read_header

        tensors = read_header(path).tensors
        elements = sum(t.n_elements for t in tensors)
        if not elements or any(t.n_bytes is None for t in tensors):
            return None
        return 8.0 * sum(t.n_bytes for t in tensors) / elements
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files or not params:
        return None
    stored = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        stored += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return 8.0 * stored / params
