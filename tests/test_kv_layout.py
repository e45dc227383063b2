"""KV-cache bytes from the architecture: sliding-window layers (Mistral; Gemma 2/3 interleave them with global
ones) keep at most their window, latent attention (DeepSeek V2/V3) keeps a compressed latent on llama.cpp,
linear-attention layers of hybrid models keep nothing per token. The layouts come from transformers' own
configs of each family."""

import pytest

from pipeline.figures.capacity import kv_bytes_per_token_formula
from pipeline.figures.kv_layout import kv_layout


def facts(cfg) -> dict:
    heads = cfg.num_attention_heads
    return {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "attention_heads": heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, "kv_layout": kv_layout(cfg)}


def test_llama_counts_every_layer_in_full():
    from transformers import LlamaConfig

    f = facts(LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096))
    assert f["kv_layout"]["layer_kinds"] == {"full": 32, "window": 0, "none": 0}
    assert kv_bytes_per_token_formula(f, 2, 32768) == 2 * 32 * 8 * 128 * 2      # 128 KiB, Llama 3 8B


def test_mistral_sliding_window_caps_every_layer():
    from transformers import MistralConfig

    f = facts(MistralConfig(sliding_window=4096))
    full = 2 * 32 * 8 * 128 * 2
    assert f["kv_layout"] == {"layer_kinds": {"full": 0, "window": 32, "none": 0}, "window_tokens": 4096, "mla": None}
    assert kv_bytes_per_token_formula(f, 2, 2048) == full                          # inside the window
    assert kv_bytes_per_token_formula(f, 2, 32768) == pytest.approx(full / 8)     # 4096 of 32768 tokens kept
    assert kv_bytes_per_token_formula(f, 2) == full                                # no context: the bound


def test_gemma2_interleaves_local_and_global_layers():
    from transformers import Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=26, sliding_window=4096, num_key_value_heads=4, head_dim=256)
    f = facts(cfg)
    assert f["kv_layout"]["layer_kinds"] == {"full": 13, "window": 13, "none": 0}
    per_layer = 2 * 4 * 256 * 2
    assert kv_bytes_per_token_formula(f, 2, 8192) == pytest.approx(per_layer * (13 + 13 * 0.5))


def test_deepseek_v2_latent_attention_depends_on_the_runtime():
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                           qk_nope_head_dim=128, v_head_dim=128)
    f = facts(cfg)
    assert kv_bytes_per_token_formula(f, 2, 4096, latent=True) == 27 * (512 + 64) * 2
    assert kv_bytes_per_token_formula(f, 2, 4096, latent=False) == 27 * 16 * (128 + 64 + 128) * 2


def test_hybrid_linear_attention_layers_keep_nothing_per_token():
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(num_hidden_layers=48)
    f = facts(cfg)
    kinds = f["kv_layout"]["layer_kinds"]
    assert kinds == {"full": 12, "window": 0, "none": 36}
    assert kv_bytes_per_token_formula(f, 2, 4096) == 12 * 2 * cfg.num_key_value_heads * cfg.head_dim * 2


def test_facts_from_before_the_layout_count_every_layer():
    assert kv_bytes_per_token_formula({"layers": 30, "kv_heads": 3, "head_dim": 64}, 2, 4096) == 2 * 30 * 3 * 64 * 2


def _measured_kv_per_token(model, tokens: int) -> float:
    """Bytes of the K/V tensors transformers' own cache holds after a prompt of ``tokens``, per token (as
    HFRuntime.kv_cache_bytes measures them)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.arange(tokens).unsqueeze(0) % 50 + 3, use_cache=True)
    total = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers
                for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return total / tokens


@pytest.mark.parametrize("kind", ["deepseek_v2", "mistral_window", "gemma2_interleaved"])
def test_the_formula_meets_transformers_own_cache_at_the_same_context(kind):
    """What the family matrix compares (formula at the report's context against the runtime's own cache),
    on tiny random models: DeepSeek V2's latent cache, a sliding window past its end, Gemma 2's alternating
    local and global layers. Within 10 %."""
    import torch
    import transformers

    from pipeline.runtimes.hf import HFRuntime

    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    if kind == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**dict(small, num_key_value_heads=4), kv_lora_rank=32, q_lora_rank=32,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            first_k_dense_replace=1, n_group=1, topk_group=1)
        model = transformers.DeepseekV2ForCausalLM(cfg)
    elif kind == "mistral_window":
        cfg = transformers.MistralConfig(**small, sliding_window=16)
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.Gemma2Config(**small, sliding_window=16, head_dim=16)
        model = transformers.Gemma2ForCausalLM(cfg)
    model.eval()
    f = facts(cfg)
    for tokens in (12, 48):          # inside the window, and three windows past it
        measured = _measured_kv_per_token(model, tokens)
        formula = kv_bytes_per_token_formula(f, 4, tokens, latent=HFRuntime.latent_kv_cache)
        assert abs(measured - formula) / formula < 0.10, (kind, tokens, measured, formula)


@pytest.mark.slow
def test_an_interleaved_window_model_on_llama_cpp_matches_the_formula_at_its_report(tmp_path):
    """Gemma 3 270M's layout at small width (5 local layers of a 512-token window, 1 global, 1 KV head of 256)
    converted by llama.cpp's converter and loaded by the llama.cpp runtime: llama.cpp logs one cache per kind of
    layer, and its context keeps full-size caches on the local layers too (``swa_full``). The runtime's report
    (both caches, per cell) and the formula at the report's context, counting what the runtime keeps, agree within
    10 %; at the workload's 4,096 tokens the decision's memory counts what the runtime allocates."""
    import dataclasses
    import os
    import subprocess
    import sys

    from pipeline.config.schema import PROJECT_ROOT
    from dev import families as F
    from pipeline.figures.capacity import kv_reported_per_token
    from pipeline.runtimes.llamacpp import LlamaCppRuntime
    from tests.conftest import compose

    fam = next(f for f in F.FAMILIES if f.name == "gemma3")
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    fam = dataclasses.replace(fam, config=dict(fam.config, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                               num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                               sliding_window=512, layer_types=layer_types))
    model = tmp_path / "g3"
    F.build_family(fam, model)
    src = F.vocab_dir().parent
    gguf = tmp_path / "g3.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(src), str(PROJECT_ROOT)]),
               NO_LOCAL_GGUF="")
    conv = subprocess.run([sys.executable, "-m", "pipeline.quantizers.gguf_convert", str(src), "gemma4", "--",
                           str(model), "--outfile", str(gguf), "--outtype", "f16", "--model-name", "g3"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr[-2000:]
    from transformers import AutoConfig

    facts = {"layers": 6, "kv_heads": 1, "head_dim": 256, "attention_heads": 4,
             "kv_layout": kv_layout(AutoConfig.from_pretrained(str(model)))}
    assert facts["kv_layout"]["layer_kinds"] == {"full": 1, "window": 5, "none": 0}
    cfg = compose([f"paths.artifacts={tmp_path / 'a'}"])
    rt = LlamaCppRuntime(gguf, {"n_ctx": 4096}, cfg.runtime)
    try:
        rt.generate([2, 10, 11, 12], 2, [])             # a live sequence: the report needs one
        kv = rt.kv_cache_bytes()
        info = rt.info
    finally:
        rt.close()
    reported = kv_reported_per_token(kv)
    assert kv["allocated_cells"] == 4096 and info["swa_full"]
    windows = LlamaCppRuntime.keeps_window_only(info)
    at_report = kv_bytes_per_token_formula(facts, 2.0, 4096, windows=windows)
    assert abs(reported - at_report) / at_report <= 0.10, (reported, at_report)
    # the first cache alone (the global layer), what was read before, is a sixth of it
    assert reported == pytest.approx(6 * 2 * 256 * 2, rel=0.01)
    assert kv_bytes_per_token_formula(facts, 2.0, 4096) < 0.5 * reported      # windowed: not this runtime's
