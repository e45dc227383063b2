"""llm-compressor's AWQ, run as a child process inside llm-compressor's own virtual environment (`make llmc-env`).

    <llmc-env>/bin/python llmc_worker.py SPEC.json

It imports nothing from quantdrift (that environment has other transformers and compressed-tensors versions than
the main one): SPEC holds the source checkpoint, the output folder, the settings and the calibration token ids,
which the main environment tokenized. It writes a compressed-tensors checkpoint (pack-quantized) and
stats.json beside SPEC (peak RSS, samples, tokens, phase times).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _cpu_only_cache_pinning() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device copies, and torch refuses
    to pin memory without an accelerator ("Cannot access accelerator device when none is available"). On a
    CPU there is no copy to speed up: pinning becomes a no-op."""
    import torch

    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def main(spec_path: str) -> None:
    started = time.time()
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads(Path(spec_path).read_text())
    s = spec["settings"]
    _cpu_only_cache_pinning()
    model = AutoModelForCausalLM.from_pretrained(spec["source"], dtype=getattr(torch, s["dtype"]),
                                                 trust_remote_code=spec["trust_remote_code"])
    tok = AutoTokenizer.from_pretrained(spec["source"], trust_remote_code=spec["trust_remote_code"])
    ids = spec["calibration"]
    data = Dataset.from_list([{"input_ids": x, "attention_mask": [1] * len(x)} for x in ids])
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=s["bits"], type="int", symmetric=s["sym"], strategy="group", group_size=s["group_size"]))
    recipe = [AWQModifier(duo_scaling=s["duo_scaling"], n_grid=s["n_grid"]),
              QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]
    loaded = time.time()
    oneshot(model=model, processor=tok, dataset=data, recipe=recipe, max_seq_length=max(len(x) for x in ids),
            num_calibration_samples=len(ids), shuffle_calibration_samples=False)
    quantized = time.time()
    target = getattr(torch, s["save_dtype"])
    with torch.no_grad():   # what is not quantized (embeddings, norms, a tied head) ships in save_dtype
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                for p in module.parameters(recurse=False):
                    if p.is_floating_point():
                        p.data = p.data.to(target)
    model.config.dtype = s["save_dtype"]
    model.save_pretrained(spec["out"], save_compressed=True)
    tok.save_pretrained(spec["out"])
    Path(spec_path).with_name("stats.json").write_text(json.dumps({
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "samples": len(ids),
        "tokens": sum(len(x) for x in ids), "load_s": loaded - started, "oneshot_s": quantized - loaded,
        "save_s": time.time() - quantized, "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main(sys.argv[1])
