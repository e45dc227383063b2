"""GGUF variants: llama.cpp's own converter (HF -> F16 GGUF), then llama_model_quantize to each type.

The converter and its gguf-py come from the source distribution of the installed llama-cpp-python release
(`make setup` fetches them into paths.cache): PyPI's gguf package lags the converter."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from typing import TYPE_CHECKING

from pipeline.infra.child_processes import child_options
from pipeline.infra.errors import ConfigError, raise_if_signalled
from pipeline.quantizers.base import Quantizer, Skip
from pipeline.infra.stage_cache import run_stage
from pipeline.infra.gguf_file import fallback_tensors, tensor_types, type_elements
from pipeline.quantizers.gguf_convert import conversion_failure, conversion_phases, known_pre_tokenizers

if TYPE_CHECKING:
    from pipeline.config.schema import Config

log = logging.getLogger(__name__)

F16_FILE = "model-f16.gguf"


def converter_dir(cfg: Config) -> Path:
    version = metadata.version("llama-cpp-python")
    return Path(cfg.paths.cache) / f"llama-cpp-python-{version}"


def converter_command(src: Path, pre: str, checkpoint: Path, outfile: Path, *args: str) -> tuple[list[str], dict]:
    """The command and environment that run llama.cpp's converter (vendored at ``src``) through the wrapper that
    can set the BPE pre-tokenizer name ``pre`` ("" for the converter's own choice)."""
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py") + os.pathsep + str(src) + os.pathsep
               + str(Path(__file__).resolve().parents[2]), NO_LOCAL_GGUF="")
    cmd = [sys.executable, "-m", "pipeline.quantizers.gguf_convert", str(src), pre, "--", str(checkpoint),
           "--outfile", str(outfile), *args]
    return cmd, env


def convert_checkpoint(cfg: Config, checkpoint: Path, upstream_hash: str, model_name: str, out_dir: Path) -> Path:
    """HF checkpoint -> F16 GGUF with llama.cpp's own converter, cached in ``out_dir``."""
    src = converter_dir(cfg)
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConfigError(f"llama.cpp's converter is missing at {script}: run `make converter` (or `make setup`), "
                          "which fetches the llama-cpp-python source distribution into paths.cache")

    def build(tmp: Path) -> dict:
        from pipeline.infra.files import check_free_space, dir_bytes

        check_free_space(tmp, 1.1 * dir_bytes(checkpoint), f"converting {checkpoint.name} to F16 GGUF")
        cmd, env = converter_command(src, pre, checkpoint, tmp / F16_FILE, "--outtype", "f16",
                                     "--model-name", model_name)
        log.info("converting %s to F16 GGUF with llama.cpp's converter%s", checkpoint,
                 f" (BPE pre-tokenizer set to {pre!r})" if pre else "")
        started = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **child_options())
        ended = time.time()
        raise_if_signalled(proc.returncode, "llama.cpp's converter", refusal(proc.stderr + proc.stdout))
        if proc.returncode != 0:
            # any conversion failure costs the GGUF variants only: a Skip with the converter's own cause
            raise Skip(conversion_failure(proc.stderr + proc.stdout, proc.returncode))
        return {"artifact": F16_FILE, "tensor_types": tensor_types(tmp / F16_FILE),
                "gguf_pre_tokenizer_override": pre or None,
                "phases_s": conversion_phases(proc.stderr, started, ended)}

    pre = cfg.model.gguf_pre_tokenizer
    if pre and pre not in known_pre_tokenizers(src):
        raise ConfigError(f"model.gguf_pre_tokenizer={pre!r} is not a pre-tokenizer llama.cpp's converter knows: "
                          f"expected one of {', '.join(known_pre_tokenizers(src))}")
    key = {"upstream": upstream_hash, "converter": str(script), "llama_cpp": metadata.version("llama-cpp-python"),
           **({"pre_tokenizer": pre} if pre else {})}
    run_stage("convert:f16-gguf", out_dir, key, build, force=False)
    return out_dir / F16_FILE


def convert_to_f16(cfg: Config, checkpoint: Path, original_hash: str, model_name: str) -> Path:
    """The F16 GGUF of the original, shared by every GGUF variant (cached under <model>/gguf-f16)."""
    return convert_checkpoint(cfg, checkpoint, original_hash, model_name, cfg.model_dir / "gguf-f16")


def quantize_file(src: Path, dst: Path, ftype_name: str, threads: int) -> None:
    """In-process llama_model_quantize (no importance matrix: llama-cpp-python cannot pass one)."""
    from pipeline.infra.llama_tools import load_llama_cpp

    llama_cpp = load_llama_cpp()

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}", None)
    if ftype is None:
        known = sorted(n[len("LLAMA_FTYPE_MOSTLY_"):] for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ConfigError(f"variant.quantize.type={ftype_name!r} is not a llama.cpp type: expected one of {', '.join(known)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        hint = " (low-bit IQ types need an importance matrix: variant.quantize.imatrix: true)" \
            if ftype_name.startswith("IQ") else ""
        raise Skip(f"llama.cpp refused to quantize this model to {ftype_name} (llama_model_quantize code {rc}){hint}")


def refusal(text: str) -> str:
    """llama.cpp's own reason for a failed llama-quantize / llama-imatrix run: its error lines, else the tail."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("=")]
    errors = [ln for ln in lines if any(w in ln.lower() for w in ("error", "failed", "missing", "bailing", "invalid"))]
    return " | ".join((errors or lines)[-3:])[:600]


def llama_quantize(tools: str, src: Path, dst: Path, ftype_name: str, threads: int,
                   imatrix: Path | None = None) -> list[str] | None:
    """llama.cpp's own llama-quantize (``--imatrix`` when given), from `make llama-tools`, the same build of llama.cpp
    as the bindings load: without an importance matrix it writes byte-identical files to the in-process
    llama_model_quantize (tests/test_imatrix.py checks it), so the artifact's key does not depend on which ran.
    Returns its fallback warnings, or None when the tool is not built (then only a plain quant can run, in
    process). A type it refuses for this model is a Skip carrying llama.cpp's own reason."""
    from pipeline.infra.llama_tools import tool

    try:
        exe = tool("llama-quantize", tools)
    except ConfigError as exc:
        if imatrix is not None:
            raise Skip(f"an importance-matrix quant needs llama.cpp's tools: {exc}") from None
        return None
    cmd = [str(exe), *(["--imatrix", str(imatrix)] if imatrix else []), str(src), str(dst), ftype_name, str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, **child_options())
    text = proc.stderr + proc.stdout
    if proc.returncode != 0:
        dst.unlink(missing_ok=True)
        raise_if_signalled(proc.returncode, "llama-quantize", refusal(text))
        if "invalid ftype" in text or "unknown ftype" in text.lower():
            raise ConfigError(f"variant.quantize.type={ftype_name!r} is not a llama.cpp type: {refusal(text)}")
        raise Skip(f"llama-quantize refused {ftype_name} for this model: {refusal(text)}")
    return [ln.strip() for ln in text.splitlines() if "falling back" in ln]


def imatrix_stage(cfg: Config, original, f16: Path, spec: dict, chunks: int | None, ctx: int) -> tuple[Path, dict]:
    """llama.cpp's importance matrix of the F16 GGUF over the calibration text (never an evaluation turn), with
    its own llama-imatrix; cached by its inputs, shared by every importance-matrix variant."""
    from pipeline.infra.llama_tools import tool
    from pipeline.quantizers.calibration import calibration_key, calibration_texts
    from pipeline.infra.stage_cache import load_manifest
    from pipeline.infra.files import stable_hash

    try:
        exe = tool("llama-imatrix", cfg.bench.llama_tools)
    except ConfigError as exc:
        raise Skip(f"an importance-matrix quant needs llama.cpp's tools: {exc}") from None
    key = {"f16": load_manifest(f16.parent)["key_hash"], "calibration": calibration_key(spec), "chunks": chunks,
           "ctx": ctx, "llama_cpp": metadata.version("llama-cpp-python")}
    out_dir = cfg.model_dir / "imatrix" / stable_hash(key)[:16]

    def build(tmp: Path) -> dict:
        texts = calibration_texts(spec)
        (tmp / "calibration.txt").write_text("\n\n".join(texts), encoding="utf-8")
        cmd = [str(exe), "-m", str(f16), "-f", str(tmp / "calibration.txt"), "-o", str(tmp / "imatrix.gguf"),
               "-c", str(ctx), "-t", str(cfg.runtime.n_threads), "--no-ppl"]
        if chunks:
            cmd += ["--chunks", str(chunks)]
        log.info("computing the importance matrix of %s on %d calibration texts (llama-imatrix)", f16.name, len(texts))
        proc = subprocess.run(cmd, capture_output=True, text=True, **child_options())
        text = proc.stderr + proc.stdout
        if proc.returncode != 0 or not (tmp / "imatrix.gguf").is_file():
            raise RuntimeError(f"llama-imatrix failed (exit {proc.returncode}): {refusal(text)}")
        import re

        m = re.search(r"computing over (\d+) chunks", text)
        return {"artifact": "imatrix.gguf", "chunks": int(m.group(1)) if m else None, "ctx": ctx,
                "calibration_texts": len(texts), "calibration": {k: v for k, v in spec.items()}}

    manifest = run_stage("imatrix", out_dir, key, build, force=cfg.force)
    return out_dir / manifest["artifact"], {k: manifest.get(k) for k in ("key_hash", "chunks", "ctx", "wall_s",
                                                                          "calibration_texts")}


@dataclass
class GGUFSettings:
    """variant.quantize for gguf: the llama.cpp file type (F16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, IQ4_XS, ...),
    and whether an importance matrix (llama-imatrix on calibration text) guides it, as published GGUF files are
    made: imatrix: true, calibration: {path | dataset, field} (default prompts/calibration.jsonl),
    imatrix_chunks (null: all of the text), imatrix_ctx (tokens per chunk, llama-imatrix's 512)."""

    type: str
    imatrix: bool = False
    calibration: dict = field(default_factory=dict)
    imatrix_chunks: int | None = None
    imatrix_ctx: int = 512

    def __post_init__(self) -> None:
        from pipeline.quantizers.calibration import CALIBRATION_KEYS
        from pipeline.config.settings import one_of, positive_int, require

        require(isinstance(self.type, str) and self.type.replace("_", "").isalnum(), "variant.quantize.type",
                self.type, "a llama.cpp type name such as Q4_K_M")
        require(isinstance(self.imatrix, bool), "variant.quantize.imatrix", self.imatrix, "true or false")
        positive_int("variant.quantize.imatrix_chunks", self.imatrix_chunks, allow_none=True)
        positive_int("variant.quantize.imatrix_ctx", self.imatrix_ctx)
        for k in self.calibration or {}:
            one_of("variant.quantize.calibration", k, CALIBRATION_KEYS)
        require(self.imatrix or not (self.calibration or self.imatrix_chunks), "variant.quantize.calibration",
                self.calibration or self.imatrix_chunks, "calibration settings only with imatrix: true")


class GGUFQuantizer(Quantizer):
    """variant.quantize: {type: F16 | Q8_0 | Q6_K | Q5_K_M | Q4_K_M | Q4_0 | IQ4_XS | ..., imatrix: bool, ...}."""

    Settings = GGUFSettings

    @classmethod
    def preflight(cls, cfg: Config, checkpoint: Path) -> str | None:
        """llama.cpp's converter on the checkpoint's vocabulary alone (a few seconds, into a scratch folder): its
        cause in words when it fails (``model.gguf_pre_tokenizer`` where that gets past it)."""
        import tempfile

        src = converter_dir(cfg)
        if not (src / "convert_hf_to_gguf.py").is_file():
            return None             # each GGUF variant reports the missing converter itself (`make converter`)
        with tempfile.TemporaryDirectory(prefix="quantdrift-preflight-") as tmp:
            cmd, env = converter_command(src, cfg.model.gguf_pre_tokenizer, checkpoint, Path(tmp) / "vocab.gguf",
                                         "--vocab-only")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **child_options())
        raise_if_signalled(proc.returncode, "llama.cpp's converter", refusal(proc.stderr + proc.stdout))
        return None if proc.returncode == 0 else conversion_failure(proc.stderr + proc.stdout, proc.returncode)

    @property
    def gguf_type(self) -> str:
        t = str(self.variant.quantize.get("type", "")).upper()
        if not t:
            raise ConfigError(f"variant {self.variant.name}: variant.quantize.type is required for gguf (e.g. Q4_K_M)")
        return t

    def _imatrix_spec(self) -> tuple[dict, int | None, int] | None:
        q = self.variant.quantize
        if not q.get("imatrix"):
            return None
        from pipeline.quantizers.calibration import DEFAULT_CALIBRATION

        spec = {k: v for k, v in {**DEFAULT_CALIBRATION, **(q.get("calibration") or {})}.items()
                if k not in ("samples", "seq_len")}          # llama-imatrix reads the whole text in ctx-sized chunks
        return spec, q.get("imatrix_chunks"), int(q.get("imatrix_ctx", 512))

    def key(self) -> dict:
        key = {"type": self.gguf_type, "llama_cpp": metadata.version("llama-cpp-python")}
        im = self._imatrix_spec()
        if im:
            from pipeline.quantizers.calibration import calibration_key

            key["imatrix"] = {"calibration": calibration_key(im[0]), "chunks": im[1], "ctx": im[2]}
        return key

    def producer(self, manifest: dict) -> dict:
        key, im = manifest.get("key") or {}, manifest.get("imatrix")
        recipe = self.gguf_type
        if im:
            source = Path(str(((key.get("imatrix") or {}).get("calibration") or {}).get("path") or "")).name
            recipe += f", importance matrix over {im.get('chunks')}×{im.get('ctx')} tokens of {source or 'a dataset'}"
        return {"tool": "llama.cpp (llama-cpp-python)", "version": key.get("llama_cpp"), "recipe": recipe}

    def build(self, tmp: Path) -> dict:
        f16 = convert_to_f16(self.cfg, self.original.checkpoint, self.original.hash, self.cfg.model.name)
        im = self._imatrix_spec()
        name = f"model-{self.gguf_type.lower()}{'-imat' if im else ''}.gguf"
        extra: dict = {}
        if self.gguf_type == "F16" and not im:
            try:  # the same bytes: a hard link costs no disk
                os.link(f16, tmp / name)
            except OSError:
                shutil.copy2(f16, tmp / name)
        else:
            imatrix, facts = imatrix_stage(self.cfg, self.original, f16, *im) if im else (None, None)
            log.info("quantizing F16 GGUF to %s%s", self.gguf_type,
                     f" with the importance matrix ({facts.get('chunks')} chunks)" if im else "")
            warnings = llama_quantize(self.cfg.bench.llama_tools, f16, tmp / name, self.gguf_type,
                                      self.cfg.runtime.n_threads, imatrix)
            if warnings is None:        # llama.cpp's tools are not built: the same library, in process
                quantize_file(f16, tmp / name, self.gguf_type, self.cfg.runtime.n_threads)
            if im:
                extra = {"imatrix": {**facts, "path": str(imatrix)}}
        types = tensor_types(tmp / name)
        fallback = fallback_tensors(self.gguf_type, types)
        if fallback:
            log.warning("%s: %d of %d quantized tensors are not %s but a 32-wide fallback type (%s): their rows are "
                        "not a multiple of 256", self.variant.base, sum(fallback.values()),
                        sum(n for t, n in types.items() if t not in ("F32", "F16", "BF16")), self.gguf_type,
                        ", ".join(f"{t} {n}" for t, n in fallback.items()))
        return {"artifact": name, "format": "gguf", "gguf_type": self.gguf_type, "tensor_types": types,
                "type_elements": type_elements(tmp / name), **extra}
