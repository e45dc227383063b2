"""AWQ through llm-compressor (vllm-project), the second AWQ producer beside GPTQModel.

llm-compressor pins a transformers and a compressed-tensors the main environment does not have, so it lives in its
own virtual environment (`make llmc-env`, kept outside the project like the llama.cpp wheel) and runs only there,
as a child process (``llmc_worker.py``, which imports nothing of this package). The main environment tokenizes
the calibration text and hands the worker token ids; the worker writes a compressed-tensors checkpoint
(pack-quantized int4, per-group scales and zero points), which transformers loads in the main environment with
the ``compressed-tensors`` package and which the report scores like every other variant.

Variant settings (variant.quantize):
    method: awq
    bits: 4
    group_size: auto | 128 | 64 | 32   (auto: the largest of 128/64/32 dividing every quantized input size)
    sym: false | true
    dtype: float32 | bfloat16          (compute dtype while quantizing; a CPU has no fast half precision)
    save_dtype: float16 | bfloat16 | float32   (the unquantized tensors as shipped; default float16)
    duo_scaling: true | false          (AWQ scales from activations and weights, llm-compressor's default)
    n_grid: 20                         (scale-search grid points per mapping)
    calibration: {path | dataset, field, samples, seq_len}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.infra.make_paths import make_print
from pipeline.quantizers.base import Quantizer, Skip, run_worker
from pipeline.quantizers.calibration import (DEFAULT_CALIBRATION, calibration_key, check_calibration,
                                             check_group_size)
from pipeline.quantizers.gptq import choose_group_size, load_calibration, quantized_input_sizes

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("llmc_worker.py")


def environment_python() -> Path:
    """The llm-compressor environment's interpreter: $QUANTDRIFT_LLMC_PYTHON, else what `make print-llmc-python`
    names (the Makefile owns the layout). Skip, naming `make llmc-env`, when it is not built."""
    python = os.environ.get("QUANTDRIFT_LLMC_PYTHON", "") or make_print("print-llmc-python")
    path = Path(python) if python else None
    if path is None or not (path.is_file() and os.access(path, os.X_OK)):
        raise Skip(f"llm-compressor's environment is not built ({python or 'no interpreter named'}): run "
                   "`make llmc-env` (its own virtual environment: llm-compressor pins transformers and "
                   "compressed-tensors versions the main environment does not use)")
    return path


def environment_versions(python: Path) -> dict[str, str]:
    """Versions of the libraries that make the artifact, read from the environment's installed metadata (no
    interpreter start)."""
    found = {}
    for dist in (python.parent.parent / "lib").glob("python3*/site-packages/*.dist-info"):
        name, _, version = dist.name[: -len(".dist-info")].rpartition("-")
        key = name.lower().replace("_", "-")
        if key in ("llmcompressor", "compressed-tensors", "transformers", "torch"):
            found[key] = version
    if "llmcompressor" not in found:
        raise Skip(f"llm-compressor is not installed in {python.parent.parent}: run `make llmc-env`")
    return dict(sorted(found.items()))


@dataclass
class LLMCompressorSettings:
    """variant.quantize for llmcompressor (see the module docstring)."""

    method: str = "awq"
    bits: int = 4
    group_size: int | str = "auto"
    sym: bool = False
    dtype: str = "float32"
    save_dtype: str = "float16"
    duo_scaling: bool = True
    n_grid: int = 20
    calibration: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from pipeline.config.settings import one_of, positive_int

        one_of("variant.quantize.method", self.method, ("awq",))
        one_of("variant.quantize.bits", self.bits, (4,))
        check_group_size(self.group_size)
        one_of("variant.quantize.dtype", self.dtype, ("float32", "bfloat16"))
        one_of("variant.quantize.save_dtype", self.save_dtype, ("float16", "bfloat16", "float32"))
        positive_int("variant.quantize.n_grid", self.n_grid)
        check_calibration(self.calibration)


class LLMCompressorQuantizer(Quantizer):
    Settings = LLMCompressorSettings

    def settings(self) -> dict:
        s = LLMCompressorSettings(**dict(self.variant.quantize))
        group = s.group_size
        if group == "auto":
            group = choose_group_size(quantized_input_sizes(self.original.checkpoint))
        return {"method": s.method, "bits": s.bits, "group_size": group, "sym": bool(s.sym), "dtype": s.dtype,
                "save_dtype": s.save_dtype, "duo_scaling": bool(s.duo_scaling), "n_grid": s.n_grid,
                "calibration": {**DEFAULT_CALIBRATION, **(s.calibration or {})}}

    def key(self) -> dict:
        s = self.settings()
        return {**s, "calibration": calibration_key(s["calibration"]),
                "environment": environment_versions(environment_python())}

    def producer(self, manifest: dict) -> dict:
        s, key = manifest.get("quantize_settings") or self.settings(), manifest.get("key") or {}
        calib = s["calibration"]
        source = Path(calib["path"]).name if calib.get("path") else calib.get("dataset")
        recipe = (f"AWQ W{s['bits']}, g{s['group_size']}, {'sym' if s['sym'] else 'asym'}, {s['dtype']} compute, "
                  f"{s['save_dtype']} unquantized tensors, "
                  f"{manifest.get('calibration_samples', calib.get('samples'))}×≤{calib.get('seq_len')} tokens of "
                  f"{source}")
        return {"tool": "llm-compressor", "version": (key.get("environment") or {}).get("llmcompressor"),
                "recipe": recipe}

    def build(self, tmp: Path) -> dict:
        python = environment_python()
        s = self.settings()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.original.checkpoint),
                                            trust_remote_code=self.cfg.model.trust_remote_code)
        calib = s["calibration"]
        data = load_calibration(calib, tok, int(calib["samples"]), int(calib["seq_len"]))
        spec = {"source": str(self.original.checkpoint), "out": str(tmp / "model"), "settings": s,
                "calibration": [d["input_ids"] for d in data], "trust_remote_code": self.cfg.model.trust_remote_code}
        log.info("quantizing %s with llm-compressor (AWQ %d-bit, group %d, %d calibration texts; minutes on a CPU)",
                 self.variant.name, s["bits"], s["group_size"], len(data))
        with tempfile.TemporaryDirectory(prefix="qd-llmc-") as scratch:
            spec_path = Path(scratch) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            # the child sees only its own environment: no PYTHONPATH into this project, no inherited venv
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
            env["PYTHONUNBUFFERED"] = "1"
            stats, wall = run_worker([str(python), str(WORKER), str(spec_path)], Path(scratch), env,
                                     "llm-compressor AWQ quantization")
        return {"artifact": "model", "format": "compressed-tensors", "quantize_settings": s,
                "group_size": s["group_size"], "quantize_wall_s": wall, "quantize_peak_rss_mb": stats["peak_rss_mb"],
                "calibration_samples": stats["samples"], "calibration_tokens": stats["tokens"],
                "worker_stats": stats}
