"""lm-eval on quantdrift's runtimes (pipeline.suites.lmeval): the adapter's greedy replies are the runtime's own
free-running replies, its log-likelihoods (rolling ones included) the runtime's token log-probs and lm-eval's own HF
model's within 1e-4; the offline tasks load and score; a registry task runs by name from a datasets cache, or is
refused naming the cache; flips and McNemar on vectors with known answers. A tiny random llama on transformers and
as an F16 GGUF on llama.cpp."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pipeline.config.schema import PROJECT_ROOT, VariantConfig
from pipeline.suites.lmeval import flips
from pipeline.suites.lmeval.sandbox import check_completions
from pipeline.suites.lmeval.tasks import TASKS, get_task, load_docs, sample_count
from pipeline.infra.errors import ConfigError
from tests.conftest import ARC_SPLITS, arc_docs, write_arc_easy_cache

CONTEXT = ("Customer Aoife Brennan reports that invoice INV-20931 for EUR 1,249.50 was charged twice on 3 March. "
           "Please confirm the refund timeline in your reply.\nReply:")


# ------------------------------------------------------------------ the tiny model on both runtimes

@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_tokenizer_dir):
    """conftest's tiny llama with head dim 32 (2 heads) so llama.cpp's q8_0 cache blocks fit, prepared as the
    original, and its F16 GGUF."""
    from transformers import AutoTokenizer

    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from tests.conftest import build_tiny_llama, compose

    root = tmp_path_factory.mktemp("lmeval")
    model = build_tiny_llama(root / "tiny-hd32", tiny_tokenizer_dir, heads=2)
    base = [f"model.source={model}", "model.name=tiny", f"paths.artifacts={root / 'artifacts'}",
            f"paths.cache={PROJECT_ROOT / '.cache'}"]
    cfg = compose(base)
    original = prepare(cfg.model, cfg.model_dir)
    f16 = build_artifact(VariantConfig(name="gguf_f16", quantizer="gguf", runtime="llamacpp",
                                       quantize={"type": "F16"}), original, cfg)
    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    return {"base": base, "original": original, "f16": f16, "tok": tok, "root": root}


RUNTIMES = ["hf", "llamacpp"]


def _lm(built, runtime: str, *overrides: str, n_ctx: int = 512):
    from pipeline.suites.lmeval.adapter import RuntimeLM
    from tests.conftest import compose

    cfg = compose([*built["base"], *overrides])
    if runtime == "hf":
        cfg.variant = VariantConfig(name="original")
        path = built["original"].checkpoint
    else:
        cfg.variant = VariantConfig(name="gguf_f16", runtime="llamacpp")
        path = built["f16"].path
    return RuntimeLM.for_variant(cfg, path, built["tok"], built["original"].facts["eos_token_ids"], n_ctx=n_ctx)


def _counting(rt):
    """Count the runtime's generate calls (the chunked path must really make several)."""
    calls = []
    inner = rt.generate

    def generate(*args, **kwargs):
        calls.append(args[1])
        return inner(*args, **kwargs)

    rt.generate = generate
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("decoding, chunked", [(("runtime.repeat_penalty=1.0",), True),
                                               (("runtime.repeat_scope=context",), True),
                                               ((), False)])          # the default penalty on the reply alone
def test_generate_until_is_the_runtimes_own_free_running_reply(built, runtime, decoding, chunked):
    from lm_eval.api.instance import Instance

    from pipeline.suites.lmeval.adapter import cut_at_stop

    lm = _lm(built, runtime, *decoding)
    rt, stop_ids = lm.runtime, lm.stop_ids
    assert lm.chunked is chunked
    prompt = lm.tok_encode(CONTEXT)
    rt.reset()
    own = rt.generate(prompt, 40, stop_ids)            # the runtime's free-running reply, one call
    assert own.stop == "length", "the tiny model ended early: pick another prompt"
    own_text = lm.tok_decode(own.ids)

    calls = _counting(rt)
    req = Instance("generate_until", {}, (CONTEXT, {"until": ["NEVER-IN-TEXT"], "max_gen_toks": 40,
                                                    "do_sample": False}), 0)
    assert lm.generate_until([req]) == [own_text]
    assert calls == ([16, 16, 8] if chunked else [40])
    assert lm.log[-1] == {"prompt_tokens": len(prompt), "reply_tokens": 40, "stop": "length"}

    # a stop string from the middle of the reply: stopped at the first token whose text holds it, cut before it
    stop = next(own_text[i:i + 3] for i in range(len(own_text) // 2, len(own_text) - 3)
                if own_text[i:i + 3].strip() and own_text[i:i + 3] not in own_text[:i])
    k = next(k for k in range(1, 41) if stop in lm.tok_decode(own.ids[:k]))
    del calls[:]
    assert lm.generate_until([Instance("generate_until", {}, (CONTEXT, {"until": [stop], "max_gen_toks": 40}), 0)]
                             ) == [cut_at_stop(lm.tok_decode(own.ids[:k]), [stop])]
    assert lm.log[-1]["reply_tokens"] == k and lm.log[-1]["stop"] == "until"
    if chunked:
        assert len(calls) == (k + 15) // 16, "the chunked path must stop generating at the stop string"
    rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("variant, cache", [("original", {"kv_cache_dtype": "int8"}),
                                            ("gguf_f16", {"cache_type_k": "q8_0", "cache_type_v": "q8_0"})])
def test_a_kv_cache_variant_runs_with_its_cache(built, variant, cache):
    """The adapter loads a variant as the pipeline composes it (variant=... kv_cache=int8): its quantized KV cache
    is the one the replies and scores come from."""
    from pipeline.suites.lmeval.adapter import RuntimeLM
    from tests.conftest import compose

    cfg = compose([*built["base"], f"variant={variant}", "kv_cache=int8", "runtime.repeat_penalty=1.0"])
    path = built["original"].checkpoint if cfg.variant.runtime == "hf" else built["f16"].path
    lm = RuntimeLM.for_variant(cfg, path, built["tok"], built["original"].facts["eos_token_ids"], n_ctx=512)
    assert {k: lm.info["runtime"][k] for k in cache} == cache
    prompt = lm.tok_encode(CONTEXT)
    lm.runtime.reset()
    own = lm.runtime.generate(prompt, 40, lm.stop_ids)
    assert lm.generate_text(CONTEXT, [], 40) == lm.tok_decode(own.ids)
    lm.runtime.close()


@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_loglikelihood_is_the_sum_of_the_runtimes_token_logprobs(built, runtime):
    from lm_eval.api.instance import Instance

    lm = _lm(built, runtime, "runtime.repeat_penalty=1.0")
    pairs = [("Question: How many days are in a week?\nAnswer:", " 7 days"),
             ("Question: How many days are in a week?\nAnswer: ", "seven days a week")]   # the space moves over
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx, cont = lm._encode_pair(context, continuation)
        assert lm.tok_decode(ctx + cont) == context + continuation and len(cont) >= 2
        ids = ctx + cont
        rows = lm.runtime.logprobs(ids, list(range(len(ctx) - 1, len(ids) - 1)))
        assert logprob == pytest.approx(float(sum(rows[i, t] for i, t in enumerate(cont))), rel=1e-6, abs=1e-6)
        assert logprob < 0
        assert greedy == all(int(rows[i].argmax()) == t for i, t in enumerate(cont))
    # a continuation made of the runtime's own argmax tokens is greedy
    ctx = lm.tok_encode(pairs[0][0])
    lm.runtime.reset()
    reply = lm.runtime.generate(ctx, 3, []).ids
    assert lm._loglikelihood_tokens([(("", ""), ctx, reply)])[0][1] is True

    # loglikelihood_rolling: every token of the text scored once, the first after the prefix token, in windows of
    # max_length tokens; the total is the sum of the runtime's own log-probs over the windows
    text = CONTEXT * 2
    tokens = lm.tok_encode(text)
    for window in (512, 8):
        lm.max_length = window
        windows = lm.rolling_windows(text)
        assert [t for _, cont in windows for t in cont] == tokens
        assert windows[0][0] == [lm.prefix_token_id] and all(len(c) + len(w) - 1 <= window for c, w in windows)
        assert len(windows) == (1 if window == 512 else -(-len(tokens) // window)) and len(tokens) > 2 * 8
        expected = 0.0
        for ctx_ids, cont in windows:
            ids = ctx_ids + cont
            rows = lm.runtime.logprobs(ids[:-1], list(range(len(ctx_ids) - 1, len(ids) - 1)))
            expected += float(sum(rows[i, t] for i, t in enumerate(cont)))
        got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        assert got[0] == pytest.approx(expected, rel=1e-6, abs=1e-5) and got[0] < 0
    lm.runtime.close()


def test_sampling_and_unknown_generation_settings_are_refused():
    from pipeline.suites.lmeval.adapter import greedy_request

    assert greedy_request({"until": "\n\n", "max_gen_toks": 7, "do_sample": False}) == (["\n\n"], 7)
    assert greedy_request({"max_new_tokens": 5, "temperature": 0.0}) == ([], 5)
    assert greedy_request({"do_sample": False, "temperature": 0.7, "top_p": 0.9}) == ([], 256)   # ignored, as HF
    for bad, match in (({"do_sample": True}, "sampling"), ({"temperature": 0.7}, "sampling"),
                       ({"num_beams": 4}, "beam"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
                       ({"max_gen_toks": 0}, "at least 1")):
        with pytest.raises(ValueError, match=match):
            greedy_request(bad)


@pytest.mark.slow
def test_a_request_longer_than_the_context_fails_with_the_numbers(built):
    lm = _lm(built, "llamacpp")
    with pytest.raises(ConfigError, match="context of 512"):
        lm.generate_text(CONTEXT, [], 500)
    lm.runtime.close()


# ------------------------------------------------------------------ tasks through lm-eval

@pytest.mark.slow
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_business_mc_task_runs_through_lm_eval_on_each_runtime(built, runtime, tmp_path):
    from lm_eval.api.instance import Instance

    from pipeline.suites.lmeval.tasks import run_task

    lm = _lm(built, runtime)
    out = run_task(lm, "business_mc", tmp_path / "datasets", limit=6)
    docs = load_docs("business_mc")[:6]
    assert [s["id"] for s in out["samples"]] == [d["id"] for d in docs]
    assert out["task"]["data_sha256"] == hashlib.sha256(get_task("business_mc").data_file.read_bytes()).hexdigest()
    assert out["task"]["version"] == "2" and out["task"]["lm_eval"] == "0.4.13"
    # lm-eval's acc is the option of highest log-likelihood, recomputed here from the runtime itself
    for s, d in zip(out["samples"], docs):
        lls = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, ("Question: " + d["question"]
                                                                               + "\nAnswer:", " " + c), 0)
                                                 for c in d["choices"]])]
        assert [r[0] for r in s["response"]] == pytest.approx(lls, rel=1e-6, abs=1e-6)
        assert s["metrics"]["acc"] == (int(np.argmax(lls)) == d["answer"])
        per_char = np.asarray(lls) / [len(c) for c in d["choices"]]
        assert s["correct"] == s["metrics"]["acc_norm"] == (int(np.argmax(per_char)) == d["answer"])
    assert out["metrics"]["acc_norm"] == pytest.approx(np.mean([s["correct"] for s in out["samples"]]))
    assert set(out["metrics"]) == {"acc", "acc_norm"}
    lm.runtime.close()


def _needs_confinement():
    from pipeline.suites.lmeval.sandbox import confinement

    if not confinement()["confined"]:       # model-written code never runs unconfined (tests/test_sandbox.py)
        pytest.skip(f"model-written code cannot be confined here: {confinement()['how']}")


@pytest.mark.slow
def test_humaneval_runs_through_lm_eval_with_its_checks_confined(built, tmp_path):
    from pipeline.suites.lmeval.tasks import run_task

    _needs_confinement()
    # the bench stage's context (BENCH_CONTEXT_TOKENS): the prompt and lm-eval's 1024-token reply cap fit
    lm = _lm(built, "hf", "runtime.repeat_penalty=1.0", n_ctx=2048)
    out = run_task(lm, "humaneval", tmp_path / "datasets", limit=1)
    assert [s["id"] for s in out["samples"]] == ["HumanEval/0"]
    assert all(s["correct"] is False and s["outcome"] for s in out["samples"])     # a random model solves nothing
    assert out["metrics"] == {"pass_at_1": 0.0}
    assert all(r["prompt_tokens"] > 0 and r["reply_tokens"] <= 1024 for r in lm.log)
    assert out["task"]["max_gen_toks"] == 1024 and out["task"]["version"] == "2"
    assert out["sandbox"]["timeout_s"] == 3.0 and out["sandbox"]["sandboxed"] is True
    assert out["sandbox"]["confinement"].startswith("bubblewrap")
    lm.runtime.close()


def test_the_business_mc_file_is_well_formed():
    path = PROJECT_ROOT / "prompts" / "bench" / "business_mc.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert 40 <= len(rows) <= 400
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        # generated questions also keep their steps and inputs (tests/test_business_mc.py recomputes them)
        assert {"id", "category", "question", "choices", "answer"} <= set(r) <= {
            "id", "category", "question", "choices", "answer", "difficulty", "facts"}, r["id"]
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4, r["id"]
        assert all(isinstance(c, str) and c.strip() for c in r["choices"]), r["id"]
        assert isinstance(r["answer"], int) and 0 <= r["answer"] < 4, r["id"]
    # the right answer is not always in one place (a model preferring one position must not score)
    counts = np.bincount([r["answer"] for r in rows], minlength=4)
    assert counts.max() <= 0.4 * len(rows), counts
    assert get_task("business_mc").data_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_humaneval_loads_and_a_canonical_solution_passes_while_a_wrong_one_fails():
    docs = load_docs("humaneval")
    assert len(docs) == 164 and len({d["task_id"] for d in docs}) == 164
    assert len(get_task("humaneval").data_sha256) == 64
    _needs_confinement()
    p0, p2 = docs[0], docs[2]
    out = check_completions([
        {"problem": p0, "completion": p0["canonical_solution"]},
        {"problem": p2, "completion": p2["canonical_solution"]},
        {"problem": p0, "completion": "    return not " + p0["canonical_solution"].strip().splitlines()[-1]
         .replace("return ", "", 1) + "\n"},
        {"problem": p2, "completion": "    return number\n"},
        {"problem": p2, "completion": "    while True:\n        pass\n"},
        {"problem": p2, "completion": "    import socket\n    socket.create_connection(('192.0.2.1', 80), timeout=2)\n"
                                      "    return number % 1.0\n"},
    ], timeout_s=1.0)
    results = out["results"]
    assert [r["passed"] for r in results[:2]] == [True, True]
    assert not results[2]["passed"] and not results[3]["passed"]
    assert results[4]["result"] == "timed out"
    assert out["sandboxed"] and out["network_interfaces"] == ["lo"]
    assert not results[5]["passed"] and "unreachable" in results[5]["result"].lower(), results[5]


def test_humaneval_caps_replies_as_lm_evals_own_task(tmp_path):
    """The reply cap is the installed lm-eval humaneval task's max_gen_toks (1024 in 0.4.13, not the 384 of version
    1 of this task), with its stop strings; the cap is in the task's key, so results capped otherwise are not
    reused."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    theirs = load_yaml(Path(lm_eval.__file__).parent / "tasks" / "humaneval" / "humaneval.yaml", resolve_func=False)
    ours = get_task("humaneval").config(tmp_path)
    assert ours["generation_kwargs"]["max_gen_toks"] == theirs["generation_kwargs"]["max_gen_toks"] == 1024
    assert ours["generation_kwargs"]["until"] == theirs["generation_kwargs"]["until"]
    key = get_task("humaneval").key()
    assert key["max_gen_toks"] == 1024 and key["version"] == "2"
    assert "max_gen_toks" not in get_task("business_mc").key()       # it generates nothing
    assert set(TASKS) == {"humaneval", "business_mc"}


# ------------------------------------------------------------------ flips, recovery, McNemar

def _vectors(both, c2w, w2c, neither):
    original, variant, i = {}, {}, 0
    for o, v, n in ((True, True, both), (True, False, c2w), (False, True, w2c), (False, False, neither)):
        for _ in range(n):
            original[f"s{i:03d}"], variant[f"s{i:03d}"] = o, v
            i += 1
    return original, variant


def test_flips_recovery_and_exact_mcnemar_on_known_vectors():
    original, variant = _vectors(both=10, c2w=9, w2c=1, neither=0)
    r = flips.compare(original, variant)
    assert (r["samples"], r["correct_to_wrong"], r["wrong_to_correct"]) == (20, 9, 1)
    assert r["mcnemar_p"] == pytest.approx(22 / 1024) and round(r["mcnemar_p"], 4) == 0.0215
    assert r["accuracy"]["estimate"] == pytest.approx(11 / 20)
    assert r["reference_accuracy"]["estimate"] == pytest.approx(19 / 20)
    assert r["recovery"]["estimate"] == pytest.approx(11 / 19)
    assert r["accuracy_delta"]["estimate"] == pytest.approx(-8 / 20)
    assert r["flip_rate"] == pytest.approx(10 / 20)
    for name in ("accuracy", "reference_accuracy", "recovery", "accuracy_delta"):
        assert r[name]["low"] <= r[name]["estimate"] <= r[name]["high"] and r[name]["low"] < r[name]["high"], name
    assert r["recovery"]["high"] < 1.0            # paired: this much damage is resolved by 20 samples
    assert r["no_signal_for_flips"] is False

    same = flips.compare(original, original)
    assert same["mcnemar_p"] is None and same["recovery"]["estimate"] == 1.0      # no discordant pair: no test
    assert same["recovery"]["low"] == same["recovery"]["high"] == 1.0
    # balanced flips: equal accuracy, many changed answers, nothing significant
    o, v = _vectors(both=5, c2w=6, w2c=6, neither=3)
    eq = flips.compare(o, v)
    assert eq["accuracy"]["estimate"] == eq["reference_accuracy"]["estimate"] and eq["mcnemar_p"] == 1.0
    assert eq["flip_rate"] == pytest.approx(12 / 20)


def test_a_task_every_variant_fails_shows_the_exact_interval_and_no_test():
    """HumanEval's first 16 problems, none solved by anyone: [0, 20.6 %] (Clopper-Pearson), not [0, 0], and no
    McNemar p that would read as "no loss"."""
    none = {f"s{i:03d}": False for i in range(16)}
    r = flips.compare(none, dict(none))
    assert r["accuracy"]["low"] == 0.0 and r["accuracy"]["high"] == pytest.approx(0.206, abs=5e-4)
    assert "exact" in r["accuracy"]["method"] and r["mcnemar_p"] is None and r["recovery"] is None
    every = flips.accuracy({f"s{i}": True for i in range(16)})
    assert every["high"] == 1.0 and every["low"] == pytest.approx(1 - 0.206, abs=5e-4)


def test_flips_need_the_same_samples_and_say_when_there_is_no_signal():
    original, variant = _vectors(both=1, c2w=1, w2c=3, neither=15)
    r = flips.compare(original, variant)
    assert r["no_signal_for_flips"] is True and r["recovery"]["estimate"] == pytest.approx(4 / 2)
    nothing = {k: False for k in original}
    assert flips.compare(nothing, variant)["recovery"] is None
    variant.pop("s000")
    with pytest.raises(ValueError, match="1 only in the original"):
        flips.compare(original, variant)


def test_family_wise_adjustment_over_a_tasks_variants():
    original, bad = _vectors(both=10, c2w=9, w2c=1, neither=0)
    out = flips.compare_variants(original, {"q4": bad, "q8": dict(original)})
    assert out["q4"]["mcnemar_p_adjusted"] == pytest.approx(22 / 1024)     # q8 answered alike: no test, no family
    assert out["q8"]["mcnemar_p_adjusted"] is None
    assert flips.outcomes([{"id": "a", "correct": True}, {"id": "b", "correct": False}]) == {"a": True, "b": False}


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny llama with a tokenizer whose post-processor adds a BOS (as Llama 3's, Mistral's and Gemma's do)."""
    from tests.conftest import build_tiny_llama

    root = tmp_path_factory.mktemp("bos")
    model = build_tiny_llama(root / "tiny-bos", tiny_tokenizer_dir, heads=2)
    tok = json.loads((model / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == bos)
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                      {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    return model, bos_id


@pytest.fixture(scope="module")
def bos_original(bos_model, tmp_path_factory):
    """The BOS-adding tiny llama prepared as the original, and a factory of the adapter on it (float32, the bench
    stage's decoding)."""
    from transformers import AutoTokenizer

    from pipeline.suites.lmeval.adapter import RuntimeLM
    from pipeline.stages.lmeval_tasks import bench_config
    from pipeline.stages.prepare import prepare
    from tests.conftest import compose

    model, bos_id = bos_model
    root = tmp_path_factory.mktemp("bos-original")
    cfg = compose([f"model.source={model}", "model.name=tiny-bos", f"paths.artifacts={root / 'artifacts'}",
                   f"paths.cache={PROJECT_ROOT / '.cache'}"])
    original = prepare(cfg.model, cfg.model_dir)
    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    cfg.variant = VariantConfig(name="original", runtime_options={"dtype": "float32"})
    cfg = bench_config(cfg)             # the bench stage's decoding: plain greedy, as lm-eval's own models decode

    def adapter(max_length: int = 512):
        lm = RuntimeLM.for_variant(cfg, original.checkpoint, tok, original.facts["eos_token_ids"], n_ctx=512)
        lm.max_length = max_length
        return lm

    def hflm(**kwargs):
        """lm-eval's own HF model on the same checkpoint, float32 as the adapter."""
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=str(original.checkpoint), device="cpu", dtype="float32", batch_size=1, **kwargs)

    return {"bos_id": bos_id, "adapter": adapter, "hflm": hflm}


def test_the_adapter_encodes_and_scores_as_lm_evals_own_hf_model_on_a_bos_adding_tokenizer(bos_original):
    """lm-eval's own HF model and the adapter on the same checkpoint (float32 on both): the same token ids for
    every context (a BOS first, as the tokenizer adds it; none twice when the text starts with it) and the same
    log-likelihoods of business_mc's first questions within 1e-4, with the same greedy flags."""
    from lm_eval.api.instance import Instance

    bos_id = bos_original["bos_id"]
    ours = bos_original["adapter"]()
    theirs = bos_original["hflm"]()
    try:
        for text in ("Question: How many days are in a week?\nAnswer:", "<|im_start|>already there"):
            assert ours.tok_encode(text) == theirs.tok_encode(text)
        assert ours.tok_encode("Question:")[0] == bos_id and ours.tok_encode("<|im_start|>x").count(bos_id) == 1
        docs = load_docs("business_mc")[:4]
        requests = [Instance("loglikelihood", doc, (f"Question: {doc['question']}\nAnswer:", f" {choice}"), i)
                    for doc in docs for i, choice in enumerate(doc["choices"])]
        a, b = ours.loglikelihood(requests), theirs.loglikelihood(requests)
        assert [g for _, g in a] == [g for _, g in b]
        assert max(abs(x - y) for (x, _), (y, _) in zip(a, b)) < 1e-4
    finally:
        ours.runtime.close()


def test_humaneval_replies_are_lm_evals_own_hf_models_on_a_bos_adding_tokenizer(bos_original):
    """HumanEval's first problems, prompted and stopped as its task does (its stop strings; a 48-token budget so that
    prompt and reply fit the tiny model's context on both sides): lm-eval's own HF model and the adapter give the
    same reply text for each, greedy, float32 on both."""
    from lm_eval.api.instance import Instance

    from pipeline.suites.lmeval.tasks import HUMANEVAL_UNTIL

    budget = 48
    ours = bos_original["adapter"]()
    theirs = bos_original["hflm"](max_length=ours.max_length)
    try:
        docs = load_docs("humaneval")[:3]
        kwargs = {"until": list(HUMANEVAL_UNTIL), "max_gen_toks": budget, "do_sample": False}
        requests = [Instance("generate_until", doc, (doc["prompt"], dict(kwargs)), 0) for doc in docs]
        assert all(len(ours.tok_encode(doc["prompt"])) + budget <= ours.max_length for doc in docs)
        a, b = ours.generate_until(requests), theirs.generate_until(requests)
        assert len(a) == len(docs) and any(a), "the replies must not all be empty"
        assert a == b
    finally:
        ours.runtime.close()


ROLLING_TEXTS = ["Invoice INV-20931 was paid.",
                 "<|im_start|>A text that starts with the BOS text itself.",
                 CONTEXT + " The refund of EUR 1,249.50 reaches the card within five working days of approval, "
                           "and the duplicate charge is reversed on the same day."]


def test_loglikelihood_rolling_matches_lm_evals_own_hf_model(bos_original):
    """lm-eval's HF model and the adapter on the same float32 checkpoint, both with a 16-token window: the same
    rolling windows (same ids, the same prefix token) and the same summed log-likelihood within 1e-4 for each
    text, one of them spanning several windows."""
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ours = bos_original["adapter"](max_length=16)
    theirs = bos_original["hflm"](max_length=16)
    try:
        assert theirs.max_length == ours.max_length == 16 and theirs.prefix_token_id == ours.prefix_token_id
        for text in ROLLING_TEXTS:
            hf_windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=theirs.tok_encode(text), prefix_token=theirs.prefix_token_id,
                max_seq_len=theirs.max_length, context_len=1)]
            assert ours.rolling_windows(text) == hf_windows
        assert len(ours.rolling_windows(ROLLING_TEXTS[-1])) >= 4, "the long text must span several windows"
        requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(ROLLING_TEXTS)]
        a, b = ours.loglikelihood_rolling(requests), theirs.loglikelihood_rolling(requests)
        assert len(a) == len(b) == len(ROLLING_TEXTS) and all(x < 0 for x in a)
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    finally:
        ours.runtime.close()


# ------------------------------------------------------------------ any task of lm-eval's registry, offline

def test_a_registry_task_runs_by_name_from_the_datasets_cache(bos_original, tmp_path, monkeypatch):
    """bench:arc_easy, lm-eval's own task config, its data read offline from a datasets cache holding
    allenai/ai2_arc: the test split's first documents scored as lm-eval scores them, a sample per doc_id, counted
    right by acc_norm; the key holds the task, its config's version, lm-eval's version and the data's sha256."""
    import datasets.config
    import huggingface_hub.constants

    from lm_eval.api.instance import Instance

    from pipeline.suites.lmeval.registry import fingerprint
    from pipeline.suites.lmeval.tasks import run_task

    cache = tmp_path / "hf-datasets"
    docs = {split: arc_docs(split) for split in ARC_SPLITS}
    folder = write_arc_easy_cache(cache, tmp_path / "scratch", docs)
    assert sorted(p.name for p in folder.iterdir()) == ["ai2_arc-test.arrow", "ai2_arc-train.arrow",
                                                        "ai2_arc-validation.arrow", "dataset_info.json"]
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    offline_before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)

    task = get_task("arc_easy")
    assert (task.correct, task.filter, task.version, task.generates) == ("acc_norm", "none", "1.0", False)
    assert sorted(task.data_files) == sorted(p for p in folder.iterdir())
    lm = bos_original["adapter"]()
    try:
        out = run_task(lm, "arc_easy", tmp_path / "scratch-datasets", limit=4)
        test = docs["test"][:4]
        assert [s["id"] for s in out["samples"]] == ["0", "1", "2", "3"]          # lm-eval's doc_id
        assert (out["correct_metric"], out["sample_id"]) == ("acc_norm", "doc_id")
        for s, d in zip(out["samples"], test):
            lls = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, (
                f"Question: {d['question']}\nAnswer:", f" {c}"), 0) for c in d["choices"]["text"]])]
            assert [r[0] for r in s["response"]] == pytest.approx(lls, rel=1e-6, abs=1e-6)   # the test split's
            per_char = np.asarray(lls) / [len(c) for c in d["choices"]["text"]]
            assert s["correct"] == bool(s["metrics"]["acc_norm"]) == (int(np.argmax(per_char)) == 1)
            assert s["metrics"]["acc"] == (int(np.argmax(lls)) == 1) and s["target"] == 1
        assert set(out["metrics"]) == {"acc", "acc_norm"}
        assert out["metrics"]["acc_norm"] == pytest.approx(np.mean([s["correct"] for s in out["samples"]]))
    finally:
        lm.runtime.close()
    key = out["task"]
    assert {k: key[k] for k in ("task", "version", "lm_eval", "source")} == {
        "task": "arc_easy", "version": "1.0", "lm_eval": "0.4.13", "source": "lm-eval registry"}
    h = hashlib.sha256()
    for f in sorted(folder.iterdir(), key=lambda p: p.name):
        h.update(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    assert key["data_sha256"] == h.hexdigest() == fingerprint(task.data_files)
    assert sample_count("arc_easy") == 6                                       # the test split's documents
    # the hub (switched off while it ran: hub_offline) is as it was afterwards
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == offline_before

    # other data under the same name: another key (another cache, one question changed)
    changed = {**docs, "test": [{**docs["test"][0], "question": "Changed?"}] + docs["test"][1:]}
    other = tmp_path / "hf-datasets-2"
    write_arc_easy_cache(other, tmp_path / "scratch-2", changed)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(other))
    assert get_task("arc_easy").key()["data_sha256"] != key["data_sha256"]


def test_the_hub_is_off_inside_hub_offline_whatever_the_environment_said_at_import(monkeypatch):
    """datasets and huggingface_hub read HF_HUB_OFFLINE once, at import: hub_offline switches both off for the
    block (and the variables for any child), and puts everything back after."""
    import datasets.config
    import huggingface_hub.constants as hub

    from pipeline.suites.lmeval.registry import hub_offline

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with hub_offline():
        assert datasets.config.HF_HUB_OFFLINE is True and hub.is_offline_mode() is True
        assert os.environ["HF_DATASETS_OFFLINE"] == os.environ["HF_HUB_OFFLINE"] == "1"
    assert datasets.config.HF_HUB_OFFLINE is False and hub.HF_HUB_OFFLINE is False
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_a_registry_task_without_its_data_is_refused_naming_the_task_and_the_cache(tmp_path, monkeypatch):
    """An empty datasets cache: bench:arc_easy is refused before anything runs (the pre-flight's check), naming the
    task, its dataset and the cache folder looked in; nothing is fetched."""
    from pipeline.stages.lmeval_tasks import bench_problems
    from tests.conftest import compose

    cache = tmp_path / "empty-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    with pytest.raises(ConfigError) as exc:
        get_task("arc_easy")
    message = str(exc.value)
    assert "bench:arc_easy" in message and "allenai/ai2_arc" in message and str(cache) in message
    assert str(cache / "allenai___ai2_arc" / "ARC-Easy") in message
    cfg = compose(["run.suites=[smoke,bench:arc_easy,bench:business_mc]"])
    assert cfg.run.bench_tasks == ["arc_easy", "business_mc"]       # accepted by the config, refused here
    assert bench_problems(cfg) == [message]


@pytest.mark.slow
@pytest.mark.parametrize("name, match", [
    ("arc_eazy", r"bench:arc_eazy is neither a local task \(business_mc, humaneval\) nor a task of lm-eval "
                 r"0\.4\.13's registry .*close names: arc_easy"),
    ("ai2_arc", r"bench:ai2_arc is a tag of lm-eval's registry, not one task: name one of its tasks, e\.g\. "
                r"arc_easy"),
    ("wikitext", r"bench:wikitext: output type loglikelihood_rolling .* no per-sample right/wrong metric"),
    ("mbpp", r"bench:mbpp executes model-written code"),
])
def test_registry_names_that_cannot_be_a_bench_task_are_refused_with_why(name, match, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=match):
        get_task(name)


@pytest.mark.slow
def test_every_task_of_lm_evals_registry_passes_the_config_check():
    """The config's cheap check on a bench:TASK name (its form only) lets through every task lm-eval 0.4.13's whole
    registry holds, and no name with a character none of them uses."""
    from lm_eval.tasks import TaskManager

    from pipeline.config.bench_tasks import valid_task_name

    names = TaskManager().all_subtasks
    assert len(names) > 10_000 and [n for n in names if not valid_task_name(n)] == []
    assert not any(valid_task_name(n) for n in ("no*such", "a b", "x/y", "", "-x"))
