"""What the transformers runtime checks once a checkpoint is loaded, before any figure is taken from it: that
every weight was found, and that the compute dtype holds the model's activations."""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.errors import ConfigError, Skip

# float16's largest finite value is 65504: a residual stream that reaches a quarter of it is one layer from
# overflowing on real text (the probe's text is short and plain)
_FP16_MARGIN = 65504 / 4
# the probe: token ids spread over the vocabulary, deterministic
_PROBE_TOKENS = 48


def check_loaded(artifact: Path, model_class: str, loading: dict) -> None:
    """transformers starts weights it finds no tensor for from random values and only logs it: a checkpoint
    written in another module layout (a quantizer's per-expert or unfused projections against this transformers'
    fused ones) then runs with random weights. Any such weight makes the artifact unusable here (a Skip naming
    them), never a figure."""
    import transformers

    missing = sorted(set(loading.get("missing_keys") or ()) | {k[0] for k in loading.get("mismatched_keys") or ()})
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise Skip(f"transformers {transformers.__version__} loaded {artifact.name} as {model_class} with "
                   f"{len(missing)} weight(s) missing or of another shape ({shown}): the checkpoint's layout is not "
                   "this transformers' for the architecture, and those weights would be random")


def range_overflow(model, dtype: str, device: str) -> str | None:
    """Why ``dtype`` does not hold this model's activations, or None. Only float16 is at risk (bfloat16 and float32
    share float32's exponent range): one forward of a short probe with the hidden states kept; non-finite logits or
    a hidden state beyond a quarter of float16's range overflows."""
    if dtype != "float16":
        return None
    import torch

    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = torch.tensor([[(7919 * i + 13) % vocab for i in range(_PROBE_TOKENS)]], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    if not bool(torch.isfinite(out.logits).all()):
        return "float16 gave non-finite logits on a range probe (the model's activations exceed its range)"
    peak = max((float(h.float().abs().max()) for h in (out.hidden_states or ())), default=0.0)
    if peak > _FP16_MARGIN:
        return (f"float16 holds this model's activations with no margin (a hidden state of {peak:.0f} on a range "
                f"probe; float16 overflows at 65504)")
    return None


def safe_dtype(dtype: str, overflow: str, device: str, configured: bool) -> tuple[str, str]:
    """(the dtype to load again in, why) after ``overflow``: float32 on a CPU (float16 upcast is lossless),
    bfloat16 on a GPU (float32's range, half the memory). A dtype the variant set itself is not overridden: the
    variant fails, naming the setting."""
    if configured:
        raise ConfigError(f"variant.runtime_options.dtype={dtype!r} is not valid for this model: {overflow}; "
                          "expected bfloat16 or float32 (or leave it unset)")
    safe = "float32" if device == "cpu" else "bfloat16"
    return safe, f"{overflow}: computed in {safe} instead, which has float32's range"


def free_memory(device: str) -> None:
    """Release a model dropped before loading it again (accelerate's hooks can hold it in a reference cycle), so
    the second load's peak is its own."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
