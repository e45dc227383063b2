"""The prompt rate of each ggml type, measured through llama.cpp's own loader and benchmark: the synthetic model
each type is timed on, the measurement kept and reused, and the plan carrying a GGUF file's prompt work by its
types."""

from __future__ import annotations

import json

import pytest


def _tools():
    """The folder of llama.cpp's tools (`make llama-tools`, a prerequisite of `make test`), or None."""
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.llama_tools import tool

    try:
        return tool("llama-bench").parent
    except ConfigError:
        return None


@pytest.mark.integration
def test_the_synthetic_model_holds_every_matrix_in_the_type_timed(tmp_path):
    """Two Llama blocks whose seven matrices are all the type timed (one that needs an importance matrix too),
    norms in F32, the embedding Q8_0 over the test vocabulary's tokens: a file llama.cpp's loader reads."""
    from pipeline.infra.make_paths import vocab_dir
    from pipeline.infra.gguf_file import read_header
    from pipeline.plan import prompt_rates
    from pipeline.plan.quant_rates import ggml_library

    tools = _tools()
    lib = ggml_library(str(tools) if tools else "")
    vocab = vocab_dir() / "ggml-vocab-llama-spm.gguf"
    for type_name in ("Q4_K", "IQ2_XXS"):
        path = tmp_path / f"{type_name}.gguf"
        prompt_rates.write_model(path, type_name, vocab, lib)
        header = read_header(path)
        matrices = [t for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        assert len(matrices) == 14 and {t.type for t in matrices} == {type_name}
        assert sum(t.n_elements for t in matrices) == prompt_rates.MATRIX_WEIGHTS
        embd = next(t for t in header.tensors if t.name == "token_embd.weight")
        assert embd.type == "Q8_0" and embd.shape == (2048, 32000)
        assert {t.type for t in header.tensors if len(t.shape) == 1} == {"F32"}
        assert header.fields["tokenizer.ggml.model"] == "llama"


@pytest.mark.integration
def test_prompt_rates_are_measured_with_llama_bench_and_kept(tmp_path, monkeypatch):
    """Each type's seconds per prompt token per matrix weight from llama-bench on its synthetic model (F32 norm
    vectors left out), kept on disk; asked again, the kept figures serve; a type not kept has the whole set
    measured again, together; without the tools or with an unknown type there is no figure."""
    from pipeline.plan import prompt_rates

    tools = _tools()
    if tools is None:
        pytest.skip("llama.cpp's tools are not built here (`make llama-tools`)")
    monkeypatch.setattr(prompt_rates, "_record", lambda tools, threads: tmp_path / f"rates-t{threads}.json")
    prompt_rates.seconds_per_weight.cache_clear()
    rates = prompt_rates.seconds_per_weight(("Q8_0", "F32", "Q4_0"), 1, str(tools))
    assert set(rates) == {"Q4_0", "Q8_0"} and all(1e-13 < r < 1e-8 for r in rates.values())
    assert json.loads((tmp_path / "rates-t1.json").read_text())["rates"] == rates

    prompt_rates.seconds_per_weight.cache_clear()
    monkeypatch.setattr(prompt_rates, "measure", lambda *a: pytest.fail("measured again"))
    assert prompt_rates.seconds_per_weight(("Q4_0", "Q8_0"), 1, str(tools)) == rates

    asked = []
    monkeypatch.setattr(prompt_rates, "measure", lambda types, *a: asked.append(types) or {t: 1e-12 for t in types})
    assert prompt_rates.seconds_per_weight(("Q6_K", "Q4_0"), 1, str(tools)) == {"Q4_0": 1e-12, "Q6_K": 1e-12}
    assert asked == [("Q4_0", "Q6_K")]
    assert json.loads((tmp_path / "rates-t1.json").read_text())["rates"]["Q8_0"] == rates["Q8_0"]
    assert prompt_rates.seconds_per_weight(("Q8_0",), 1, "") is None
    assert prompt_rates.seconds_per_weight(("NOT_A_TYPE",), 1, str(tools)) is None
    prompt_rates.seconds_per_weight.cache_clear()
