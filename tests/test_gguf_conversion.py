"""A GGUF conversion failure is named with the converter's own cause and the override that gets past it, and
costs the GGUF variants only: an unrecognised BPE pre-tokenizer (the commonest failure for a fine-tuned model,
fixed by model.gguf_pre_tokenizer) and a Phi-3 folder without the SentencePiece tokenizer.model its converter
path needs."""

import json
import shutil

import pytest

from pipeline.cli import run
from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError, Skip
from pipeline.quantizers.gguf_convert import conversion_failure
from tests.conftest import compose


def _cfg(model, root, *extra):
    return compose([f"model.source={model}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
                    f"paths.artifacts={root / 'artifacts'}", f"paths.results={root / 'results'}",
                    f"paths.cache={PROJECT_ROOT / '.cache'}", *extra])


@pytest.fixture
def retokenized(tmp_path, tiny_llama):
    """The tiny model with a re-saved tokenizer.json whose pre-tokenizer no release of llama.cpp has hashed."""
    model = shutil.copytree(tiny_llama, tmp_path / "finetuned")
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    return model


def test_an_unrecognised_pre_tokenizer_is_named_and_the_override_converts(tmp_path, retokenized):
    from pipeline.infra.gguf_file import gguf_metadata
    from pipeline.quantizers.gguf import convert_checkpoint

    cfg = _cfg(retokenized, tmp_path)
    with pytest.raises(Skip, match="does not recognise this tokenizer's BPE pre-tokenizer.*model.gguf_pre_tokenizer"):
        convert_checkpoint(cfg, retokenized, "h", "tiny", tmp_path / "f16")
    cfg = _cfg(retokenized, tmp_path, "model.gguf_pre_tokenizer=smollm")
    path = convert_checkpoint(cfg, retokenized, "h", "tiny", tmp_path / "f16")
    assert gguf_metadata(path, "tokenizer.ggml.pre") == "smollm"
    # the converter's phases, timed by the wrapper's marks: the plan carries each by what it grows with
    manifest = json.loads((tmp_path / "f16" / "manifest.json").read_text())
    phases = manifest["phases_s"]
    assert set(phases) == {"start", "vocabulary", "tensors", "exit"} and all(v >= 0 for v in phases.values())
    assert phases["start"] > 0 and sum(phases.values()) <= manifest["wall_s"] + 0.01    # each phase inside the wall
    with pytest.raises(ConfigError, match="model.gguf_pre_tokenizer='smolm' is not a pre-tokenizer.*llama-bpe"):
        convert_checkpoint(_cfg(retokenized, tmp_path, "model.gguf_pre_tokenizer=smolm"), retokenized, "h",
                           "tiny", tmp_path / "f16b")


def test_a_phi3_folder_without_tokenizer_model_skips_the_gguf_variants_only(tmp_path, tiny_tokenizer_dir):
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    from pipeline.stages.variant_setup import load_result

    torch.manual_seed(0)
    model = tmp_path / "phi3"
    Phi3ForCausalLM(Phi3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)).save_pretrained(str(model))
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    assert run(_cfg(model, tmp_path, "variant=gguf_q4_0")) == 0
    result = load_result(_cfg(model, tmp_path, "variant=gguf_q4_0"), "gguf_q4_0")
    assert result["status"] == "skipped"
    assert "needs a SentencePiece tokenizer.model" in result["reason"] and "Missing" in result["reason"]
    assert run(_cfg(model, tmp_path, "variant=original")) == 0
    assert load_result(_cfg(model, tmp_path, "variant=original"), "original")["status"] == "ok"


def test_failure_texts_are_read_into_causes():
    assert "does not support this architecture: NotImplementedError: Architecture 'X' not supported!" in \
        conversion_failure("...\nNotImplementedError: Architecture 'X' not supported!\n", 1)
    assert conversion_failure("Traceback ...\nKeyError: 'rope_theta'\n", 1) == \
        "llama.cpp's converter failed (exit 1): KeyError: 'rope_theta'"


def test_a_quantizer_killed_by_a_signal_is_a_failure_or_an_interruption_never_a_refusal(tmp_path, monkeypatch):
    """llama-quantize or the converter dying of a signal says nothing about the model: a crash (SIGSEGV) fails the
    run loudly, a stop from outside (SIGTERM, SIGKILL) interrupts it; neither reports the format as refused."""
    import subprocess

    import pipeline.infra.llama_tools as llama_tools
    import pipeline.quantizers.gguf as gguf

    exe = tmp_path / "llama-quantize"
    exe.write_text("")
    monkeypatch.setattr(llama_tools, "tool", lambda name, tools: exe)
    from pipeline.infra.errors import Interrupted

    crashed = subprocess.CompletedProcess([str(exe)], -11, stdout="", stderr="llama_model_quantize: loading\n")
    monkeypatch.setattr(gguf.subprocess, "run", lambda *a, **k: crashed)
    with pytest.raises(RuntimeError, match="killed by signal 11"):
        gguf.llama_quantize("tools", tmp_path / "in.gguf", tmp_path / "out.gguf", "Q4_K_M", 2)
    # stopped from outside (a cancelled job's SIGTERM, the out-of-memory killer's SIGKILL): an interruption
    for sig in (9, 15):
        stopped = subprocess.CompletedProcess([str(exe)], -sig, stdout="", stderr="")
        monkeypatch.setattr(gguf.subprocess, "run", lambda *a, **k: stopped)
        with pytest.raises(Interrupted, match=f"stopped by signal {sig}"):
            gguf.llama_quantize("tools", tmp_path / "in.gguf", tmp_path / "out.gguf", "Q4_K_M", 2)
    refused = subprocess.CompletedProcess([str(exe)], 1, stdout="", stderr="error: unsupported tensor shape\n")
    monkeypatch.setattr(gguf.subprocess, "run", lambda *a, **k: refused)
    with pytest.raises(Skip, match="llama-quantize refused Q4_K_M"):
        gguf.llama_quantize("tools", tmp_path / "in.gguf", tmp_path / "out.gguf", "Q4_K_M", 2)


def test_a_gguf_llama_cpp_cannot_read_fails_in_a_child_not_in_the_job(tmp_path, embedded_gguf):
    """The vocabulary is loaded in a child process first (llama.cpp aborts the process on some converted files):
    a file it cannot read raises in the job, naming the file and the child's end, and the job lives on."""
    from pipeline.runtimes.llamacpp import vocab_loads_in_child

    vocab_loads_in_child(embedded_gguf)            # a good file loads
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(embedded_gguf.read_bytes()[:4096])
    with pytest.raises(RuntimeError, match=r"could not load the vocabulary of broken.gguf \((exit|killed by)"):
        vocab_loads_in_child(bad)
