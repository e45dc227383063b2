"""Both runtimes on a tiny random llama: HF -> F16 GGUF -> Q8_0 through the real quantizer, same ids scored."""

import numpy as np
import pytest

from pipeline import metrics
from pipeline.aggregate import kv_bytes_per_token_formula
from pipeline.config import VariantConfig
from pipeline.prepare import prepare
from pipeline.quantizers import build_artifact
from pipeline.runtimes import load_runtime

pytestmark = pytest.mark.slow

TEXT = ("Customer Aoife Brennan reports that invoice INV-20931 for EUR 1,249.50 was charged twice on 3 March. "
        "Please confirm the refund timeline and the ticket number SUP-7781 in your reply. ") * 3


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama):
    from tests.conftest import compose
    from pipeline.config import PROJECT_ROOT

    root = tmp_path_factory.mktemp("rt")
    cfg = compose([f"model.source={tiny_llama}", "model.name=tiny", f"paths.artifacts={root}",
                   f"paths.cache={PROJECT_ROOT / '.cache'}"])
    original = prepare(cfg.model, cfg.model_dir)
    arts = {t: build_artifact(VariantConfig(name=f"gguf_{t.lower()}", quantizer="gguf", runtime="llamacpp",
                                            quantize={"type": t}), original, cfg) for t in ("F16", "Q8_0")}
    return cfg, original, arts


def test_artifacts_record_their_real_tensor_types(built):
    _, _, arts = built
    assert "F16" in arts["F16"].info["tensor_types"]
    assert "Q8_0" in arts["Q8_0"].info["tensor_types"]
    assert arts["Q8_0"].bytes < arts["F16"].bytes


def test_both_runtimes_score_the_same_ids_and_f16_matches_the_original(built):
    cfg, original, arts = built
    hf = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
    ids = hf_ids = None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    positions = list(range(len(ids) - 1))
    lp_hf = hf.logprobs(ids, positions)
    assert lp_hf.shape == (len(positions), original.facts["vocab_size"])
    kld = {}
    for t, art in arts.items():
        rt = load_runtime(VariantConfig(name=t, runtime="llamacpp"), art.path, cfg, n_ctx=512)
        hf_ids = rt.tokenize(TEXT)
        assert hf_ids == ids, "GGUF vocabulary and HF tokenizer must give the same ids"
        lp = rt.logprobs(ids, positions)
        kld[t] = metrics.kld_full(lp_hf, lp).mean()
        # score() returns exactly the log-probs of the requested ids, the argmax and the log-sum-exp
        cand = np.stack([np.asarray(ids[1:]), np.zeros(len(positions), dtype=np.int64)], axis=1)
        scores = rt.score(ids, positions, cand)
        np.testing.assert_allclose(scores.logprobs[:, 0], lp[np.arange(len(positions)), ids[1:]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(scores.argmax, lp.argmax(-1))
        logits = rt.logits(ids, positions).astype(np.float64)
        np.testing.assert_allclose(logits[:, 0] - scores.logsumexp, lp[:, 0], rtol=1e-9, atol=1e-9)
        rt.close()
    assert kld["F16"] < 1e-3, kld
    assert kld["Q8_0"] > kld["F16"] and kld["Q8_0"] > 0


def test_generation_is_greedy_reuses_prefixes_and_reports_kv(built):
    cfg, original, arts = built
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    prompt = tok(TEXT, add_special_tokens=False)["input_ids"][:40]
    for variant, path in ((VariantConfig(name="original"), original.checkpoint),
                          (VariantConfig(name="f16", runtime="llamacpp"), arts["F16"].path)):
        rt = load_runtime(variant, path, cfg, n_ctx=256)
        cold = rt.generate(prompt, 12, [])
        assert len(cold.ids) == 12 and cold.stop == "length" and cold.prefill_tokens == 40
        assert len(cold.decode_times_s) == 11 and cold.ttft_s > 0
        # teacher-forced argmax along the generated stream reproduces the greedy tokens
        stream = prompt + cold.ids
        lp = rt.logprobs(stream, list(range(39, 39 + 12)))
        assert lp.argmax(-1).tolist() == cold.ids
        # a follow-up prompt that extends the last one reuses the cache and gives the same result as cold
        follow = prompt + cold.ids + prompt[:5]
        warm = rt.generate(follow, 6, [])
        assert warm.prefill_tokens < len(follow)
        rt.reset()
        assert rt.generate(follow, 6, []).ids == warm.ids
        kv = rt.kv_cache_bytes()
        assert kv is not None and kv["bytes"] > 0
        if variant.runtime == "llamacpp":
            facts = original.facts
            # the serialised sequence state is the formula's K/V bytes + 12 bytes of cell metadata per token
            # (+ a small header)
            formula = kv_bytes_per_token_formula(facts, 2.0)
            assert kv["bytes"] / kv["tokens"] == pytest.approx(formula + 12, abs=3)
            # llama.cpp logs the allocated cache in MiB with two decimals
            assert kv["allocated_bytes"] == pytest.approx(formula * kv["allocated_cells"], abs=0.005 * 2**20)
        rt.close()


def test_batched_generation_agrees_with_single_sequence_and_reuses_each_slot(built):
    """llama.cpp with several sequences in one llama_batch: the same greedy tokens as one sequence at a time on at
    least 99 % of positions (batched float arithmetic may differ in the last bits), deterministic, and a slot's
    next request prefills only what follows its cached prefix."""
    cfg, original, arts = built
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    base = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompts = [base[i:i + 20 + 7 * i] for i in range(4)]
    rt = load_runtime(VariantConfig(name="q8", runtime="llamacpp"), arts["Q8_0"].path, cfg, n_ctx=512)
    single = []
    for p in prompts:
        rt.reset()
        single.append(rt.generate(p, 16, []).ids)
    many = rt.generate_many([(i, p, 16) for i, p in enumerate(prompts)], [], slots=4)
    again = rt.generate_many([(i, p, 16) for i, p in enumerate(prompts)], [], slots=4)
    assert [g.ids for g in many] == [g.ids for g in again], "not deterministic"
    same = sum(a == b for s, g in zip(single, many) for a, b in zip(s, g.ids))
    assert same / sum(len(s) for s in single) >= 0.99
    assert all(g.stop == "length" and len(g.ids) == 16 and len(g.decode_times_s) == 15 for g in many)
    # the next turn of slot 2 extends its own history: only the new tokens are prefilled
    follow = prompts[2] + many[2].ids + base[:5]
    nxt = rt.generate_many([(2, follow, 6)], [], slots=4)[0]
    assert nxt.prefill_tokens == 5 + 1
    cold = rt.generate_many([(3, follow, 6)], [], slots=4)[0]      # another slot: a cold prefill
    assert cold.prefill_tokens == len(follow) and cold.ids == nxt.ids
    rt.close()


def test_conversations_run_batched_as_they_run_one_by_one(built):
    from pipeline.conversation import ChatRenderer, run_conversation, run_conversations
    from pipeline.prompts import load_suite
    from pipeline.config import PROJECT_ROOT

    cfg, original, arts = built
    renderer = ChatRenderer(original.checkpoint, False, False)
    convs = load_suite("smoke", PROJECT_ROOT / "prompts" / "smoke.jsonl")
    rt = load_runtime(VariantConfig(name="q8", runtime="llamacpp"), arts["Q8_0"].path, cfg, n_ctx=2048)
    one = [run_conversation(rt, renderer, c, original.facts["eos_token_ids"]) for c in convs]
    done = []
    many = run_conversations(rt, renderer, convs, original.facts["eos_token_ids"], width=2, on_done=done.append)
    assert sorted(d["id"] for d in done) == sorted(c.id for c in convs)
    for a, b in zip(one, many):
        assert a["id"] == b["id"] and len(a["turns"]) == len(b["turns"])
        assert [t["end"] - t["start"] for t in a["turns"]] == [t["end"] - t["start"] for t in b["turns"]]
        assert sum(x == y for x, y in zip(a["ids"], b["ids"])) / len(a["ids"]) >= 0.99
    rt.close()
