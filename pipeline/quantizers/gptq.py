"""GPTQ and AWQ variants through GPTQModel (the maintained successor of AutoGPTQ and AutoAWQ).

The quantization itself runs in a child process: GPTQModel sets process-wide environment (allocator, device
order), writes ./logs into the current directory, and its peak memory is only meaningful per process. The
parent records wall time and the child's peak RSS. Artifacts are GPTQModel's standard folders, which
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads (with gptqmodel and optimum installed).

Variant settings (variant.quantize):
    method: gptq | awq
    bits: 4 | 8
    group_size: auto | 128 | 64 | 32   (auto: the largest of 128/64/32 dividing every quantized input size)
    desc_act: false                    (gptq)
    sym: true | false
    dtype: auto | float32 | bfloat16 | float16   (compute dtype while quantizing; auto: on CUDA the checkpoint's
                                                own half type (bfloat16 where it declares float32), on a CPU
                                                float32 for GPTQ and bfloat16 for AWQ, whose packing needs a half
                                                type)
    save_dtype: float16 | bfloat16 | float32   (the unquantized tensors as shipped: embeddings, norms, head;
                                                default: the compute dtype, float16 when that is float32)
    calibration: {path: JSONL with a text field | dataset: NAME, split, field, samples, seq_len}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from importlib import metadata
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.infra.cpus import usable_cpus
from pipeline.infra.errors import ConfigError
from pipeline.quantizers.base import Quantizer, Skip, run_worker
from pipeline.quantizers.calibration import (DEFAULT_CALIBRATION, PROJECT_ROOT, calibration_key, calibration_texts,
                                             check_calibration, check_group_size)

log = logging.getLogger(__name__)

GROUP_SIZES = (128, 64, 32)


def quantized_input_sizes(checkpoint: Path, dim: int = 1) -> dict[str, int]:
    """in_features (dim=1) or out_features (dim=0) of every linear GPTQ/AWQ quantizes: the 2-D weights inside
    the decoder layers."""
    from safetensors import safe_open

    sizes = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(path), framework="np") as fh:
            for name in fh.keys():
                if ".layers." in name and name.endswith(".weight"):
                    shape = fh.get_slice(name).get_shape()
                    if len(shape) == 2:
                        sizes[name] = int(shape[dim])
    return sizes


def choose_group_size(input_sizes: dict[str, int] | list[int], candidates=GROUP_SIZES) -> int:
    """The largest candidate that divides every quantized layer's input size (fast CPU kernels need it)."""
    values = set(input_sizes.values() if isinstance(input_sizes, dict) else input_sizes)
    if not values:
        raise Skip("no quantizable linear layers found inside the decoder layers")
    for g in candidates:
        if all(v % g == 0 for v in values):
            return g
    raise Skip(f"no group size in {candidates} divides every quantized input size {sorted(values)}")


def load_calibration(spec: dict, tokenizer, samples: int, seq_len: int) -> list[dict]:
    """Calibration texts (``calibration_texts``) tokenized to at most seq_len tokens."""
    texts = calibration_texts(spec)
    out = []
    for text in texts[:samples]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return out


@dataclass
class GPTQModelSettings:
    """variant.quantize for gptqmodel (see the module docstring)."""

    method: str = "gptq"
    bits: int = 4
    group_size: int | str = "auto"
    desc_act: bool = False
    sym: bool | None = None
    dtype: str | None = None
    save_dtype: str | None = None
    calibration: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from pipeline.config.settings import one_of

        one_of("variant.quantize.method", self.method, ("gptq", "awq"))
        one_of("variant.quantize.bits", self.bits, (4,) if self.method == "awq" else (2, 3, 4, 8))
        check_group_size(self.group_size)
        if self.dtype is not None:
            one_of("variant.quantize.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.save_dtype is not None:
            one_of("variant.quantize.save_dtype", self.save_dtype, ("float32", "bfloat16", "float16"))
        check_calibration(self.calibration)


def quantize_dtype(q: dict, device: str, checkpoint: Path | None) -> str:
    """The dtype GPTQModel quantizes in for variant.quantize ``q``: its ``dtype`` where it names one; ``auto`` (or
    none): on CUDA the checkpoint's own half type (bfloat16 where it declares float32, or where no checkpoint is
    given, as the planner asks: a GPU computes half types at full rate and holds twice the model), on a CPU float32
    for GPTQ and bfloat16 for AWQ (its packing needs a half type)."""
    if q.get("dtype") not in (None, "auto"):
        return q["dtype"]
    if device.startswith("cuda"):
        from pipeline.runtimes.compute_dtype import checkpoint_dtype

        own = checkpoint_dtype(checkpoint) if checkpoint is not None else None
        return own if own in ("bfloat16", "float16") else "bfloat16"
    return "bfloat16" if q.get("method", "gptq") == "awq" else "float32"


class GPTQModelQuantizer(Quantizer):
    Settings = GPTQModelSettings

    def settings(self) -> dict:
        q = dict(self.variant.quantize)
        method = q.get("method", "gptq")
        if method not in ("gptq", "awq"):
            raise ConfigError(f"variant {self.variant.name}: quantize.method={method!r}: expected gptq or awq")
        bits = q.get("bits", 4)
        if bits not in (2, 3, 4, 8) or (method == "awq" and bits != 4):
            raise ConfigError(f"variant {self.variant.name}: quantize.bits={bits!r}: expected 4 or 8 (awq: 4)")
        calib = {**DEFAULT_CALIBRATION, **(q.get("calibration") or {})}
        group = q.get("group_size", "auto")
        if group == "auto":
            group = choose_group_size(quantized_input_sizes(self.original.checkpoint))
        elif not isinstance(group, int) or group <= 0:
            raise ConfigError(f"variant {self.variant.name}: quantize.group_size={group!r}: expected auto or an int")
        if method == "awq":
            odd = sorted({v for v in quantized_input_sizes(self.original.checkpoint, dim=0).values() if v % 64})
            if odd:   # GPTQModel 7.6's AWQ clip search batches output channels by 64 and asserts on the rest
                raise Skip(f"AWQ in GPTQModel needs every quantized layer's output size to be a multiple of 64; "
                           f"this model has {odd}")
        dtype = quantize_dtype(q, self.cfg.runtime.device, self.original.checkpoint)
        settings = {"method": method, "bits": bits, "group_size": group, "desc_act": bool(q.get("desc_act", False)),
                    "sym": bool(q.get("sym", method == "gptq")), "dtype": dtype, "calibration": calib}
        # A user ships the unquantized tensors (embeddings, norms, a tied head) in a half type, not in the fp32 a
        # CPU computes in: left in fp32 they made GPTQ W4's file 167 MiB against AWQ's 112. Recorded only when the
        # saved dtype differs from the compute dtype (the artifact is then cast after GPTQModel saves it).
        save_dtype = q.get("save_dtype") or ("float16" if dtype == "float32" else dtype)
        if save_dtype != dtype:
            settings["save_dtype"] = save_dtype
        return settings

    def key(self) -> dict:
        s = self.settings()
        return {**s, "calibration": calibration_key(s["calibration"]), "gptqmodel": _version("gptqmodel")}

    def producer(self, manifest: dict) -> dict:
        s, key = manifest.get("quantize_settings") or self.settings(), manifest.get("key") or {}
        calib = s["calibration"]
        source = Path(calib["path"]).name if calib.get("path") else calib.get("dataset")
        recipe = (f"{s['method'].upper()} W{s['bits']}, g{s['group_size']}, {'sym' if s['sym'] else 'asym'}"
                  + (", act-order" if s.get("desc_act") else "") + f", {s['dtype']} compute"
                  + (f", {s['save_dtype']} unquantized tensors" if s.get("save_dtype") else "") + ", "
                  f"{manifest.get('calibration_samples', calib.get('samples'))}×≤{calib.get('seq_len')} tokens of {source}")
        return {"tool": "GPTQModel", "version": key.get("gptqmodel"), "recipe": recipe}

    def build(self, tmp: Path) -> dict:
        if _version("gptqmodel") is None:
            raise Skip("gptqmodel is not installed (pip install gptqmodel==7.6.0 optimum==2.3.0; make setup does)")
        s = self.settings()
        spec = {"source": str(self.original.checkpoint), "out": str(tmp / "model"), "settings": s,
                "device": "cuda" if self.cfg.runtime.device.startswith("cuda") else "cpu",
                "trust_remote_code": self.cfg.model.trust_remote_code}
        log.info("quantizing %s with GPTQModel (%s %d-bit, group %d; minutes on a CPU)", self.variant.name,
                 s["method"], s["bits"], s["group_size"])
        with tempfile.TemporaryDirectory(prefix="qd-gptq-") as scratch:
            spec_path = Path(scratch) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            env = dict(os.environ, GPTQMODEL_CPU_WORKERS=str(usable_cpus()), PYTHONUNBUFFERED="1")
            env["PYTHONPATH"] = str(PROJECT_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            stats, wall = run_worker([sys.executable, "-m", "pipeline.quantizers.gptq", str(spec_path)],
                                     Path(scratch), env, f"GPTQModel {s['method']} quantization")
        return {"artifact": "model", "format": s["method"], "quantize_settings": s, "group_size": s["group_size"],
                "quantize_wall_s": wall, "quantize_peak_rss_mb": stats["peak_rss_mb"],
                "calibration_samples": stats["samples"], "calibration_tokens": stats["tokens"]}


def cast_unquantized(folder: Path, dtype: str) -> int:
    """Rewrite a saved GPTQ/AWQ folder's floating-point tensors that are not quantization data (embeddings, norms,
    an untied head, biases) in ``dtype``, and say so in config.json. The packed weights, zeros, group indices and
    scales stay as GPTQModel wrote them. Returns how many tensors were cast."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    packed = ("qweight", "qzeros", "scales", "g_idx")
    cast = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        for name, t in tensors.items():
            if t.is_floating_point() and t.dtype != target and name.rsplit(".", 1)[-1] not in packed:
                tensors[name] = t.to(target)
                cast += 1
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.chmod(tmp, path.stat().st_mode)
        os.replace(tmp, path)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config_path.write_text(json.dumps(config, indent=2))
    return cast


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _worker(spec_path: str) -> None:
    """Child process: load, calibrate, quantize, save. Runs with cwd = a scratch directory."""
    import torch
    from transformers import AutoTokenizer

    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel
    from pipeline.instruments.memory import peak_rss_mb

    spec = json.loads(Path(spec_path).read_text())
    s = spec["settings"]
    tok = AutoTokenizer.from_pretrained(spec["source"], trust_remote_code=spec["trust_remote_code"])
    calib = s["calibration"]
    data = load_calibration(calib, tok, int(calib["samples"]), int(calib["seq_len"]))
    if s["method"] == "gptq":
        qcfg = GPTQConfig(bits=s["bits"], group_size=s["group_size"], desc_act=s["desc_act"], sym=s["sym"],
                          offload_to_disk=False)
        backend = BACKEND.AUTO
    else:
        qcfg = AWQConfig(bits=s["bits"], group_size=s["group_size"], sym=s["sym"], offload_to_disk=False)
        backend = BACKEND.AWQ_TORCH if spec["device"] == "cpu" else BACKEND.AUTO
    model = GPTQModel.load(spec["source"], qcfg, device=spec["device"], dtype=getattr(torch, s["dtype"]),
                           trust_remote_code=spec["trust_remote_code"])
    model.quantize(data, batch_size=1, backend=backend)
    model.save(spec["out"])
    tok.save_pretrained(spec["out"])
    if s.get("save_dtype"):
        cast_unquantized(Path(spec["out"]), s["save_dtype"])
    Path(spec_path).with_name("stats.json").write_text(json.dumps({
        "peak_rss_mb": peak_rss_mb(), "samples": len(data), "tokens": sum(len(d["input_ids"]) for d in data)}))


if __name__ == "__main__":
    _worker(sys.argv[1])
