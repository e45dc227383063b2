"""Both runtimes on a tiny random llama: HF -> F16 GGUF -> Q8_0 through the real quantizer, same ids scored."""

import numpy as np
import pytest

from pipeline.figures import drift as metrics
from pipeline.figures.capacity import kv_bytes_per_token_formula
from pipeline.config.schema import VariantConfig
from pipeline.stages.prepare import prepare
from pipeline.stages.quantize import build_artifact
from pipeline.runtimes import load_runtime

pytestmark = pytest.mark.slow

TEXT = ("Customer Aoife Brennan reports that invoice INV-20931 for EUR 1,249.50 was charged twice on 3 March. "
        "Please confirm the refund timeline and the ticket number SUP-7781 in your reply. ") * 3


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama):
    from tests.conftest import compose
    from pipeline.config.schema import PROJECT_ROOT

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
        # teacher-forced logits along the generated stream reproduce the tokens (argmax after the run's penalty)
        stream = prompt + cold.ids
        logits = rt.logits(stream, list(range(39, 39 + 12)))
        assert [rt.choice.pick(logits[k], prompt, cold.ids[:k]) for k in range(12)] == cold.ids
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
    # each prompt prefilled in chunks of its own, as generate cuts them: the very same tokens (prompts packed
    # across sequences in unequal counts changed some picks)
    assert [g.ids for g in many] == single
    assert all(g.stop == "length" and len(g.ids) == 16 and len(g.decode_times_s) == 15 for g in many)
    # the next turn of slot 2 extends its own history: only the new tokens are prefilled
    follow = prompts[2] + many[2].ids + base[:5]
    nxt = rt.generate_many([(2, follow, 6)], [], slots=4)[0]
    assert nxt.prefill_tokens == 5 + 1
    cold = rt.generate_many([(3, follow, 6)], [], slots=4)[0]      # another slot: a cold prefill
    assert cold.prefill_tokens == len(follow) and cold.ids == nxt.ids
    rt.close()


def test_batched_logits_are_bit_identical_to_single_sequence_decoding(built, embedded_gguf):
    """Prompts of unequal lengths decoded together give the very logits of one-at-a-time decoding at every step:
    each prompt is prefilled in chunks of its own. On the real embedded model (the tiny one's small matmuls do not
    show it), prompts packed across sequences in unequal counts got other activation rounding in the quantized
    matmuls and moved the logits by up to 1.7."""
    import numpy as np

    from pipeline.runtimes.llamacpp import LlamaCppRuntime

    cfg, original, arts = built
    # in this process (load_runtime would start a worker, whose picks a recorder set here cannot see)
    rt = LlamaCppRuntime(embedded_gguf, {"n_ctx": 1024}, cfg.runtime)
    base = rt.tokenize(TEXT * 8)
    prompts = [base[7 * i:7 * i + 90 + 13 * i] for i in range(4)]
    inner, rows = rt.choice, []

    class Recorder:                      # the logits every pick was made from, in call order
        def pick(self, logits, prompt, reply):
            rows.append(np.array(logits, dtype=np.float32, copy=True))
            return inner.pick(logits, prompt, reply)

    rt.choice = Recorder()
    single = []
    for p in prompts:
        rt.reset()
        rows.clear()
        ids = rt.generate(p, 10, []).ids
        single.append((ids, list(rows)))
    rt.reset()
    rows.clear()
    many = rt.generate_many([(i, p, 10) for i, p in enumerate(prompts)], [], slots=4)
    batched = [[rows[i]] + [rows[len(prompts) + t * len(prompts) + i] for t in range(9)] for i in range(4)]
    rt.choice = inner
    rt.close()
    assert [g.ids for g in many] == [ids for ids, _ in single]
    for (_, one), together in zip(single, batched):
        assert max(float(np.abs(a - b).max()) for a, b in zip(one, together)) == 0.0


def test_batched_path_decoded_on_given_tokens_picks_what_their_history_implies(built):
    """``generate_many(forced=...)`` (make bench's agreement after the same history) feeds the given tokens, not
    its picks, and returns the pick at every position: the penalised argmax of the logits after that history."""
    cfg, original, arts = built
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    base = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompts = [base[i:i + 20 + 5 * i] for i in range(3)]
    given = [base[40 + 3 * i:52 + 3 * i] for i in range(3)]        # text the model would not pick itself
    rt = load_runtime(VariantConfig(name="q8", runtime="llamacpp"), arts["Q8_0"].path, cfg, n_ctx=512)
    free = [g.ids for g in rt.generate_many([(i, p, 12) for i, p in enumerate(prompts)], [], slots=3)]
    rt.reset()
    picks = [g.ids for g in rt.generate_many([(i, p, 12) for i, p in enumerate(prompts)], [], slots=3,
                                             forced=given)]
    expected = []
    for p, g in zip(prompts, given):
        rows = rt.logits(p + g, [len(p) - 1 + t for t in range(12)])
        expected.append([rt.choice.pick(rows[t], p, g[:t]) for t in range(12)])
    same = sum(a == b for e, q in zip(expected, picks) for a, b in zip(e, q))
    assert same / 36 >= 0.9
    assert free != expected                  # the free-running path would not have given these picks
    with pytest.raises(ValueError, match="forced"):
        rt.generate_many([(0, prompts[0], 12)], [], slots=3, forced=[given[0][:5]])
    rt.close()


def test_conversations_run_batched_as_they_run_one_by_one(built):
    from pipeline.suites.conversation import ChatRenderer, run_conversation, run_conversations
    from pipeline.suites.records import load_suite
    from pipeline.config.schema import PROJECT_ROOT

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


def test_first_differences_and_agreement_count_positions():
    from pipeline.instruments.batched_bench import agreement, first_differences

    single = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    batched = [[1, 2, 3, 4], [5, 0, 7, 8], [9]]
    assert first_differences(single, batched) == [None, 1, 1]
    assert agreement(single, batched) == pytest.approx(8 / 10)


def test_batched_table_lists_sequence_counts_in_numeric_order_after_a_json_round_trip():
    import json

    from pipeline.instruments.batched_bench import format_batched

    row = {"ratio": 1.0, "tool_speedup": 1.0, "agreement": 1.0, "agreement_same_history": 1.0, "speedup": 1.0,
           "decode_tokens_per_s": 100.0, "tool_decode_tokens_per_s": 100.0, "deterministic": True}
    out = {"variant": "q8", "file": "m.gguf", "threads": 2, "n_batch": 512, "flash_attn": True, "prompt_tokens": 8,
           "gen_tokens": 8, "rounds": 1, "single_decode_tokens_per_s": 100.0, "min_ratio": 0.9,
           "verdict": "meets", "min_agreement": 1.0, "min_agreement_same_history": 1.0,
           "sequences": {str(n): row for n in (1, 4, 8, 16)}}
    stored = json.loads(json.dumps(out, sort_keys=True))
    assert list(stored["sequences"]) == ["1", "16", "4", "8"]
    counts = [line.split()[0] for line in format_batched(stored).splitlines()[3:-1]]
    assert counts == ["1", "4", "8", "16"]


def test_the_batched_speed_up_ratio_is_judged_on_its_range_across_rounds():
    """The target is met where the range of the per-round ratios lies at or above it, missed where it lies below,
    undecided where it straddles it; the table prints the range and names the undecided counts."""
    from pipeline.instruments.batched_bench import format_batched, ratio_verdict
    from pipeline.figures.stats import median_interval

    iv = median_interval([0.80, 0.86, 0.97])
    assert (iv["estimate"], iv["low"], iv["high"]) == (0.86, 0.80, 0.97)
    assert ratio_verdict(iv, 0.9) == "undecided"
    assert ratio_verdict(median_interval([0.91, 0.95, 1.2]), 0.9) == "meets"
    assert ratio_verdict(median_interval([0.7, 0.8, 0.89]), 0.9) == "fails"
    row = {"ratio": 0.86, "ratio_interval": iv, "verdict": "undecided", "tool_speedup": 3.0, "agreement": 1.0,
           "agreement_same_history": 1.0, "speedup": 2.6, "decode_tokens_per_s": 360.0,
           "tool_decode_tokens_per_s": 370.0, "deterministic": True}
    out = {"variant": "q8", "file": "m.gguf", "threads": 2, "n_batch": 512, "flash_attn": True, "prompt_tokens": 8,
           "gen_tokens": 8, "rounds": 3, "single_decode_tokens_per_s": 134.0, "min_ratio": 0.9,
           "verdict": "undecided", "min_agreement": 1.0, "min_agreement_same_history": 1.0,
           "sequences": {"16": row}}
    text = format_batched(out)
    assert "0.86 [0.80-0.97]" in text and "undecided (the range straddles 0.9 at 16 sequences)" in text


def test_llama_batched_bench_output_is_parsed_among_log_lines():
    from pipeline.instruments.batched_bench import parse_batched_bench

    text = ("main: n_kv_max = 4096\n"
            '{"n_kv_max": 4096, "n_batch": 512, "pp": 128, "tg": 128, "pl": 4, "n_kv": 1024, "t_pp": 0.5, '
            '"speed_pp": 1024.0, "t_tg": 2.6, "speed_tg": 196.9, "t": 3.1, "speed": 330.3}\n'
            "llama_perf_context_print: load time = 1 ms\n")
    assert parse_batched_bench(text) == {4: {"decode_tokens_per_s": 196.9, "prefill_tokens_per_s": 1024.0,
                                             "pp": 128, "tg": 128, "output_tokens_per_s": 4 * 128 / 3.1}}


@pytest.mark.parametrize("kv_unified", [False, True])
def test_batched_path_measured_beside_llama_batched_bench(built, kv_unified):
    """`make bench`'s comparison on the tiny model: llama-batched-bench (built from the same vendored source) and the
    pipeline's single and batched paths, interleaved, in the same KV layout (one stream per sequence, or one buffer
    for all: runtime.kv_unified); speed-ups against single-sequence decoding, the greedy-token agreement of the
    batched path and its determinism."""
    import dataclasses

    from transformers import AutoTokenizer

    from pipeline.instruments.batched_bench import compare_batched, format_batched
    from pipeline.config.commands import BenchConfig
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.llama_tools import tool
    from pipeline.runtimes.llamacpp import gguf_file

    try:
        tool("llama-batched-bench")
    except ConfigError as exc:
        pytest.skip(str(exc))
    cfg, original, arts = built
    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    base = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompts = [base[i * 5:i * 5 + 16] for i in range(3)]
    bench = BenchConfig(sequences=[1, 3], prompt_tokens=16, gen_tokens=12, batched_rounds=2)
    cfg = dataclasses.replace(cfg, bench=bench, runtime=dataclasses.replace(cfg.runtime, kv_unified=kv_unified))
    out = compare_batched(cfg, VariantConfig(name="q8", runtime="llamacpp"), gguf_file(arts["Q8_0"].path), prompts)
    assert out["kv_unified"] is kv_unified
    assert set(out["sequences"]) == {"1", "3"}
    one, three = out["sequences"]["1"], out["sequences"]["3"]
    assert one["tool_speedup"] == pytest.approx(1.0)
    assert len(three["rounds"]["tool"]) == len(three["rounds"]["ours"]) == 2
    assert three["tool_decode_tokens_per_s"] > 0 and three["decode_tokens_per_s"] > 0
    per_round = sorted((o / s) / (t / t1) for o, s, t, t1 in zip(three["rounds"]["ours"], out["single_rounds"],
                                                               three["rounds"]["tool"], one["rounds"]["tool"]))
    iv = three["ratio_interval"]
    assert three["ratio"] == pytest.approx(sum(per_round) / 2) and (iv["low"], iv["high"]) == tuple(per_round)
    assert three["verdict"] in ("meets", "undecided", "fails") and one["verdict"] is None
    assert out["verdict"] == three["verdict"]
    assert three["agreement"] >= 0.99 and three["deterministic"]
    assert three["agreement_same_history"] >= 0.99 and out["min_agreement_same_history"] <= 1.0
    assert len(three["first_difference"]) == 3
    assert "llama-batched-bench" in format_batched(out) and "same history" in format_batched(out)
    assert ("one KV buffer for all sequences" in format_batched(out)) is kv_unified
    with pytest.raises(ConfigError, match="make llama-tools"):
        tool("llama-batched-bench", str(original.checkpoint))      # a folder without the tool


def test_hf_batched_generation_agrees_with_one_sequence_at_a_time(built):
    """transformers, several prompts of different lengths left-padded in one batch: the same greedy tokens as one
    at a time on at least 99 % of positions, each reply stopping at its own budget or stop id; the same for the
    integer KV cache, whose per-channel key ranges must not see the padding, folding its window every 4 tokens
    while rows leave the batch."""
    from transformers import AutoTokenizer

    cfg, original, _ = built
    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    base = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompts = [base[i:i + 12 + 9 * i] for i in range(3)]
    budgets = [14, 6, 10]

    def single_then_batched(rt):
        """Greedy replies one at a time, then together; asserts the batch kept each budget and agrees >= 99 %."""
        assert rt.batched
        single = []
        for p, n in zip(prompts, budgets):
            rt.reset()
            single.append(rt.generate(p, n, []).ids)
        many = rt.generate_many([(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))], [], slots=3)
        assert [len(g.ids) for g in many] == budgets and all(g.stop == "length" for g in many)
        same = sum(a == b for s, g in zip(single, many) for a, b in zip(s, g.ids))
        assert same / sum(budgets) >= 0.99, (single, [g.ids for g in many])
        return many

    rt = load_runtime(VariantConfig(name="original"), original.checkpoint, cfg)
    many = single_then_batched(rt)
    assert [len(g.decode_times_s) for g in many] == [n - 1 for n in budgets]
    # a stop id ends that sequence alone
    stop_at = many[0].ids[3]
    cut = rt.generate_many([(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))], [stop_at], slots=3)
    assert cut[0].stop == "eos" and cut[0].ids == many[0].ids[:many[0].ids.index(stop_at)]
    rt.close()
    for bits in (8, 4):
        kv = load_runtime(VariantConfig(name="original+kv_int", runtime_options={
            "kv_cache": {"bits": bits, "residual_length": 4, "score_chunk": 4}}), original.checkpoint, cfg)
        single_then_batched(kv)
        kv.close()


def test_padding_stays_out_of_the_integer_caches_key_ranges():
    """A left-padded row quantizes its keys with the ranges of its real tokens alone: its codes, scales and zero
    points equal those of the same row without padding."""
    import torch

    from pipeline.runtimes.kv_quant import IntKVLayer

    torch.manual_seed(0)
    real = torch.randn(1, 2, 5, 8)
    padded = torch.cat([torch.full((1, 2, 3, 8), 50.0), real], dim=-2)   # pad keys far outside the real range
    layer = IntKVLayer(bits=8)
    layer.pads = torch.tensor([3])
    with_pads = layer._quantize(padded, axis=-2)
    layer.pads = None
    alone = layer._quantize(real, axis=-2)
    assert torch.equal(with_pads.scale, alone.scale) and torch.equal(with_pads.zero, alone.zero)
    assert torch.equal(with_pads.data[..., 3:, :], alone.data)
    assert not torch.equal(layer._quantize(padded, axis=-2).scale, alone.scale)    # without pads: ranges move


def test_token_choice_applies_the_repetition_penalty_as_llama_cpp_does():
    """Greedy with a penalty: a logit above 0 of a recent id is divided by the penalty, one at or below 0
    multiplied; each id once however often it recurs; the window is the reply's last N ids, or the prompt's and
    the reply's; plain greedy (penalty 1, or no window) is the argmax, the first on a tie."""
    from pipeline.runtimes.base import TokenChoice

    logits = np.array([3.0, 2.9, -1.0, -1.05, 0.0], dtype=np.float32)
    before = logits.copy()
    assert TokenChoice().pick(logits, [0], [0]) == 0
    assert TokenChoice(1.1, 0).pick(logits, [0], [0]) == 0
    reply = TokenChoice(1.1, 4, "reply")
    assert reply.pick(logits, [], [0, 0, 0]) == 1          # 3.0 / 1.1 < 2.9, once, not three times
    assert reply.pick(logits, [0], [1]) == 0               # the prompt is outside the reply's window
    assert reply.pick(logits, [], [0, 1, 4, 4, 4, 4]) == 0  # 0 and 1 slid out of the last 4
    three = np.array([3.0, 2.9, 2.8], dtype=np.float32)
    assert reply.pick(three, [0], [1]) == 0
    context = TokenChoice(1.1, 4, "context")
    assert context.pick(three, [0], [1]) == 2              # 0 and 1 penalised (2.727, 2.636): 2.8 wins
    assert context.window([5, 6, 7, 8], [1]) == [6, 7, 8, 1]
    # a negative logit is multiplied: -1.0 * 1.1 = -1.1 falls below -1.05
    neg = np.array([-1.0, -1.05], dtype=np.float32)
    assert TokenChoice(1.1, 4).pick(neg, [], [0]) == 1
    np.testing.assert_array_equal(logits, before)       # the runtime's row is never modified
    assert TokenChoice(1.1, 4).key() and TokenChoice().key() == {}


def test_a_repetition_penalty_steers_every_runtime_the_same_way(built):
    """runtime.repeat_penalty: each runtime's reply, single and batched, is the penalised argmax of its own
    teacher-forced logits at every step (the same arithmetic on transformers and llama.cpp), and it changes
    replies that plain greedy decoding repeats itself in."""
    import dataclasses

    from pipeline.runtimes.base import TokenChoice

    cfg, original, arts = built
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(original.checkpoint))
    base = tok(TEXT, add_special_tokens=False)["input_ids"]
    prompts = [base[i:i + 16 + 5 * i] for i in range(3)]
    choice = TokenChoice(1.5, 8, "reply")
    plain_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, repeat_penalty=1.0))
    penalised = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, repeat_penalty=1.5,
                                                                     repeat_last_n=8, repeat_scope="reply"))
    changed = 0
    for variant, path in ((VariantConfig(name="original"), original.checkpoint),
                          (VariantConfig(name="f16", runtime="llamacpp"), arts["F16"].path)):
        plain = load_runtime(variant, path, plain_cfg, n_ctx=256)
        assert plain.choice.greedy
        greedy = [plain.generate(p, 16, []).ids for p in prompts]
        plain.close()
        rt = load_runtime(variant, path, penalised, n_ctx=256)
        assert rt.choice == choice
        single = []
        for p in prompts:
            rt.reset()
            single.append(rt.generate(p, 16, []).ids)
        for p, ids in zip(prompts, single):
            logits = rt.logits(p + ids, list(range(len(p) - 1, len(p) + len(ids) - 1)))
            assert [choice.pick(logits[k], p, ids[:k]) for k in range(len(ids))] == ids
        many = rt.generate_many([(i, p, 16) for i, p in enumerate(prompts)], [], slots=3)
        assert [g.ids for g in many] == single
        changed += sum(a != b for a, b in zip(greedy, single))
        rt.close()
    assert changed > 0, "the penalty never changed a reply: the test's prompts do not exercise it"


def test_a_checkpoint_whose_weights_transformers_cannot_place_is_skipped_naming_them(tmp_path, tiny_llama):
    """A weight the checkpoint lacks (a quantizer's per-expert or unfused layout against this transformers' fused
    modules) would be started from random values with only a log line: the runtime refuses the artifact instead,
    naming the weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.infra.errors import Skip
    from pipeline.runtimes.hf import HFRuntime
    from tests.conftest import compose

    model = shutil.copytree(tiny_llama, tmp_path / "m")
    weights = next(model.glob("*.safetensors"))
    tensors = load_file(weights)
    gone = next(k for k in tensors if k.endswith("layers.0.mlp.down_proj.weight"))
    del tensors[gone]
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = compose([f"paths.artifacts={tmp_path / 'a'}"])
    with pytest.raises(Skip, match=r"1 weight\(s\) missing or of another shape \(model.layers.0.mlp.down_proj"):
        HFRuntime(model, {"dtype": "float32"}, cfg.runtime)
