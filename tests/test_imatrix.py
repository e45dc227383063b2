"""GGUF as published GGUF files are made: the importance-matrix stage and its cache, llama.cpp's refusals reported
as skips with its own reason, llama-quantize against the in-process quantizer, bits per weight, and the paired
importance-matrix effect."""

import json
from pathlib import Path

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.compose import load_variant
from pipeline.infra.errors import ConfigError, Skip

TEXT = ("Order {i} of {n} pallets ships from the Graz warehouse on day {d}; the invoice INV-{i:05d} lists a "
        "discount of {p} percent, and the customer asked us to confirm the delivery window by email before noon.")


@pytest.fixture(scope="module")
def tools():
    from pipeline.infra.llama_tools import tool

    try:
        return {n: tool(n) for n in ("llama-imatrix", "llama-quantize")}
    except ConfigError as exc:
        pytest.skip(f"llama.cpp's tools are not built on this machine ({exc}); `make test` builds them")


def _setup(model: Path, root: Path):
    from pipeline.stages.prepare import prepare
    from tests.conftest import compose

    cfg = compose([f"model.source={model}", "model.name=tiny", f"paths.artifacts={root / 'a'}",
                   f"paths.cache={PROJECT_ROOT / '.cache'}"])
    return cfg, prepare(cfg.model, cfg.model_dir)


def _write_calibration(path: Path, seed: int) -> None:
    rows = [{"text": " ".join(TEXT.format(i=i * seed + j, n=j % 9 + 1, d=j % 28 + 1, p=(i + j) % 15)
                              for j in range(6))} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_importance_matrix_is_computed_once_shared_and_rebuilt_when_the_calibration_text_changes(
        tools, tmp_path, tiny_llama):
    from pipeline.stages.quantize import build_artifact

    cfg, original = _setup(tiny_llama, tmp_path)
    calib = tmp_path / "calibration.jsonl"
    _write_calibration(calib, 1)

    def build(name):
        v = load_variant(name)
        v.quantize["calibration"] = {"path": str(calib)}
        v.quantize["imatrix_ctx"] = 64
        return build_artifact(v, original, cfg)

    first = build("gguf_q4_k_m_imat")
    im = first.info["imatrix"]
    assert im["chunks"] >= 2 and im["ctx"] == 64 and Path(im["path"]).is_file()
    assert first.info["producer"]["recipe"] == f"Q4_K_M, importance matrix over {im['chunks']}×64 tokens of " \
                                              "calibration.jsonl"
    manifest = Path(im["path"]).parent / "manifest.json"
    built = json.loads(manifest.read_text())["created_unix"]
    other = build("gguf_iq4_xs")                         # a second type reuses the same matrix
    assert other.info["imatrix"]["key_hash"] == im["key_hash"]
    assert json.loads(manifest.read_text())["created_unix"] == built
    again = build("gguf_q4_k_m_imat")                    # nothing changed: nothing rebuilt
    assert again.hash == first.hash and json.loads(manifest.read_text())["created_unix"] == built
    _write_calibration(calib, 7)                         # an edited calibration text
    changed = build("gguf_q4_k_m_imat")
    assert changed.info["imatrix"]["key_hash"] != im["key_hash"]
    assert changed.hash != first.hash


def test_a_type_llama_cpp_refuses_is_skipped_with_its_own_reason(tools, tmp_path, tiny_tokenizer_dir):
    """IQ2_XXS without an importance matrix: llama-quantize bails out (rows of 256 take the IQ2 type, no fallback)."""
    from pipeline.stages.quantize import build_artifact
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", tiny_tokenizer_dir, hidden=256, layers=1)
    cfg, original = _setup(model, tmp_path)
    v = load_variant("gguf_q3_k_m")
    v.quantize["type"] = "IQ2_XXS"
    with pytest.raises(Skip, match=r"llama-quantize refused IQ2_XXS for this model: .*importance matrix"):
        build_artifact(v, original, cfg)
    assert not list((cfg.model_dir / "variants").glob("gguf_q3_k_m/*.gguf")), "no half-written artifact is kept"


def test_llama_quantize_writes_the_same_file_as_the_in_process_quantizer(tools, tmp_path, tiny_llama):
    from pipeline.quantizers.gguf import convert_to_f16, llama_quantize, quantize_file

    cfg, original = _setup(tiny_llama, tmp_path)
    f16 = convert_to_f16(cfg, original.checkpoint, original.hash, "tiny")
    quantize_file(f16, tmp_path / "api.gguf", "Q4_K_M", 2)
    warnings = llama_quantize("", f16, tmp_path / "tool.gguf", "Q4_K_M", 2)
    assert (tmp_path / "api.gguf").read_bytes() == (tmp_path / "tool.gguf").read_bytes()
    assert warnings, "rows of 64 are not a multiple of 256: llama.cpp says it falls back"


def test_bits_per_weight_of_a_tiny_models_files(tmp_path, tiny_llama):
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.quantize import bits_per_weight
    from pipeline.infra.gguf_file import fallback_tensors, tensor_types

    cfg, original = _setup(tiny_llama, tmp_path)
    params = original.facts["params"]
    assert bits_per_weight(original.checkpoint, params) == pytest.approx(32.0)          # fp32 safetensors
    f16 = build_artifact(load_variant("gguf_f16"), original, cfg).path
    q8 = build_artifact(load_variant("gguf_q8_0"), original, cfg).path
    # F16: 16 bits, a little more for the float32 norms; Q8_0: 32 int8 + one f16 scale per block = 8.5 bits
    assert 16.0 < bits_per_weight(f16, params) < 16.1
    assert 8.5 <= bits_per_weight(q8, params) < 8.6
    assert bits_per_weight(tmp_path / "missing", params) is None
    k = build_artifact(load_variant("gguf_q4_k_m"), original, cfg).path
    fb = fallback_tensors("Q4_K_M", tensor_types(k))
    assert fb and sum(fb.values()) >= 2 * 4, "every 64-wide decoder matrix falls back to a 32-wide type"
    assert fallback_tensors("Q8_0", tensor_types(q8)) == {}


def _variant(kld_by_conv: dict, gguf_type: str, imatrix: bool) -> dict:
    return {"status": "ok", "artifact": {"gguf_type": gguf_type, "imatrix": {"chunks": 4} if imatrix else None,
                                         "bits_per_weight": 4.5},
            "drift_detail": {"kld_by_conversation": kld_by_conv}}


def test_the_importance_matrix_effect_is_paired_over_conversations():
    from pipeline.decide.variant_summary import imatrix_effects

    convs = [f"s/c{i}" for i in range(12)]
    plain = {c: [0.10 * (1 + i % 5) * 100, 100] for i, c in enumerate(convs)}       # conversations differ a lot
    better = {c: [s * 0.9, n] for c, (s, n) in plain.items()}                       # 10 % lower on every one
    mixed = {c: [s * (0.9 if i % 2 else 1.1), n] for i, (c, (s, n)) in enumerate(plain.items())}
    variants = {"q": _variant(plain, "Q4_K_M", False), "q_imat": _variant(better, "Q4_K_M", True),
                "q_imat+kv_q8_0": _variant(plain, "Q4_K_M", True),          # a KV-cache variant is not paired
                "r": _variant(plain, "Q3_K_M", False), "r_imat": _variant(mixed, "Q3_K_M", True),
                "lone": _variant(plain, "Q2_K", True)}
    effects = {e["type"]: e for e in imatrix_effects(variants)}
    assert set(effects) == {"Q4_K_M", "Q3_K_M"}
    q = effects["Q4_K_M"]
    assert (q["plain"], q["imatrix"]) == ("q", "q_imat")
    assert q["relative"] == pytest.approx(-0.10) and q["high"] < 0 and q["significant"]
    assert q["p_value"] < 0.01
    r = effects["Q3_K_M"]
    assert r["low"] < 0 < r["high"] and not r["significant"]
