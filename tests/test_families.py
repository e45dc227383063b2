"""The family matrix: each family's builder makes the architecture it claims, with its committed chat template
(llama.cpp's published one, unchanged), and a tokenizer that reproduces llama.cpp's reference tokenizations of its
vocab file; the slow test runs every family through the pipeline with a reduced variant set and requires each
variant to end as the committed table of outcomes says (ok, or skipped with its reason)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dev.families import (FAMILIES, HIDDEN, build_config,
                                     reference_cases, template_text, vocab_dir)

CHAT = [{"role": "system", "content": "You answer billing questions for Fernhill Payments."},
        {"role": "user", "content": "Summarise invoice INV-2231."},
        {"role": "assistant", "content": "Invoice INV-2231 totals GBP 1,240."},
        {"role": "user", "content": "And the due date?"}]
IDS = [f.name for f in FAMILIES]


@pytest.mark.parametrize("name,base,params", [("llama3-1b", "llama3", 1_235_814_400),
                                               ("qwen2-1.5b", "qwen2", 1_543_714_304)])
def test_the_scaled_models_have_their_published_shapes(name, base, params):
    """The models that test the plan's scaling have Llama-3.2-1B's and Qwen2.5-1.5B's parameter counts, counted on
    the meta device, and their family's tokenizer and template."""
    import torch
    import transformers

    from dev.families import family

    fam = family(name)
    with torch.device("meta"):
        model = getattr(transformers, fam.model_class)(build_config(fam))
    assert sum(p.numel() for p in model.parameters()) == params
    assert (fam.vocab, fam.template) == (family(base).vocab, family(base).template)
    assert fam not in FAMILIES        # never in the CI matrix


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_the_builder_makes_the_architecture_it_claims(fam):
    cfg = build_config(fam)
    for key, value in fam.claims.items():
        assert getattr(cfg, key) == value, (fam.name, key)
    # K-quants keep their own types only on rows that are a multiple of 256
    assert cfg.hidden_size == HIDDEN and HIDDEN % 256 == 0
    assert cfg.num_hidden_layers <= 4
    if getattr(cfg, "sliding_window", None):
        assert cfg.sliding_window <= 128      # the prompts are longer than the window
    assert type(cfg).__name__ == fam.config_class and fam.model_class.endswith("ForCausalLM")


def test_the_features_the_brief_names_are_present():
    by = {f.name: build_config(f) for f in FAMILIES}
    assert by["mistral"].sliding_window == 64
    assert by["gemma2"].attn_logit_softcapping and by["gemma2"].final_logit_softcapping
    assert set(by["gemma2"].layer_types) == {"sliding_attention", "full_attention"}
    assert by["qwen2moe"].num_experts > by["qwen2moe"].num_experts_per_tok > 1
    assert by["deepseek2"].kv_lora_rank < by["deepseek2"].num_attention_heads * by["deepseek2"].v_head_dim
    assert by["llama3"].rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("fam", FAMILIES, ids=IDS)
def test_the_published_template_renders_a_business_conversation(fam):
    from jinja2.exceptions import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    from pipeline.suites.conversation import fold_system

    if not (vocab_dir() / "templates" / fam.template).is_file():
        pytest.skip(f"llama.cpp's {fam.template} is absent: run `make chat-templates` (make test does)")
    text = template_text(fam)
    kwargs = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True, "chat_template": text}
    try:
        rendered = render_jinja_template([CHAT], **kwargs)[0][0]
    except TemplateError:       # a template without a system role: the pipeline folds it into the first user turn
        assert fam.name == "gemma2"
        rendered = render_jinja_template([fold_system(CHAT)], **kwargs)[0][0]
    for part in ("Fernhill Payments", "INV-2231", "GBP 1,240", "due date"):
        assert part in rendered, (fam.name, part)
    assert rendered.index("Summarise") < rendered.index("due date")


def test_reference_cases_split_as_llama_cpp_splits_them(tmp_path):
    vocab = tmp_path / "ggml-vocab-x.gguf"
    (tmp_path / "ggml-vocab-x.gguf.inp").write_text("a\n__ggml_vocab_test__\n\n__ggml_vocab_test__\n b c\n"
                                                    "__ggml_vocab_test__\n")
    (tmp_path / "ggml-vocab-x.gguf.out").write_text(" 1\n\n 2 3\n")
    assert reference_cases(vocab) == [("a", [1]), ("", []), (" b c", [2, 3])]


# ---- slow: build every family and run the pipeline on it ------------------------------------------------------

CI_VARIANTS = ["original", "gguf_f16", "gguf_q4_k_m", "gptq_w4", "gguf_q8_0+kv_q8_0"]
EXPECTED_OUTCOMES = json.loads((Path(__file__).parent / "data" / "family_outcomes.json").read_text())
# `make test` runs these two, which between them reach every committed outcome but one (ok for each variant; the F16
# GGUF's parity refusal; GPTQ refusing a weight's shape): llama.cpp unable to load the F16 GGUF (DeepSeek V2) is
# tests/test_hardening.py's in CI; `make test-all` runs all nine
CI_FAMILIES = ("phi3", "mistral")
MATRIX = [pytest.param(f, id=f.name, marks=() if f.name in CI_FAMILIES else pytest.mark.full) for f in FAMILIES]

@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.slow
@pytest.mark.system
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fam", MATRIX)
def test_every_variant_of_every_family_ends_as_the_committed_outcome_table_says(fam, family_root):
    from pipeline.cli import run
    from pipeline.config.schema import PROJECT_ROOT
    from dev.families import build_family
    from tests.conftest import compose

    if not reference_cases_present(fam):
        pytest.skip(f"llama.cpp's reference tokenizations of ggml-vocab-{fam.vocab}.gguf are absent: run "
                    "`make chat-templates` (make test does)")
    facts = build_family(fam, family_root / fam.name)
    tok = facts["tokenizer"]
    assert tok["agree"] == tok["cases"] and tok["cases"] > 10, tok
    if fam.spm_ids:
        spm = facts["tokenizer_model"]
        assert spm["agree"] == spm["cases"], spm
    suites = "[long_output]" if facts["multi_turn_refusal"] else "[smoke]"

    def cfg(*extra):
        return compose([f"model.source={family_root / fam.name}", f"model.name={fam.name}", "profile=smoke",
                        f"run.suites={suites}", f"paths.artifacts={family_root / 'artifacts'}",
                        f"paths.results={family_root / 'results'}", f"paths.cache={PROJECT_ROOT / '.cache'}",
                        "profile.max_conversations=1", *fam.overrides, *extra])

    from pipeline.infra.errors import ConfigError

    refused = {}
    for v in CI_VARIANTS:
        try:
            run(cfg(f"variant={v}"))      # a failed variant is judged below, from the summary
        except ConfigError as exc:        # the job refused with a named cause (as the CLI exits 2 with it)
            refused[v] = str(exc)
    report = cfg("command=report", f"run.variants=[{','.join(CI_VARIANTS)}]")
    run(report)                           # exit 3 when a variant failed: judged per variant below
    summary = json.loads((report.results_dir / "summary.json").read_text())
    # each variant's outcome, `original`'s included, is the committed one (tests/data/family_outcomes.json): a new
    # skip, a skip for another reason, a refused job, or a skip that went away fails here and the table (and
    # docs/families.md) is updated on purpose
    expected = EXPECTED_OUTCOMES[fam.name]
    assert sorted(expected) == sorted(CI_VARIANTS)
    for name in CI_VARIANTS:
        v = summary["variants"].get(name) or {}
        status, reason = ("refused", refused[name]) if name in refused else (v.get("status"), v.get("reason") or "")
        kind, _, text = expected[name].partition(": ")
        assert status == kind and text in reason, (fam.name, name, status, reason, "expected", expected[name])
        assert "not evaluated in this run" not in reason, (fam.name, name, reason)


def reference_cases_present(fam) -> bool:
    return (vocab_dir() / f"ggml-vocab-{fam.vocab}.gguf.out").is_file()
