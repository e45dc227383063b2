"""The dtype transformers computes in: never below the checkpoint's precision for speed; a lossless upcast where it
is measured faster; bfloat16 only where float32 does not fit."""

import json

import pytest

from pipeline.runtimes import compute_dtype


def _rates(fp32_over_half_prompt: float, fp32_over_half_decode: float, fp16: dict | None = None) -> dict:
    return {"bfloat16": {"prompt": 100.0, "decode": 10.0}, "float16": fp16 or {"prompt": 100.0, "decode": 10.0},
            "float32": {"prompt": 100.0 * fp32_over_half_prompt, "decode": 10.0 * fp32_over_half_decode}}


def test_a_float32_checkpoint_stays_float32_even_where_bfloat16_is_faster():
    dtype, why = compute_dtype.choose_cpu(_rates(0.22, 0.65), "float32", None, None)
    assert dtype == "float32" and "prompt 0.22x" in why and "decode 0.65x" in why


def test_a_half_checkpoint_is_upcast_only_where_float32_is_faster_at_both_shapes():
    assert compute_dtype.choose_cpu(_rates(5.0, 1.2), "bfloat16", None, None)[0] == "float32"
    assert compute_dtype.choose_cpu(_rates(5.0, 0.8), "bfloat16", None, None)[0] == "bfloat16"
    # the upcast must fit: 4 GiB of bf16 weights are 8 GiB in float32
    assert compute_dtype.choose_cpu(_rates(5.0, 1.2), "float16", 8 * 2**30, 9 * 2**30)[0] == "float16"


def test_a_float16_checkpoint_is_judged_by_float16_s_own_rates():
    """A CPU without native float16 kernels: bfloat16 twice float32's speed, float16 a tenth of it."""
    rates = _rates(0.5, 0.5, fp16={"prompt": 5.0, "decode": 0.5})
    dtype, why = compute_dtype.choose_cpu(rates, "float16", None, None)
    assert dtype == "float32" and "float32 / float16" in why and "prompt 10.00x" in why
    assert compute_dtype.choose_cpu(rates, "bfloat16", None, None)[0] == "bfloat16"


def test_float32_weights_that_do_not_fit_the_memory_take_bfloat16_and_say_so():
    dtype, why = compute_dtype.choose_cpu(_rates(5.0, 1.2), "float32", weights_fp32_bytes=28 * 2**30,
                                          available_bytes=22 * 2**30)
    assert dtype == "bfloat16" and "28.0 GiB" in why and "22.0 GiB available" in why and "rounding" in why


def test_on_a_gpu_the_checkpoints_own_half_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert compute_dtype.resolve("cuda", tmp_path, 2)[0] == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    dtype, why = compute_dtype.resolve("cuda", tmp_path, 2)
    assert dtype == "bfloat16" and "float32" in why


@pytest.mark.integration
def test_the_speeds_are_measured_once_per_cpu_and_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(compute_dtype, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(compute_dtype, "_SECONDS_PER_SHAPE", 0.05)
    calls = []
    real = compute_dtype.measure_rates
    monkeypatch.setattr(compute_dtype, "measure_rates", lambda t: calls.append(t) or real(t))
    first = compute_dtype.cpu_rates(1)
    assert calls == [1] and set(first) == {"float32", "bfloat16", "float16"}
    assert all(first[d][s] > 0 for d in first for s in ("prompt", "decode"))
    assert compute_dtype.cpu_rates(1) == first and calls == [1]
    (record,) = tmp_path.glob("*.json")
    record.write_text("{damaged")
    compute_dtype.cpu_rates(1)
    assert calls == [1, 1], "a damaged record is measured again"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    dtype, why = compute_dtype.resolve("cpu", tmp_path, 1)
    assert dtype == "float32" and "forward speed measured here" in why


def _overflowing_float16_llama(out, tokenizer_dir):
    """A tiny Llama whose MLP outputs reach ~1e5: finite in float32, beyond float16's 65504, stored as float16."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 5.0 if ".mlp." in name else 1.0)
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def test_a_float16_model_whose_activations_overflow_is_recomputed_in_a_safe_dtype(tmp_path, tiny_tokenizer_dir,
                                                                                    monkeypatch):
    """float16 chosen for speed (rates faked so float16 wins) on a model whose activations exceed its range: the
    runtime's range probe finds non-finite logits, loads it again in float32, says so, and its log-probabilities
    are finite. A float16 the variant set itself fails, naming the setting."""
    import numpy as np
    import pytest

    from pipeline.infra.errors import ConfigError
    from pipeline.runtimes.hf import HFRuntime
    from tests.conftest import compose

    model = _overflowing_float16_llama(tmp_path / "m", tiny_tokenizer_dir)
    monkeypatch.setattr(compute_dtype, "cpu_rates", lambda threads: _rates(0.5, 0.5))
    cfg = compose([f"paths.artifacts={tmp_path / 'a'}"])
    assert compute_dtype.resolve("cpu", model, 1)[0] == "float16"        # what speed alone would choose
    rt = HFRuntime(model, {}, cfg.runtime)
    assert rt.info["dtype"] == "float32"
    assert rt.info["dtype_choice"].startswith("float16 gave non-finite logits on a range probe")
    ids = list(range(10, 60))
    assert np.isfinite(rt.logprobs(ids, list(range(len(ids) - 1)))).all()
    with pytest.raises(ConfigError, match=r"variant.runtime_options.dtype='float16' is not valid for this model"):
        HFRuntime(model, {"dtype": "float16"}, cfg.runtime)
