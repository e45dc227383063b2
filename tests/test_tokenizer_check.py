"""The tokenizer transformers loads for a folder is checked against the folder's own tokenizer.json on the suites'
texts: transformers 5.24 picks its class from the config's model_type (Qwen2Tokenizer for a qwen2 config) and
that class can split text otherwise than the file a server reads. Reported in the model section."""

import json
import shutil

from pipeline.report.sections import _model_section
from pipeline.stages.parity import folder_tokenizer_divergence
from pipeline.suites.conversation import ChatRenderer

TEXTS = {"multi_turn": ["Totals for March:\n\n  ok, 1,240 units", "Hello world"]}


def test_a_class_that_splits_otherwise_than_tokenizer_json_is_reported(tmp_path, tiny_tokenizer_dir):
    same = folder_tokenizer_divergence(tiny_tokenizer_dir, ChatRenderer(tiny_tokenizer_dir), TEXTS)
    assert same["diverging_texts"] == 0 and same["texts"] == 2
    folder = shutil.copytree(tiny_tokenizer_dir, tmp_path / "qwen-like")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    out = folder_tokenizer_divergence(folder, ChatRenderer(folder), TEXTS)
    assert out["loaded"] == "Qwen2Tokenizer" and out["diverging_texts"] == 1
    summary = {"model": {"source": "x"}, "reference": {"runtime": "hf", "top_k": 32,
                                                         "parity": {"skipped": "n/a", "folder_tokenizer": out}}}
    items = _model_section(summary)[2][0]
    assert any("transformers loaded `Qwen2Tokenizer`" in i and "1 of 2 suite texts" in i for i in items)
    (folder / "tokenizer.json").unlink()
    assert "no tokenizer.json" in folder_tokenizer_divergence(folder, ChatRenderer(folder), TEXTS)["skipped"]
