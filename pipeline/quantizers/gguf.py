"""GGUF variants: llama.cpp's own converter (HF -> F16 GGUF), then llama_model_quantize to each type.

The converter and its gguf-py come from the source distribution of the installed llama-cpp-python release
(`make setup` fetches them into paths.cache): PyPI's gguf package lags the converter.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from typing import TYPE_CHECKING

from pipeline.errors import ConfigError
from pipeline.quantizers.base import Quantizer, Skip
from pipeline.store import run_stage

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)

F16_FILE = "model-f16.gguf"


def converter_dir(cfg: Config) -> Path:
    version = metadata.version("llama-cpp-python")
    return Path(cfg.paths.cache) / f"llama-cpp-python-{version}"


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file really holds (K-quant names are a recipe, not a promise)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))


def gguf_metadata(path: Path, key: str):
    """One metadata value of a GGUF file (a string, number or list), or None when the file lacks it."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(key)
    return field.contents() if field is not None else None


def convert_checkpoint(cfg: Config, checkpoint: Path, upstream_hash: str, model_name: str, out_dir: Path) -> Path:
    """HF checkpoint -> F16 GGUF with llama.cpp's own converter, cached in ``out_dir``."""
    src = converter_dir(cfg)
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConfigError(f"llama.cpp's converter is missing at {script}: run `make converter` (or `make setup`), "
                          "which fetches the llama-cpp-python source distribution into paths.cache")

    def build(tmp: Path) -> dict:
        from pipeline.store import check_free_space, dir_bytes

        check_free_space(tmp, 1.1 * dir_bytes(checkpoint), f"converting {checkpoint.name} to F16 GGUF")
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py") + os.pathsep + str(src), NO_LOCAL_GGUF="")
        cmd = [sys.executable, str(script), str(checkpoint), "--outfile", str(tmp / F16_FILE), "--outtype", "f16",
               "--model-name", model_name]
        log.info("converting %s to F16 GGUF with llama.cpp's converter", checkpoint)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            text = proc.stderr + proc.stdout
            if "not supported" in text or "NotImplementedError" in text:
                arch = next((ln for ln in text.splitlines() if "not supported" in ln), "unsupported architecture")
                raise Skip(f"llama.cpp's converter does not support this model: {arch.strip()}")
            tail = "\n".join(text.strip().splitlines()[-8:])
            raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{tail}")
        return {"artifact": F16_FILE, "tensor_types": tensor_types(tmp / F16_FILE)}

    key = {"upstream": upstream_hash, "converter": str(script), "llama_cpp": metadata.version("llama-cpp-python")}
    run_stage("convert:f16-gguf", out_dir, key, build, force=False)
    return out_dir / F16_FILE


def convert_to_f16(cfg: Config, checkpoint: Path, original_hash: str, model_name: str) -> Path:
    """The F16 GGUF of the original, shared by every GGUF variant (cached under <model>/gguf-f16)."""
    return convert_checkpoint(cfg, checkpoint, original_hash, model_name, cfg.model_dir / "gguf-f16")


def quantize_file(src: Path, dst: Path, ftype_name: str, threads: int) -> None:
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}", None)
    if ftype is None:
        known = sorted(n[len("LLAMA_FTYPE_MOSTLY_"):] for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ConfigError(f"variant.quantize.type={ftype_name!r} is not a llama.cpp type: expected one of {', '.join(known)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        hint = " (IQ types need an importance matrix)" if ftype_name.startswith("IQ") else ""
        raise RuntimeError(f"llama_model_quantize to {ftype_name} failed with code {rc}{hint}")


@dataclass
class GGUFSettings:
    """variant.quantize for gguf: the llama.cpp file type (F16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, ...)."""

    type: str

    def __post_init__(self) -> None:
        from pipeline.settings import require

        require(isinstance(self.type, str) and self.type.replace("_", "").isalnum(), "variant.quantize.type",
                self.type, "a llama.cpp type name such as Q4_K_M")


class GGUFQuantizer(Quantizer):
    """variant.quantize: {type: F16 | Q8_0 | Q6_K | Q5_K_M | Q4_K_M | Q4_0 | ...}."""

    Settings = GGUFSettings

    @property
    def gguf_type(self) -> str:
        t = str(self.variant.quantize.get("type", "")).upper()
        if not t:
            raise ConfigError(f"variant {self.variant.name}: variant.quantize.type is required for gguf (e.g. Q4_K_M)")
        return t

    def key(self) -> dict:
        return {"type": self.gguf_type, "llama_cpp": metadata.version("llama-cpp-python")}

    def build(self, tmp: Path) -> dict:
        f16 = convert_to_f16(self.cfg, self.original.checkpoint, self.original.hash, self.cfg.model.name)
        name = f"model-{self.gguf_type.lower()}.gguf"
        if self.gguf_type == "F16":
            try:  # the same bytes: a hard link costs no disk
                os.link(f16, tmp / name)
            except OSError:
                shutil.copy2(f16, tmp / name)
        else:
            log.info("quantizing F16 GGUF to %s", self.gguf_type)
            quantize_file(f16, tmp / name, self.gguf_type, self.cfg.runtime.n_threads)
        return {"artifact": name, "format": "gguf", "gguf_type": self.gguf_type,
                "tensor_types": tensor_types(tmp / name)}
