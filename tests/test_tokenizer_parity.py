"""Issue: a GGUF whose tokenizer splits some suite text differently from the HF tokenizer. The divergence is
reported (texts, tokens, pre-tokenizers), the GGUF variants still run on the HF ids, and the deployment path
(llama.cpp tokenizing the rendered chat itself, as a server does) is measured beside the HF-id path."""

import json

import pytest

from pipeline.cli import run

# The bundled minutes prompt's pattern: a whitespace run before a digit. transformers' GGUF tokenizer (plain
# ByteLevel) gives '\n', '\n', '1'; llama.cpp's 'smollm' pre-tokenizer splits digits first and gives '\n\n', '1'.
DIVERGING = {"id": "minutes-numbered", "turns": [
    {"user": "Apologies: Fergus Kerr (IT)\n\n1. Jan KPIs - OTIF 94%\n\n2. Carrier review. Reply with the number "
             "of agenda items only.", "max_new_tokens": 12, "checks": [{"type": "contains", "value": "2"}]},
    {"user": "And the first item?", "max_new_tokens": 12}]}
SAME = {"id": "plain-order", "turns": [{"user": "Order KB-40317 shipped today. Reply with the order number only.",
                                        "max_new_tokens": 12, "checks": [{"type": "contains", "value": "KB-40317"}]}]}


@pytest.fixture
def diverging_suite(tmp_path):
    path = tmp_path / "minutes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (DIVERGING, SAME)))
    return path


@pytest.mark.slow
def test_gguf_variants_run_and_the_divergence_and_its_cost_are_reported(tiny_cfg, diverging_suite):
    args = [f"+suites.minutes.path={diverging_suite}", "run.suites=[minutes]", "profile.deployment_path=diverging"]
    for v in ("original", "gguf_f16", "gguf_q8_0"):
        assert run(tiny_cfg(f"variant={v}", *args)) == 0, v
    cfg = tiny_cfg("command=report", "run.variants=[original,gguf_f16,gguf_q8_0]", *args)
    assert run(cfg) == 0
    summary = json.loads((cfg.results_dir / "summary.json").read_text())
    parity = summary["reference"]["parity"]
    tok = parity["tokenizer"]
    assert parity["ok"] and summary["reference"]["runtime"] == "gguf_f16@llamacpp"
    assert tok["diverging_texts"] >= 1 and 0 < tok["diverging_tokens"] < tok["hf_tokens"]
    assert tok["by_suite"]["minutes"]["diverging_texts"] == tok["diverging_texts"]
    assert tok["gguf_pre_tokenizer"] == "smollm" and tok["hf_pre_tokenizer"].startswith("ByteLevel")
    ex = tok["examples"][0]
    assert "\n\n1" in ex["context"] and ex["hf"][:2] == [198, 198] and ex["gguf"][0] != 198
    for name in ("gguf_f16", "gguf_q8_0"):
        v = summary["variants"][name]
        assert v["status"] == "ok", v.get("reason")
        d = v["deployment"]
        assert d["suites"] == ["minutes"] and d["replies"] == 3 and d["checks"] == 2
        assert d["pass_rate_ids"] is not None and d["pass_rate_served"] is not None and d["chrf_mean"] is not None
    assert summary["variants"]["original"]["deployment"] is None      # transformers has no tokenizer of its own
    report = (cfg.results_dir / "report.md").read_text()
    assert "Tokenizer divergence" in report and "`smollm`" in report and "Deployment path" in report


def test_deployment_suites_follow_the_profile(tiny_cfg):
    from pipeline.stages.deployment import deployment_suites
    from pipeline.suites.records import Conversation, Turn

    one = [Conversation(id="a", suite="s1", turns=[Turn(user="x")])]
    two = [Conversation(id="b", suite="s2", turns=[Turn(user="x"), Turn(user="y")])]
    suites = {"s1": one, "s2": two, "s3": one}
    parity = {"tokenizer": {"by_suite": {"s1": {"diverging_texts": 0}, "s2": {"diverging_texts": 0},
                                         "s3": {"diverging_texts": 1}}}}
    chosen = {mode: deployment_suites(tiny_cfg("variant=gguf_q8_0", f"profile.deployment_path={mode}"), parity, suites)
              for mode in ("diverging", "auto", "always", "never")}
    assert chosen == {"diverging": ["s3"], "auto": ["s2", "s3"], "always": ["s1", "s2", "s3"], "never": []}
    assert deployment_suites(tiny_cfg("variant=original", "profile.deployment_path=always"), parity, suites) == []


def test_the_embedded_gguf_tokenizer_is_repaired_to_match_llama_cpp(tmp_path, embedded_gguf):
    """transformers rebuilds the GGUF's tokenizer with a plain ByteLevel pre-tokenizer; prepare gives it the
    digit split that the GGUF's `tokenizer.ggml.pre` (smollm) names, so it agrees with llama.cpp."""
    from transformers import AutoTokenizer

    from pipeline.infra.llama_tools import load_llama_cpp
    from pipeline.stages.prepare import repair_gguf_tokenizer
    from pipeline.infra.gguf_file import gguf_metadata

    llama_cpp = load_llama_cpp()
    text = "Apologies: Fergus Kerr (IT)\n\n1. Jan KPIs\n  42 units on 2024-03-01\t\t7"
    tok = AutoTokenizer.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name)
    llm = llama_cpp.Llama(str(embedded_gguf), vocab_only=True, verbose=False)
    reference = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert tok(text, add_special_tokens=False)["input_ids"] != reference          # the bug this repairs
    pre = gguf_metadata(embedded_gguf, "tokenizer.ggml.pre")
    assert pre == "smollm"
    assert repair_gguf_tokenizer(tok, pre)["gguf_pre_tokenizer"] == "smollm"
    tok.save_pretrained(str(tmp_path))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded(text, add_special_tokens=False)["input_ids"] == reference
    assert repair_gguf_tokenizer(reloaded, pre) is None        # already a Sequence: nothing to repair
    assert repair_gguf_tokenizer(AutoTokenizer.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name),
                                 "llama-bpe") is None          # a type transformers handles itself
