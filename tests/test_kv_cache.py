"""KV-cache variants: byte formulas, the uint8 cache, the capacity plan, naming, and both runtimes end to end."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.figures.capacity import capacity_plan, kv_bytes_per_token_formula
from pipeline.infra.errors import ConfigError
from pipeline.compose import load_variant
from tests.conftest import compose

SMOL = {"layers": 30, "kv_heads": 3, "head_dim": 64, "params": 134_515_008}


@pytest.mark.parametrize("info, expected", [
    ({"runtime": "llamacpp", "cache_type_k": "f16", "cache_type_v": "f16"}, 2 * 30 * 3 * 64 * 2),        # 23,040
    ({"runtime": "llamacpp", "cache_type_k": "q8_0", "cache_type_v": "q8_0"}, 2 * 30 * 3 * 64 * 34 / 32),  # 12,240
    ({"runtime": "llamacpp", "cache_type_k": "q4_0", "cache_type_v": "q4_0"}, 2 * 30 * 3 * 64 * 18 / 32),  # 6,480
    ({"runtime": "hf", "dtype": "float32"}, 2 * 30 * 3 * 64 * 4),                                        # 46,080
    ({"runtime": "hf", "dtype": "bfloat16"}, 23_040),
    # int8: K 64 B + V 64 B + fp16 scale and zero point of V (4 B) per layer and KV head
    ({"runtime": "hf", "dtype": "float32", "kv_cache": {"bits": 8}}, 30 * 3 * (64 + 64 + 4)),             # 11,880
    ({"runtime": "hf", "dtype": "float32", "kv_cache": {"bits": 4}}, 30 * 3 * (32 + 32 + 4)),             # 6,120
])
def test_kv_bytes_per_token_formula(info, expected):
    from pipeline.runtimes import runtime_class

    element = runtime_class(info["runtime"]).cache_element_bytes(info, SMOL["head_dim"])
    assert kv_bytes_per_token_formula(SMOL, element) == pytest.approx(expected)


def test_uint8_cache_roundtrip_and_bytes():
    import torch

    from pipeline.runtimes.kv_quant import dequantize, quantize

    torch.manual_seed(0)
    x = torch.randn(1, 3, 50, 64) * 4
    for bits, reduce_dim in ((8, -2), (8, -1), (4, -2), (4, -1)):
        q = quantize(x, reduce_dim, bits)
        err = (dequantize(q) - x).abs()
        step = q.scale.float().expand_as(x)
        assert bool((err <= step / 2 + 1e-3).all()), (bits, reduce_dim)   # round to nearest, fp16 scale
        assert q.data.dtype == torch.uint8 and q.data.numel() == x.numel() * bits // 8
    keys, values = quantize(x, -2, 8), quantize(x, -1, 8)
    assert keys.scale.shape == (1, 3, 1, 64)          # per channel
    assert values.scale.shape == (1, 3, 50, 1)        # per token
    assert values.nbytes == 3 * 50 * 64 + 2 * 2 * 3 * 50


def test_capacity_plan_by_hand():
    v = {"memory": {"artifact_bytes": 1e9, "kv_bytes_per_token": 100_000.0, "peak_rss_mb": 2000.0},
         "speed": {"prompt_tokens": 0, "decode_tokens": 0}}
    cap = SimpleNamespace(memory_budget_gb=[16, 80], context_tokens=4096, headroom=0.2, params_b=7.0,
                          layers=32, kv_heads=8, head_dim=128)
    facts = {"layers": 10, "kv_heads": 5, "head_dim": 100, "params": 1e8}     # element bytes = 1e5 / 1e4 = 10
    plan = capacity_plan(v, facts, cap)
    overhead = 2000 * 2**20 - 1e9
    assert plan["overhead_bytes"] == pytest.approx(overhead)
    assert plan["max_sequences"]["16"] == int((16e9 * 0.8 - 1e9 - overhead) // (1e5 * 4096))      # 26
    assert plan["max_sequences"]["80"] == int((80e9 * 0.8 - 1e9 - overhead) // (1e5 * 4096))      # 151
    big = plan["scaled"]
    assert big["weights_bytes"] == pytest.approx(70e9)                          # 10 bytes per parameter
    assert big["kv_bytes_per_token"] == pytest.approx(2 * 32 * 8 * 128 * 10)
    assert big["max_sequences"]["16"] == 0                                       # weights alone exceed 16 GB
    assert plan["max_sequences"]["16"] == 26 and plan["max_sequences"]["80"] == 151


def test_kv_variants_are_named_and_configured():
    assert load_variant("original+kv_int8").runtime_options["kv_cache"]["bits"] == 8
    q8 = load_variant("gguf_q8_0+kv_q8_0")
    assert q8.base == "gguf_q8_0" and q8.runtime_options["cache_type_v"] == "q8_0" and q8.runtime_options["flash_attn"]
    assert load_variant("gguf_q4_k_m+kv_q8_0").quantize == load_variant("gguf_q4_k_m").quantize
    combo = compose(["variant=gguf_q5_k_m", "kv_cache=int8"]).variant
    assert combo.name == "gguf_q5_k_m+kv_q8_0" and combo.base == "gguf_q5_k_m"
    assert compose(["variant=gptq_w4", "kv_cache=int4"]).variant.name == "gptq_w4+kv_int4"
    with pytest.raises(ConfigError, match="KV-cache variant"):
        compose(["variant=original+kv_int8", "kv_cache=fp16"])


@pytest.mark.slow
def test_hf_int8_cache_scores_like_it_decodes(tiny_llama):
    """Teacher-forced scoring through the quantized cache, one token per chunk, reproduces greedy decoding (with
    the run's repetition penalty) with that cache exactly; 8-bit drifts less than 4-bit; the cache holds real
    uint8 bytes."""
    from pipeline.config.schema import RuntimeConfig
    from pipeline.figures.drift import kld_full
    from pipeline.runtimes.hf import HFRuntime

    rc = RuntimeConfig()
    prompt = list(range(1000, 1100))
    fp = HFRuntime(tiny_llama, {}, rc)
    klds = {}
    for bits in (8, 4):
        rt = HFRuntime(tiny_llama, {"kv_cache": {"bits": bits, "residual_length": 4, "score_chunk": 1}}, rc)
        gen = rt.generate(prompt, 40, [])
        kv = rt.kv_cache_bytes()
        assert kv["tokens"] >= 100 and kv["bytes"] / kv["tokens"] < 0.6 * (2 * 2 * 2 * 16 * 4)   # vs fp32
        stream = prompt + gen.ids
        positions = list(range(99, 99 + len(gen.ids)))
        logits = rt.logits(stream, positions)
        assert [rt.choice.pick(logits[k], prompt, gen.ids[:k]) for k in range(len(gen.ids))] == gen.ids
        lp = rt.logprobs(stream, positions)
        klds[bits] = kld_full(fp.logprobs(stream, positions), lp).mean()
    assert 0 < klds[8] < klds[4]


@pytest.mark.slow
def test_an_impossible_cache_is_skipped_with_the_reason(tiny_cfg):
    """The default tiny model has head dim 16; llama.cpp's q8_0 cache needs blocks of 32 along it."""
    from pipeline.cli import run
    from pipeline.stages.variant_setup import load_result

    cfg = tiny_cfg("variant=gguf_q8_0", "kv_cache=int8")
    assert run(cfg) == 0
    result = load_result(cfg, "gguf_q8_0+kv_q8_0")
    assert result["status"] == "skipped" and "does not divide n_embd_head_k=16" in result["reason"]


@pytest.mark.slow
def test_kv_variants_end_to_end_on_both_runtimes(tmp_path, tiny_tokenizer_dir):
    """original+kv_int8 on hf and gguf_q8_0+kv_q8_0 on llama.cpp through the pipeline, then the report."""
    from pipeline.cli import run
    from pipeline.config.schema import PROJECT_ROOT
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tmp_path / "hd32", tiny_tokenizer_dir, heads=2)      # head dim 32: q8_0 blocks fit

    def cfg_for(*extra):
        return compose([f"model.source={model}", "model.name=tiny32", "profile=smoke", "run.suites=[smoke]",
                        f"paths.artifacts={tmp_path / 'artifacts'}", f"paths.results={tmp_path / 'results'}",
                        f"paths.cache={PROJECT_ROOT / '.cache'}", *extra])

    variants = ["original", "original+kv_int8", "gguf_q8_0", "gguf_q8_0+kv_q8_0"]
    cfg = cfg_for("command=compare", f"run.variants=[{','.join(variants)}]", "capacity.params_b=7", "load=off")
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    vs = summary["variants"]
    assert all(vs[n]["status"] == "ok" for n in variants), {n: vs[n].get("reason") for n in variants}
    assert vs["original+kv_int8"]["memory"]["kv_cache"] == "int8"
    assert vs["gguf_q8_0+kv_q8_0"]["memory"]["kv_cache"] == "q8_0"
    assert vs["gguf_q8_0+kv_q8_0"]["runtime_info"]["flash_attn"] and vs["gguf_q8_0"]["runtime_info"]["flash_attn"]
    for n in variants:
        m = vs[n]["memory"]
        assert m["kv_bytes_per_token_reported"] and not m["kv_gap_flagged"], (n, m)
        assert vs[n]["capacity"]["max_sequences"]["80"] > 0 and "scaled" in vs[n]["capacity"]
    assert vs["original+kv_int8"]["memory"]["kv_bytes_per_token"] < 0.3 * vs["original"]["memory"]["kv_bytes_per_token"]
    assert vs["gguf_q8_0+kv_q8_0"]["memory"]["kv_bytes_per_token"] < 0.6 * vs["gguf_q8_0"]["memory"]["kv_bytes_per_token"]
    # the cache is the only difference: same weights artifact, and drift against the original is measured
    assert vs["gguf_q8_0+kv_q8_0"]["artifact"]["path"] == vs["gguf_q8_0"]["artifact"]["path"]
    assert vs["original+kv_int8"]["drift"]["kld_mean"] > 0
    report = (cfg.results_dir / "report.md").read_text()
    assert "KV cache and capacity" in report and "7B-parameter" in report
    assert np.isfinite(vs["original+kv_int8"]["speed"]["decode_tokens_per_s"])


@pytest.mark.slow
def test_long_context_suite_through_the_pipeline(tiny_cfg):
    """The generated recall suite runs like any suite; the summary has recall and KLD by depth and length, and
    the report has the recall-vs-depth plot."""
    from pipeline.cli import run

    gen = "suites.long_context.generate={kind: recall, lengths: [256, 512], depths: [0.1, 0.5, 0.9], seed: 0, answer_tokens: 8}"
    common = ["run.suites=[long_context]", gen, "profile.max_conversations=6"]
    for v in ("original", "original+kv_int8"):
        assert run(tiny_cfg(f"variant={v}", *common)) == 0
    cfg = tiny_cfg("command=report", "run.variants=[original,original+kv_int8]", *common)
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    recall = summary["variants"]["original+kv_int8"]["recall"]
    assert recall["documents"] == 6
    assert set(recall["by_depth"]) == {"0.1", "0.5", "0.9"} and set(recall["by_length"]) == {"256", "512"}
    assert all(g["checks"] == 2 and g["kld_mean"] is not None and g["answer_tokens"] > 0
               for g in recall["by_depth"].values())
    assert summary["variants"]["original"]["recall"]["by_depth"]["0.5"]["flips"] == 0
    assert (cfg.results_dir / "recall_by_depth.png").stat().st_size > 10_000
    assert "Long-context recall" in (cfg.results_dir / "report.md").read_text()
