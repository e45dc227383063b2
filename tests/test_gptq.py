"""GPTQ and AWQ through GPTQModel on a tiny random llama: quantize, load back two ways, score the same ids."""

import json

import numpy as np
import pytest

from pipeline.figures import drift as metrics
from pipeline.compose import load_variant
from pipeline.quantizers.base import Skip
from pipeline.quantizers.calibration import calibration_key
from pipeline.quantizers.gptq import cast_unquantized, choose_group_size

TEXT = ("Purchase order PO-88412 for 240 ergonomic chairs at USD 189.00 each was approved by Marta Okafor on "
        "12 May; delivery to the Leeds warehouse is due within 21 days of approval. ") * 3


def test_group_size_is_the_largest_dividing_every_input_size():
    assert choose_group_size([576, 1536]) == 64          # SmolLM2: 128 does not divide 576
    assert choose_group_size([4096, 11008]) == 128
    assert choose_group_size([96, 160]) == 32
    with pytest.raises(Skip, match="no group size"):
        choose_group_size([100, 200])


def _calibration_file(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_calibration_key_follows_the_texts_used_not_the_files_place(tmp_path):
    from pipeline.config.schema import PROJECT_ROOT

    calib = tmp_path / "calibration.jsonl"
    texts = [f"Invoice INV-{i:04d} for EUR {i * 13}.50 is due on day {i % 28 + 1}." for i in range(10)]
    _calibration_file(calib, texts)
    spec = {"path": str(calib), "field": "text", "samples": 4, "seq_len": 64}
    first = calibration_key(spec)
    _calibration_file(calib, texts + ["Appended later: a text beyond the four used."])
    assert calibration_key(spec) == first                                   # nothing used changed
    whole = calibration_key({k: v for k, v in spec.items() if k != "samples"})
    _calibration_file(calib, texts + ["Appended later: now read, since the whole file is used."] * 2)
    assert calibration_key({k: v for k, v in spec.items() if k != "samples"}) != whole
    _calibration_file(calib, texts[:2] + ["An edited third text."] + texts[3:])
    assert calibration_key(spec) != first                                   # a used text changed
    shipped = calibration_key({"path": str(PROJECT_ROOT / "prompts" / "calibration.jsonl"), "samples": 8})
    assert shipped["path"] == "prompts/calibration.jsonl"                   # clones at other paths share keys


def test_unquantized_tensors_are_cast_and_the_quantization_data_kept(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.randn(32, 8), "model.norm.weight": torch.ones(8),
               "model.layers.0.mlp.up_proj.qweight": torch.randint(0, 2**31 - 1, (1, 16), dtype=torch.int32),
               "model.layers.0.mlp.up_proj.scales": torch.rand(1, 16, dtype=torch.float32),
               "model.layers.0.mlp.up_proj.g_idx": torch.zeros(8, dtype=torch.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32", "quantization_config": {"bits": 4}}))
    assert cast_unquantized(tmp_path, "float16") == 2
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        out = {k: fh.get_tensor(k) for k in fh.keys()}
        assert fh.metadata() == {"format": "pt"}
    assert out["model.embed_tokens.weight"].dtype == torch.float16 and out["model.norm.weight"].dtype == torch.float16
    assert torch.equal(out["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"].half())
    for k in ("qweight", "scales", "g_idx"):                                 # quantization data as the tool wrote it
        name = f"model.layers.0.mlp.up_proj.{k}"
        assert out[name].dtype == tensors[name].dtype and torch.equal(out[name], tensors[name])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float16" and "torch_dtype" not in config and config["quantization_config"]
    assert not list(tmp_path.glob("*.tmp"))


def test_shipped_gptq_and_awq_variants_compose():
    for name, method, bits in (("gptq_w4", "gptq", 4), ("gptq_w8", "gptq", 8), ("awq_w4", "awq", 4)):
        v = load_variant(name)
        assert v.quantizer == "gptqmodel" and v.runtime == "hf"
        assert v.quantize["method"] == method and v.quantize["bits"] == bits and v.quantize["group_size"] == "auto"
        assert v.quantize["calibration"]["path"].endswith("prompts/calibration.jsonl")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_tokenizer_dir):
    pytest.importorskip("gptqmodel")
    from pipeline.config.schema import PROJECT_ROOT
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from tests.conftest import build_tiny_llama, compose

    root = tmp_path_factory.mktemp("gptq")
    model = build_tiny_llama(root / "model", tiny_tokenizer_dir, hidden=128)   # AWQ needs outputs % 64 == 0
    cfg = compose([f"model.source={model}", "model.name=tiny", f"paths.artifacts={root / 'a'}",
                   f"paths.cache={PROJECT_ROOT / '.cache'}"])
    original = prepare(cfg.model, cfg.model_dir)
    arts = {}
    for name in ("gptq_w4", "gptq_w8", "awq_w4"):
        v = load_variant(name)
        v.quantize["calibration"]["samples"] = 16
        v.quantize["calibration"]["seq_len"] = 64
        arts[name] = build_artifact(v, original, cfg)
    return cfg, original, arts


@pytest.fixture(scope="module")
def reference(quantized):
    """The unquantized tiny model's log-probs on TEXT: (input ids tensor, float log-probs array)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, original, _ = quantized
    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"][:96]])
    ref = AutoModelForCausalLM.from_pretrained(str(original.checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, torch.log_softmax(ref(ids).logits[0].float(), -1).numpy()


@pytest.mark.slow
def test_gptq_and_awq_folders_load_with_plain_transformers_and_gptqmodel(quantized, reference):
    import torch
    from gptqmodel import GPTQModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg, original, arts = quantized
    ids, lp_ref = reference
    kld = {}
    for name, art in arts.items():
        qc = json.loads((art.path / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == ("awq" if name.startswith("awq") else "gptq") and qc["group_size"] == 128
        assert art.info["group_size"] == 128 and art.info["quantize_wall_s"] > 0 and art.info["quantize_peak_rss_mb"] > 0
        p = art.info["producer"]     # the report names who made it and how
        assert p["tool"] == "GPTQModel" and p["version"] == "7.6.0"
        assert p["recipe"].startswith(f"{'AWQ' if name.startswith('awq') else 'GPTQ'} W{8 if name == 'gptq_w8' else 4}, "
                                      "g128, ") and "16×≤64 tokens of calibration.jsonl" in p["recipe"]
        # GPTQ quantizes in fp32 on a CPU but ships its embeddings and norms in fp16; AWQ keeps its bf16
        embed = "float16" if name.startswith("gptq") else "bfloat16"
        with safe_open(str(art.path / "model.safetensors"), framework="pt") as fh:
            assert str(fh.get_tensor("model.embed_tokens.weight").dtype) == f"torch.{embed}", name
        assert ("float16 unquantized tensors" in p["recipe"]) == name.startswith("gptq"), p["recipe"]
        hf = AutoModelForCausalLM.from_pretrained(str(art.path), dtype=torch.float32, device_map="cpu").eval()
        assert any(hasattr(m, "qweight") for m in hf.modules()), "transformers must load the real quantized layers"
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1).numpy()
        assert np.isfinite(lp).all()
        kld[name] = float(metrics.kld_full(lp_ref, lp).mean())
        gm = GPTQModel.load(str(art.path), device="cpu")
        with torch.no_grad():
            assert torch.isfinite(gm.model(ids).logits).all()
    assert 0 < kld["gptq_w8"] < kld["gptq_w4"] < 1.0, kld
    assert 0 < kld["awq_w4"] < 1.0, kld


@pytest.mark.slow
def test_dequantized_weights_reproduce_the_kernel(quantized, reference):
    """The check that licenses the dequantized stand-in for free-running: on a sample, kernel and dequantized
    paths give mean KLD within 5 % and the same greedy token at most positions."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.quantizers.dequant import dense_state_dict

    cfg, original, arts = quantized
    ids, lp_ref = reference
    for name, art in arts.items():
        kernel = AutoModelForCausalLM.from_pretrained(str(art.path), dtype=torch.float32, device_map="cpu").eval()
        dense = AutoModelForCausalLM.from_pretrained(str(original.checkpoint), dtype=torch.float32).eval()
        state, _ = dense_state_dict(art.path)
        missing, unexpected = dense.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        dense.tie_weights()
        with torch.no_grad():
            lk = torch.log_softmax(kernel(ids).logits[0].float(), -1).numpy()
            ld = torch.log_softmax(dense(ids).logits[0].float(), -1).numpy()
        kld_k, kld_d = metrics.kld_full(lp_ref, lk).mean(), metrics.kld_full(lp_ref, ld).mean()
        assert abs(kld_d - kld_k) / kld_k < 0.05, (name, kld_k, kld_d)
        assert (lk.argmax(-1) == ld.argmax(-1)).mean() >= 0.9, name


def test_quantization_computes_in_the_checkpoints_half_type_on_cuda_and_float32_on_a_cpu(tmp_path):
    """GPTQ on a GPU in the model's own bf16/fp16 (a GPU computes half types at full rate and holds twice the
    model), on a CPU in float32, its fastest type; a dtype the variant names wins everywhere."""
    from types import SimpleNamespace

    from pipeline.quantizers.gptq import GPTQModelQuantizer

    def settings(ckpt, device, **quantize):
        v = load_variant("gptq_w4")
        v.quantize.update(group_size=64, **quantize)
        cfg = SimpleNamespace(runtime=SimpleNamespace(device=device))
        return GPTQModelQuantizer(v, SimpleNamespace(checkpoint=ckpt), cfg).settings()

    for declared, on_cuda in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"),
                              (None, "bfloat16")):
        ckpt = tmp_path / str(declared)
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps({"dtype": declared} if declared else {}))
        for device, expected in (("cuda", on_cuda), ("cuda:1", on_cuda), ("cpu", "float32"), ("auto", "float32")):
            s = settings(ckpt, device)
            assert s["dtype"] == expected, (declared, device)
            # the unquantized tensors ship in the compute dtype where it is a half type, else in float16
            assert s.get("save_dtype") == ("float16" if expected == "float32" else None)
        assert settings(ckpt, "cuda", dtype="float32")["dtype"] == "float32"
        assert settings(ckpt, "cpu", dtype="float16")["dtype"] == "float16"
    from pipeline.infra.errors import ConfigError
    from pipeline.quantizers.gptq import GPTQModelSettings

    assert GPTQModelSettings(dtype="auto").dtype == "auto"
    with pytest.raises(ConfigError, match="variant.quantize.dtype"):
        GPTQModelSettings(dtype="int8")
