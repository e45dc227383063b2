"""The plan: artifact and memory arithmetic on several model families against hand-computed values, the GGUF
types llama.cpp really wrote for the embedded model, a run refused before any work when the machine's free disk
or memory does not fit, and `quantdrift plan` on the tiny model."""

from __future__ import annotations

import json

import pytest

from pipeline.config.schema import PROJECT_ROOT
from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import gguf_file, ggml_quant_sizes, kv_bytes, packed_bytes

SIZES = None


def sizes():
    global SIZES
    SIZES = SIZES or ggml_quant_sizes(str(PROJECT_ROOT / ".cache"))
    return SIZES


def inventory(config):
    from pipeline.runtimes.model_inventory import from_config

    return from_config(config)


SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
# per layer: q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128, two norms of 64
ATTN = 64 * 64 + 2 * 32 * 64 + 64 * 64
MLP = 3 * 128 * 64
LAYER = ATTN + MLP + 2 * 64
HEADS_DIM = 16          # 64 / 4


def test_llama_params_gguf_types_and_bytes():
    from transformers import LlamaConfig

    inv = inventory(LlamaConfig(**SMALL))
    assert inv.params == 2 * 1000 * 64 + 2 * LAYER + 64 == 202_048
    one_d = 2 * 2 * 64 + 64
    n_tensors = 2 + 2 * 9 + 1
    q8 = gguf_file(inv, "Q8_0", sizes())
    assert q8["tensor_types"] == {"F32": 5, "Q8_0": 16}
    assert q8["bytes"] == (202_048 - one_d) * 34 // 32 + one_d * 4 + 16 * n_tensors + 36 * 1000
    f16 = gguf_file(inv, "F16", sizes())
    assert f16["bytes"] == (202_048 - one_d) * 2 + one_d * 4 + 16 * n_tensors + 36 * 1000
    # rows of 64 and 128 are not multiples of 256: Q4_K falls back to Q5_0 and Q6_K to Q8_0; the head (Q6_K), the
    # last layer's attn_v and ffn_down (use_more_bits) are the Q8_0 ones
    assert gguf_file(inv, "Q4_K_M", sizes())["tensor_types"] == {"F32": 5, "Q5_0": 13, "Q8_0": 3}
    # GPTQ W4 g32: codes 0.5 B/weight, fp16 scale + 4-bit zero per 32 inputs, int32 g_idx per input row
    linear = 2 * (ATTN + MLP)
    rows = 2 * (4 * 64 + 2 * 64 + 128)
    expected = linear // 2 + linear // 32 * (2 + 0.5) + 4 * rows + (2 * 1000 * 64 + one_d) * 2
    assert packed_bytes(inv, 4, 32, True, "float16") == expected


def test_qwen2_biases_stay_f32():
    from transformers import Qwen2Config

    inv = inventory(Qwen2Config(**SMALL))
    biases = 2 * (64 + 32 + 32)
    assert inv.params == 202_048 + biases
    assert gguf_file(inv, "Q8_0", sizes())["tensor_types"]["F32"] == 5 + 6


def test_mistral_sliding_window_kv():
    from transformers import MistralConfig

    inv = inventory(MistralConfig(**SMALL, sliding_window=16))
    assert inv.facts["kv_layout"]["layer_kinds"] == {"full": 0, "window": 2, "none": 0}
    per_token_full = 2 * 2 * 2 * HEADS_DIM * 2            # layers x (K, V) x kv heads x head dim x f16
    assert kv_bytes(inv.facts, 2, 16) == per_token_full * 16
    assert kv_bytes(inv.facts, 2, 64) == per_token_full * 16          # past the window: the window only


def test_gemma2_alternating_layers():
    from transformers import Gemma2Config

    inv = inventory(Gemma2Config(**{**SMALL, "tie_word_embeddings": True}, head_dim=16, sliding_window=16))
    kinds = inv.facts["kv_layout"]["layer_kinds"]
    assert kinds == {"full": 1, "window": 1, "none": 0}
    per_layer = 2 * 2 * 16 * 2
    assert kv_bytes(inv.facts, 2, 64) == per_layer * 64 + per_layer * 16
    assert not inv.has_output            # tied: the embedding is the output matrix, quantized as the head
    assert gguf_file(inv, "Q4_0", sizes())["tensor_types"]["Q8_0"] == 1


def test_moe_experts_and_router():
    from transformers import MixtralConfig

    inv = inventory(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
    experts = 4 * (2 * 128 * 64 + 64 * 128)
    router = 4 * 64
    assert inv.params == 2 * 1000 * 64 + 2 * (ATTN + experts + router + 2 * 64) + 64
    types = gguf_file(inv, "Q8_0", sizes())["tensor_types"]
    assert types["F32"] == 5 + 2                                       # the routers stay F32
    expected = (inv.params - 5 * 64 - 2 * router) * 34 // 32 + (5 * 64 + 2 * router) * 4
    assert gguf_file(inv, "Q8_0", sizes())["bytes"] == expected + 16 * len(inv.tensors) + 36 * 1000


def test_embedded_model_gguf_types_match_the_committed_run(embedded_gguf):
    """What llama.cpp really wrote for the demo model (the committed summary's tensor types and file sizes)."""
    from pipeline.runtimes.model_inventory import from_gguf

    summary = json.loads((PROJECT_ROOT / "results/smollm2-135m-instruct/quick/summary.json").read_text())
    inv = from_gguf(embedded_gguf)
    for name in ("gguf_f16", "gguf_q8_0", "gguf_q4_k_m", "gguf_q4_0"):
        v = summary["variants"][name]
        planned = gguf_file(inv, v["artifact"]["gguf_type"], sizes())
        assert planned["tensor_types"] == v["artifact"]["tensor_types"], name
        assert planned["bytes"] == pytest.approx(v["memory"]["artifact_bytes"], rel=1e-3), name


def _free(disk: float, memory: float):
    def machine_free(cfg, on_device):
        return {"disk_bytes": disk, "disk_path": "/planned/disk", "memory_bytes": memory, "memory_source": "test",
                "device_bytes": None}
    return machine_free


def test_a_run_that_does_not_fit_is_refused_before_any_work(tiny_cfg, monkeypatch, tmp_path):
    from pipeline.cli import run
    from pipeline.plan import estimate as plan

    cfg = tiny_cfg("variant=original", "runtime.device=cpu")
    monkeypatch.setattr(plan, "machine_free", _free(disk=1e6, memory=64e9))
    with pytest.raises(ConfigError) as exc:
        run(cfg)
    message = str(exc.value)
    assert "disk" in message and "0.00 GB are free" in message and "plan.check=false" in message
    assert "host memory" not in message
    assert not (tmp_path / "artifacts" / "tiny" / "original").exists()      # nothing computed

    monkeypatch.setattr(plan, "machine_free", _free(disk=1e12, memory=1e6))
    with pytest.raises(ConfigError, match=r"host memory: the largest stage \(.*\) needs .* GB, and 0.00 GB are "
                                          r"available"):
        run(cfg)
    assert not (tmp_path / "artifacts" / "tiny" / "original").exists()
    plan.refuse_unless_fits(tiny_cfg("variant=original", "runtime.device=cpu", "plan.check=false"))   # overridden


def test_plan_command_on_the_tiny_model(tiny_cfg, capsys, monkeypatch):
    """The plan of three variants of the tiny model, judged against free disk and memory given to it (not this
    machine's, which other jobs move): ample fits; a disk that cannot hold the artifacts is refused, naming it."""
    from pipeline.cli import run
    from pipeline.plan import estimate as plan

    def free(disk, memory):
        return lambda cfg, on_device: {"disk_bytes": disk, "disk_path": "/injected", "memory_bytes": memory,
                                       "memory_source": "injected", "device_bytes": None}

    monkeypatch.setattr(plan, "machine_free", free(500e9, 16e9))
    cfg = tiny_cfg("command=plan", "run.variants=[original,gguf_q8_0,gguf_q8_0+kv_q8_0]", "runtime.device=cpu",
                   f"paths.results={PROJECT_ROOT / 'results'}")
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "| quantize | gguf_q8_0 |" in out and "| speed | gguf_q8_0+kv_q8_0 |" in out
    assert "smollm2-135m-instruct/" in out              # times scaled from a committed run of the demo model
    assert "fits: yes" in out
    assert not (cfg.model_dir / "original").exists()
    monkeypatch.setattr(plan, "machine_free", free(1e3, 16e9))
    with pytest.raises(ConfigError, match="does not fit this machine.*need 0.12 GB in /injected"):
        run(cfg)
    assert "fits: yes" not in capsys.readouterr().out


def test_plan_settings_are_validated(tiny_cfg):
    with pytest.raises(ConfigError, match="plan.check"):
        tiny_cfg("plan.check=maybe")


def test_a_load_level_scales_with_the_bytes_up_to_its_time_limit_and_the_levels_add_up():
    """The served-load sweep stops a level after load.max_seconds_per_level: a model nine times larger than the
    measured one is not nine times slower once its levels reach that cap, and a sweep with a third of the levels
    (repeats=1 against 3) takes a third of the time."""
    from pipeline.plan.measured_runs import MeasuredRun
    from pipeline.plan.speed_rates import PlannedSweep
    from pipeline.plan.stage_rates import TimeModel

    run = MeasuredRun(label="demo", model="m", run="quick", profile="quick", suites=[], params=100, cpu_key="k",
                      cpu="cpu",
                      bandwidth_bytes_per_s=None, variants={"q8": {"bytes": 100.0, "kind": "ggml"}},
                      walls={("load", "*"): 900.0, ("score", "q8"): 10.0}, load_variants=5, load_cells=9)
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={})
    per_level = 900.0 / 5 / 9
    nine, three = (PlannedSweep(rounds=r, depths=(512,), requests={1: 4, 2: 4, 4: 8}, cap=120.0) for r in (3, 1))
    same, _ = tm.estimate("load", "q8", "ggml", 100.0, load_levels=nine)
    assert same == pytest.approx(per_level * 9)
    third, _ = tm.estimate("load", "q8", "ggml", 100.0, load_levels=three)
    assert third == pytest.approx(per_level * 3)
    big, basis = tm.estimate("load", "q8", "ggml", 900.0, load_levels=three)
    assert big == pytest.approx(3 * 120.0) and "capped" in basis


def test_a_load_sweep_is_its_rounds_fixed_part_and_its_requests_prefill_and_decode():
    """Where the measured run recorded its levels: a round's time outside its levels is paid once per planned
    round (plus the larger model's longer load), each level's requests at the measured seconds per request, the
    time to first token carried by the prefill ratio and the depth, the rest by the decode ratio."""
    from pipeline.plan.measured_runs import _read_load_levels
    from pipeline.plan.speed_rates import PlannedSweep
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("load", "*"): 100.0, ("score", "q8"): 50.0})
    lc = {"trials_wall_s": 2 * 20.0 + 16.0 + 24.0, "variants": {"q8": {"status": "ok", "rounds": 2, "depths": {
        "512": {"levels": {"1": {"completed": 8, "requests_per_s": 0.5, "ttft_p50_s": 1.5, "e2e_p50_s": 2.0},
                           "2": {"completed": 8, "requests_per_s": 1 / 3, "ttft_p50_s": 1.0, "e2e_p50_s": 4.0}}}}}}}
    _read_load_levels(run, lc)
    assert run.load_fixed_s == pytest.approx(20.0)
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, plan_params=run.params)
    sweep = PlannedSweep(rounds=2, depths=(512,), requests={1: 4, 2: 4}, cap=1000.0)
    same, basis = tm.estimate("load", "q8", "ggml", 100e6, params=run.params, load_levels=sweep)
    assert same == pytest.approx(lc["trials_wall_s"]) and "by component" in basis     # the measured sweep again
    # nine times the parameters and bytes: prefill x9; a decoded token 10 ms fixed + 90 ms read (x5); load +0.08 s
    big, _ = tm.estimate("load", "q8", "ggml", 900e6, params=9 * run.params, load_levels=sweep)
    levels = 16.0 * (0.75 * 9 + 0.25 * 5) + 24.0 * (0.25 * 9 + 0.75 * 5)
    assert big == pytest.approx(levels + 2 * (20.0 + 0.08))
    deeper = PlannedSweep(rounds=1, depths=(1024,), requests={1: 4}, cap=1000.0)
    d, _ = tm.estimate("load", "q8", "ggml", 100e6, params=run.params, load_levels=deeper)
    assert d == pytest.approx(4 * 2.0 * (0.75 * 2 + 0.25) + 20.0)


def test_plan_compare_counts_what_the_prepare_stage_wrote(tmp_path):
    """A folder source is used in place: the prepare stage writes its facts only, and the comparison measures
    those (its manifest's files), not the model folder's size."""
    from types import SimpleNamespace

    from pipeline.plan.compare import _prepared_bytes

    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "manifest.json").write_text(json.dumps({"files": {"facts.json": 4681}}))
    summary = {"variants": {"original": {"memory": {"artifact_bytes": 4.9e9}}}}
    cfg = SimpleNamespace(model_dir=tmp_path, model=SimpleNamespace(source=str(tmp_path)))
    assert _prepared_bytes(cfg, summary) == 4681
    (tmp_path / "original" / "manifest.json").unlink()
    assert _prepared_bytes(cfg, summary) is None            # a folder, the stage not on disk: unknown
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cfg.model.source = str(gguf)                            # converted: the prepared original's size
    assert _prepared_bytes(cfg, summary) == 4.9e9


def test_the_plan_counts_every_process_a_stage_holds(tiny_cfg):
    """What a stage holds beside its runtime, as the 1.24 B run's stage manifests measured it: the pipeline's own
    process under every in-process stage (a reused reference too), none under a speed probe, the load generator
    and the driving process beside a server, and the original's exact rows in the first scoring stage with full
    logits only."""
    from pipeline.plan.stage_plan import LOADGEN_B, PIPELINE_PROCESS_B
    from pipeline.plan.estimate import build_plan

    cfg = tiny_cfg("run.variants=[original,gguf_q8_0,gguf_q4_k_m]", "runtime.device=cpu")
    rows = {(r.stage, r.variant): r for r in build_plan(cfg, with_times=False)["rows"]}
    assert rows[("evaluate", "original")].host_bytes == PIPELINE_PROCESS_B        # reuses the reference
    assert "pipeline_process" not in rows[("speed", "gguf_q8_0")].parts
    assert rows[("evaluate", "gguf_q8_0")].host_bytes - rows[("speed", "gguf_q8_0")].host_bytes >= PIPELINE_PROCESS_B * 0.9
    load = rows[("load", "gguf_q8_0")]
    assert load.parts["load_generator"] == LOADGEN_B and load.parts["pipeline_process"] == PIPELINE_PROCESS_B
    # the first scoring stage with full logits holds the larger of its variant and the original's exact build
    from pipeline.compose import variant_of
    from pipeline.runtimes.model_inventory import model_inventory
    from pipeline.plan.stage_plan import EXACT_SAMPLE_TOKENS, StagePlanner, Workload

    from transformers import LlamaConfig

    big = inventory(LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True))
    sp = StagePlanner(cfg, big, Workload.of(cfg), False)         # Llama-3.2-1B's shapes
    original, q8 = variant_of(cfg, "original"), variant_of(cfg, "gguf_q8_0")
    ctx = min(Workload.of(cfg).context_tokens or 256, int(sp.facts.get("context_length") or 1 << 30))
    exact = sp.loaded(original, ctx, logits_rows=sp.scored_rows(original, EXACT_SAMPLE_TOKENS), copies=3)[0]
    alone, building = sp.score(q8), sp.score(q8, original)
    assert exact > alone.host_bytes
    assert building.host_bytes == exact
    small = StagePlanner(cfg, model_inventory(cfg), Workload.of(cfg), False)      # the plan's own, on the tiny model
    first = small.score(q8, original, exactness=True)                       # the first builds them
    assert rows[("score", "gguf_q8_0")].host_bytes == first.host_bytes
    assert rows[("score", "gguf_q4_k_m")].host_bytes == small.score(variant_of(cfg, "gguf_q4_k_m"),
                                                                     exactness=True).host_bytes


def test_a_scoring_stage_holds_the_original_rows_it_maps_which_grow_with_the_vocabulary(tiny_cfg):
    """Beside its runtime a scoring stage maps the original's full rows: a conversation's exact rows (float32, at
    the share of positions that have one; the worker maps one conversation at a time) and, where it checks the
    stored KLD against the exact one, each suite's sample of 256 float64 rows. At a 262,144-token vocabulary
    (measured on Gemma 3's geometry: 537 MB each at 512-token replies) they are what vocabulary-free constants
    missed."""
    from pipeline.compose import variant_of
    from pipeline.plan.stage_plan import EXACT_ROW_SHARE, StagePlanner, Workload
    from pipeline.suites.records import load_suite, select

    from transformers import LlamaConfig

    cfg = tiny_cfg("run.variants=[original,gguf_q8_0]", "runtime.device=cpu")
    work = Workload.of(cfg)
    longest = {}
    for suite in cfg.selected_suites():          # the longest reply of a conversation, from the suites' own data
        convs = select(load_suite(suite.name, suite.path), *cfg.profile.limits(suite.name))
        longest[suite.name] = max(sum(t.max_new_tokens or 0 for t in c.turns) for c in convs)
    assert {s: w["longest_reply"] for s, w in work.per_suite.items()} == longest

    def planner(vocab):
        return StagePlanner(cfg, inventory(LlamaConfig(vocab_size=vocab, hidden_size=640, intermediate_size=2048,
                                                       num_hidden_layers=4, num_attention_heads=4,
                                                       num_key_value_heads=1, head_dim=256,
                                                       tie_word_embeddings=True)), work, False)

    q8 = variant_of(cfg, "gguf_q8_0")
    for vocab in (49_152, 262_144):
        sp = planner(vocab)
        checked, unchecked = sp.score(q8, exactness=True), sp.score(q8)
        sample = sum(min(256, n) for n in longest.values()) * vocab * 8
        assert checked.parts["exact_sample_mapped"] == sample
        assert checked.host_bytes - unchecked.host_bytes == sample
        assert unchecked.parts["exact_rows_mapped"] == int(EXACT_ROW_SHARE * max(longest.values()) * 4 * vocab)
        assert "exact_sample_mapped" not in unchecked.parts
    # the part a vocabulary-free constant cannot hold: ×5.3 the vocabulary, the mapped rows ×5.3 as well
    small, large = planner(49_152).score(q8, exactness=True), planner(262_144).score(q8, exactness=True)
    grown = {k: large.parts[k] / small.parts[k] for k in ("exact_rows_mapped", "exact_sample_mapped")}
    assert all(abs(g - 262_144 / 49_152) < 1e-3 for g in grown.values()), grown


def _component_run(**over):
    from pipeline.plan.measured_runs import MeasuredRun

    work = {"s": {"conversations": 2, "reply_tokens": 1000, "prompt_tokens": 3000, "prefill_tokens": 2000,
                  "context_tokens": 1024}}
    run = MeasuredRun(label="demo/quick", model="m", run="quick", profile="quick", suites=["s"], params=100_000_000,
                      cpu_key="k", cpu="cpu", bandwidth_bytes_per_s=10e9,
                      variants={"q8": {"bytes": 100e6, "kind": "ggml", "generates": "ggml"}},
                      walls={("evaluate", "q8"): 60.0, ("score", "q8"): 50.0}, work=work,
                      reply_budget={"s": 1000}, scored_tokens=500, vocab=50_000,
                      rates={"q8": {"prefill": 1000.0, "decode": 50.0, "load_s": 1.0}})
    for k, v in over.items():
        setattr(run, k, v)
    return run


def test_a_decoded_token_costs_its_fixed_part_plus_one_read_of_the_weights():
    """20 ms per token measured at 100 MB over 10 GB/s (10 ms of reading): 10 ms are fixed, so a model nine times
    the bytes decodes at 10 + 90 ms a token, not nine times 20; prefill grows with the parameters; loading adds one
    pass over the added bytes."""
    from pipeline.plan.stage_rates import TimeModel

    tm = TimeModel(run=_component_run(), factor=1.0, basis="", plan_budget={})
    r = tm._rates("q8", 900e6, 900_000_000)
    assert r["decode"] == pytest.approx(0.010 + 0.090)
    assert r["prefill"] == pytest.approx(9 / 1000.0)
    assert r["load"] == pytest.approx(1.0 + 800e6 / 10e9)
    bare = TimeModel(run=_component_run(bandwidth_bytes_per_s=None), factor=1.0, basis="", plan_budget={})
    assert bare._rates("q8", 900e6, 900_000_000)["decode"] == pytest.approx(0.020 * 9)   # no bandwidth: bytes


def test_stage_times_carry_by_their_components():
    """The same model and work plans the measured wall; free-running grows with the reply tokens' decode and the
    prompts' prefill; scoring's vocabulary work is what its wall leaves after reading the tokens, and grows with
    the vocabulary."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run()
    same = TimeModel(run=run, factor=1.0, basis="", plan_budget={"s": 1000}, plan_work=run.work,
                     plan_params=run.params, plan_vocab=run.vocab)
    assert same.estimate("evaluate", "q8", "ggml", 100e6)[0] == pytest.approx(60.0)
    assert same.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(50.0)
    assert "by component" in same.estimate("score", "q8", "ggml", 100e6)[1]
    big_vocab = TimeModel(run=run, factor=2.0, basis="", plan_budget={"s": 1000}, plan_work=run.work,
                          plan_params=run.params, plan_vocab=4 * run.vocab)
    # scoring: load 1 + (2000 + 500 replies) / 1000 = 3.5 s of tokens; 46.5 s over 500 rows x 50k entries
    per_row = 46.5 / (500 * 50_000)
    assert big_vocab.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(2 * (3.5 + 500 * 200_000 * per_row))
    doubled = {"s": {**run.work["s"], "reply_tokens": 2000}}
    longer = TimeModel(run=run, factor=1.0, basis="", plan_budget={"s": 2000}, plan_work=doubled,
                       plan_params=run.params, plan_vocab=run.vocab)
    # free-running at the measured rates: 1 + 2000 / 1000 + 500 / 50 = 13 s of components for 60 s measured; of the
    # 47 s left, 10 ms per reply token (half the measured 20) is free-running's own, the rest carried in proportion
    assert longer.estimate("evaluate", "q8", "ggml", 100e6)[0] == pytest.approx(
        60.0 * (1 + 2 + 1000 / 50 + 1000 * 0.010) / (13 + 500 * 0.010))


def test_the_plan_takes_times_from_the_most_complete_run_and_not_a_prepare_of_another_source():
    from pipeline.plan.measured_runs import choose_run
    from pipeline.plan.stage_rates import TimeModel

    full = _component_run(cpu_key="other", label="demo/quick",
                          rates={n: {"prefill": 1.0, "decode": 1.0, "load_s": 0} for n in "abcd"})
    few = _component_run(label="demo/benchmarks")
    assert choose_run([few, full], "another-model", "k") is full
    assert choose_run([few, full], "m", "k") is full
    mine = _component_run(model="another-model", label="another-model/smoke")
    assert choose_run([few, full, mine], "another-model", "k") is mine
    # two complete runs on this CPU: the one whose speed figures rest on more rounds, whatever else it ran
    rates = {n: {"prefill": 1.0, "decode": 1.0, "load_s": 0} for n in "abcd"}
    quick = _component_run(label="demo/quick", rates=rates, speed_protocol={"rounds": 10})
    short = _component_run(label="demo/benchmarks", rates=rates, speed_protocol={"rounds": 3},
                           walls={**quick.walls, ("bench:mc", "a"): 5.0})
    assert choose_run([short, quick], "m", "k") is quick
    run = _component_run(source_kind="dequantized", walls={("prepare", "-"): 30.0})
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={})
    assert tm.estimate("prepare", "-", "original", 1e9, params=10 * run.params, source="used in place")[0] is None
    assert tm.estimate("prepare", "-", "original", 1e9, params=10 * run.params, source="dequantized")[0] == pytest.approx(300)


def test_a_one_off_stage_is_a_fixed_part_plus_a_part_that_grows_with_the_parameters():
    """A conversion measured at 10 s on a 100 M model and 6 s on a 10 M one (same CPU): 5.6 s fixed + 4.4 s per
    100 M, so 1 B plans 49.6 s, not the 100 s that scaling the larger run by the parameters alone gives; a run on
    another CPU, or of a size under twice apart, is no second size."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("convert_f16", "-"): 10.0, ("quantize", "q8"): 4.0})
    small = _component_run(label="tiny/smoke", params=10_000_000,
                           walls={("convert_f16", "-"): 6.0, ("quantize", "q8"): 3.0})
    alone = TimeModel(run=run, factor=1.0, basis="", plan_budget={})
    assert alone.estimate("convert_f16", "-", "ggml", 1e9, params=1_000_000_000)[0] == pytest.approx(100.0)
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, others=[run, small])
    t, basis = tm.estimate("convert_f16", "-", "ggml", 1e9, params=1_000_000_000)
    slope = 4.0 / 90e6
    assert t == pytest.approx(10.0 - slope * 100e6 + slope * 1e9) and "fixed" in basis and "tiny/smoke" in basis
    assert tm.estimate("quantize", "q8", "ggml", 1e9, params=1_000_000_000)[0] == pytest.approx(
        4.0 - 1 / 90e6 * 100e6 + 1 / 90e6 * 1e9)
    elsewhere = _component_run(label="tiny/smoke", params=10_000_000, cpu_key="other",
                               walls={("convert_f16", "-"): 6.0})
    near = _component_run(label="near/smoke", params=60_000_000, walls={("convert_f16", "-"): 6.0})
    for other in (elsewhere, near):
        tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, others=[other])
        assert tm.estimate("convert_f16", "-", "ggml", 1e9, params=1_000_000_000)[0] == pytest.approx(100.0)


def test_the_original_s_exact_rows_are_planned_in_the_scoring_that_builds_them():
    """The first variant compared with the original's exact rows builds them (the original loaded on its runtime,
    its longest transcript read): that cost leaves the measured builder's wall before its work per row is fitted,
    and is added to the planned builder's scoring only."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run()
    run.variants["original"] = {"bytes": 200e6, "kind": "original", "generates": "original"}
    run.rates["original"] = {"prefill": 500.0, "decode": 20.0, "load_s": 3.0}
    run.exact_builder = "q8"
    exact = 3.0 + 1024 / 500.0                 # the original's load and its longest transcript (context_tokens)
    same = TimeModel(run=run, factor=1.0, basis="", plan_budget={"s": 1000}, plan_work=run.work,
                     plan_params=run.params, plan_vocab=run.vocab, plan_original_bytes=200e6)
    built, basis = same.estimate("score", "q8", "ggml", 100e6, builds_exact=True)
    assert built == pytest.approx(50.0) and "exact rows" in basis
    # scoring: load 1 + (2000 + 500) / 1000 s of tokens + the exact rows; the rest over 500 rows x 50k entries
    per_row = (50.0 - 3.5 - exact) / (500 * 50_000)
    assert same.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(50.0 - exact)
    big_vocab = TimeModel(run=run, factor=1.0, basis="", plan_budget={"s": 1000}, plan_work=run.work,
                          plan_params=run.params, plan_vocab=2 * run.vocab, plan_original_bytes=200e6)
    assert big_vocab.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(3.5 + 500 * 100_000 * per_row)


def test_the_speed_stage_is_each_label_s_start_load_and_probes():
    """Each probe label costs its worker's start (what the measured wall leaves after its labels' loads and
    generations, shared evenly) plus its load and protocol at the planned size; the A/A control counts twice."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("speed", "*"): 100.0, ("score", "q8"): 50.0}, speed_round=["q8", "q8#A/A"],
                         speed_protocol={"rounds": 10, "warmup": 1, "repeats": 1, "prompt_tokens": 100,
                                         "decode_tokens": 50})
    label = 1.0 + 11 * (100 / 1000.0 + 50 / 50.0)        # load + 11 generations at the measured rates
    start = (100.0 - 2 * label) / 2
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, plan_params=run.params,
                   plan_speed={"rounds": 2, "warmup": 1, "repeats": 1, "prompt_tokens": 100, "decode_tokens": 50})
    one, basis = tm.estimate("speed", "q8", "ggml", 100e6)
    assert one == pytest.approx(start + 1.0 + 3 * 1.1) and "start" in basis
    assert tm.estimate("speed", "q8", "ggml", 100e6, labels=2)[0] == pytest.approx(2 * one)


def test_runs_of_other_vocabularies_or_cpus_are_no_second_size():
    """The fixed part of a conversion includes reading the tokenizer: a run with another vocabulary size does not
    pair; nor does one whose stage ran on another CPU (its manifest's, not the run's)."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("convert_f16", "-"): 10.0})
    other_vocab = _component_run(label="tiny/smoke", params=10_000_000, vocab=128_000,
                                 walls={("convert_f16", "-"): 6.0})
    built_elsewhere = _component_run(label="tiny/smoke", params=10_000_000, walls={("convert_f16", "-"): 6.0},
                                     wall_cpus={("convert_f16", "-"): "other"})
    for other in (other_vocab, built_elsewhere):
        tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, others=[other])
        assert tm.estimate("convert_f16", "-", "ggml", 1e9, params=1_000_000_000)[0] == pytest.approx(100.0)
    same = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, others=[
        _component_run(label="tiny/smoke", params=10_000_000, walls={("convert_f16", "-"): 6.0})])
    assert same.estimate("convert_f16", "-", "ggml", 1e9, params=1_000_000_000)[0] < 100.0


def test_a_stage_built_inside_another_is_not_counted_twice():
    """The first GGUF quantization builds the F16 conversion inside it: its own seconds are its wall less the
    conversion's; a stage inside one that is itself inside is taken off once; stages side by side keep theirs."""
    from pipeline.infra.stage_folders import own_seconds

    spans = {"quantize": (0.0, 53.0), "convert": (1.0, 42.0), "tokenizer": (2.0, 5.0), "parity": (53.5, 100.0)}
    own = own_seconds(spans)
    assert own == pytest.approx({"quantize": 12.0, "convert": 38.0, "tokenizer": 3.0, "parity": 46.5})


def test_parity_and_the_conversion_carry_by_their_components():
    """Parity: both runtimes' loads and the parity tokens read by each at the planned size, the rest grown with the
    vocabulary; the conversion: a Python worker's start (the speed stage's) and the rest grown with the
    parameters."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("parity", "-"): 20.0, ("convert_f16", "-"): 12.0, ("speed", "*"): 100.0,
                                ("score", "q8"): 50.0},
                         speed_round=["q8", "q8#A/A"], parity_tokens=500,
                         speed_protocol={"rounds": 10, "warmup": 1, "repeats": 1, "prompt_tokens": 100,
                                         "decode_tokens": 50})
    run.variants["gguf_f16"] = {"bytes": 200e6, "kind": "ggml"}
    run.variants["original"] = {"bytes": 400e6, "kind": "original"}
    run.rates["gguf_f16"] = {"prefill": 1000.0, "decode": 40.0, "load_s": 1.0}
    run.rates["original"] = {"prefill": 500.0, "decode": 20.0, "load_s": 3.0}
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, plan_params=run.params, plan_vocab=2 * run.vocab,
                   plan_original_bytes=400e6, plan_parity_tokens=500)
    measured = 1.0 + 3.0 + 500 / 1000 + 500 / 500          # loads + tokens: 5.5 s, the rest 14.5 s
    t, basis = tm.estimate("parity", "-", "original", 400e6, params=run.params, f16_bytes=200e6)
    assert t == pytest.approx(measured + 14.5 * 2) and "by component" in basis
    start = (100.0 - 2 * (1.0 + 11 * (100 / 1000 + 50 / 50))) / 2     # the speed stage's worker start: 38.9 s
    small = _component_run(walls={("convert_f16", "-"): 60.0, ("speed", "*"): 100.0, ("score", "q8"): 50.0},
                           speed_round=["q8", "q8#A/A"], speed_protocol=run.speed_protocol)
    tm = TimeModel(run=small, factor=1.0, basis="", plan_budget={})
    t, basis = tm.estimate("convert_f16", "-", "ggml", 1e9, params=10 * small.params)
    assert t == pytest.approx(start + (60.0 - start) * 10) and "worker's start" in basis



def test_a_run_is_rescaled_by_its_recorded_bandwidth_on_its_own_cpu_too():
    """Machines with one CPU key read different bandwidths (29.7 and 45.3 GB/s two days apart here) and their stage
    times move with it: a run on this CPU is rescaled like one from another; without a recorded bandwidth it is
    used as it is."""
    from pipeline.plan.measured_runs import calibration_factor

    run = _component_run(bandwidth_bytes_per_s=30e9)
    factor, basis = calibration_factor(run, "k", 2, measure=lambda: 45e9)
    assert factor == pytest.approx(30 / 45) and "same CPU key k" in basis and "measured now" in basis
    assert calibration_factor(run, "k", 2, recorded_here=60e9)[0] == pytest.approx(0.5)
    assert calibration_factor(run, "other", 2, measure=lambda: 15e9)[0] == pytest.approx(2.0)
    bare = _component_run(bandwidth_bytes_per_s=None)
    assert calibration_factor(bare, "k", 2, measure=lambda: 1 / 0) == \
        (1.0, "measured here (demo/quick, same CPU key k)")
    # a model-level stage built in another run carries that run's reading, not the summary's
    from pipeline.plan.stage_rates import TimeModel

    tm = TimeModel(run=_component_run(bandwidth_bytes_per_s=30e9, wall_bandwidths={("quantize", "q8"): 45e9}),
                   factor=30 / 45, basis="", plan_budget={})
    assert tm._factor_of("quantize", "q8") == pytest.approx(1.0)
    assert tm._factor_of("convert_f16", "-") == pytest.approx(30 / 45)


def test_prompt_work_is_rescaled_by_compute_and_decoding_by_bandwidth():
    """Prefill is compute-bound: on one CPU key llama-bench read 1.28x the prefill and 1.46x the decode of a run two
    days before, whose bandwidth had read 1.53x less. A run with a compute reading has its prompt work rescaled by
    it and the rest by bandwidth; without one (or a compared run without one) all by bandwidth."""
    from pipeline.instruments.bandwidth import measure_compute
    from pipeline.plan.measured_runs import compute_factor
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(compute_flops_per_s=100e9)
    factor, basis = compute_factor(run, measure=lambda: 125e9)
    assert factor == pytest.approx(0.8) and "100 GFLOP/s" in basis and "125 GFLOP/s" in basis
    assert compute_factor(run, recorded_here=50e9)[0] == pytest.approx(2.0)
    assert compute_factor(run) == (None, "")                       # a compared run that took no reading
    assert compute_factor(_component_run(), measure=lambda: 1 / 0) == (None, "")     # nothing to rescale
    kw = dict(basis="", plan_budget={"s": 1000}, plan_work=run.work, plan_params=run.params, plan_vocab=run.vocab)
    split = TimeModel(run=run, factor=2.0, compute_factor=1.0, **kw)
    alike = TimeModel(run=run, factor=2.0, **kw)
    # scoring: load 1 s + 2.5 s of prompt and reply tokens read + 46.5 s of vocabulary work
    assert split.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(2 * (1 + 46.5) + 1 * 2.5)
    assert alike.estimate("score", "q8", "ggml", 100e6)[0] == pytest.approx(2 * 50.0)
    # free-running: load 1 s + 2 s of prompts + 10 s of decoding + 5 s of its own per reply token (bounded) make
    # the 60 s wall's components
    assert split.estimate("evaluate", "q8", "ggml", 100e6)[0] == pytest.approx(60.0 * (2 * 16 + 1 * 2) / 18)
    r = measure_compute(1, repeats=2, rows=64, width=256)       # the reading itself: a real matrix product
    assert r["flops_per_s"] > 1e8 and r["threads"] == 1 and "64 x 256" in r["method"]


def test_a_scoring_that_checks_its_exactness_reads_the_longest_transcript_again():
    """score.kld_exactness has the variant's runtime read each suite's longest transcript once more: a component of
    its own that grows with that transcript, not with the scored rows (7 of a 1.24 B Q8_0 scoring's 21 s)."""
    from pipeline.plan.stage_rates import TimeModel

    checked, unchecked = _component_run(exactness={"q8"}), _component_run()
    longer = {"s": {**checked.work["s"], "context_tokens": 3048}}       # 2,024 tokens more at 1 ms each
    for run, extra in ((checked, 2.024), (unchecked, 0.0)):
        kw = dict(basis="", plan_budget={"s": 1000}, plan_params=run.params, plan_vocab=run.vocab)
        assert TimeModel(run=run, factor=1.0, plan_work=run.work, **kw).estimate(
            "score", "q8", "ggml", 100e6)[0] == pytest.approx(50.0)
        assert TimeModel(run=run, factor=1.0, plan_work=longer, **kw).estimate(
            "score", "q8", "ggml", 100e6)[0] == pytest.approx(50.0 + extra)


def test_the_conversion_carries_by_its_recorded_phases():
    """The converter's start and exit (and what the stage adds around it) as they are, its vocabulary work with
    the vocabulary, its tensors with the parameters."""
    from pipeline.plan.stage_rates import TimeModel
    from pipeline.quantizers.gguf_convert import PHASE_MARK, conversion_phases

    text = f"INFO:x\n{PHASE_MARK} start 102.5\nINFO:y\n{PHASE_MARK} vocabulary 103.5\n{PHASE_MARK} tensors 104.0\n"
    phases = conversion_phases(text, started=100.0, ended=105.0)
    assert phases == {"start": 2.5, "vocabulary": 1.0, "tensors": 0.5, "exit": 1.0}
    assert conversion_phases("INFO: no marks\n", 100.0, 105.0) is None
    run = _component_run(walls={("convert_f16", "-"): 5.5}, convert_phases=phases)
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, plan_vocab=2 * run.vocab)
    t, basis = tm.estimate("convert_f16", "-", "ggml", 1e9, params=10 * run.params)
    assert t == pytest.approx(4.0 + 1.0 * 2 + 0.5 * 10) and "by phase" in basis


def test_a_gguf_quantization_carries_by_the_weights_of_each_type():
    """llama-quantize's time: each weight at its type's cost per weight here, over the threads, plus the F16 file
    read and the output written at the seconds per byte the measured stage left after its own quantizing."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("quantize", "q8"): 3.0},
                         quant_elements={"q8": {"F32": 1000, "Q8_0": 100_000_000}})
    run.variants["gguf_f16"] = {"bytes": 200e6, "kind": "ggml"}
    rates = {"F32": 0.0, "Q8_0": 4e-9, "Q4_K": 80e-9, "Q6_K": 30e-9}
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={}, threads=2, quant_rates=lambda types: rates)
    per_byte = (3.0 - 100e6 * 4e-9 / 2) / (200e6 + 100e6)        # 2.6 s over 300 MB read and written
    planned = {"F32": 2000, "Q4_K": 800_000_000, "Q6_K": 200_000_000}
    t, basis = tm.estimate("quantize", "q8", "ggml", 600e6, params=10 * run.params, type_elements=planned,
                           f16_bytes=2e9)
    assert t == pytest.approx((800e6 * 80e-9 + 200e6 * 30e-9) / 2 + (2e9 + 600e6) * per_byte) and "by type" in basis
    # without the measured file's types (its artifacts gone) or the calibration: by the parameters
    for tm in (TimeModel(run=_component_run(walls={("quantize", "q8"): 3.0}), factor=1.0, basis="",
                         plan_budget={}, threads=2, quant_rates=lambda types: rates),
               TimeModel(run=run, factor=1.0, basis="", plan_budget={}, threads=2, quant_rates=lambda types: None)):
        t, basis = tm.estimate("quantize", "q8", "ggml", 600e6, params=10 * run.params, type_elements=planned,
                               f16_bytes=2e9)
        assert t == pytest.approx(30.0) and "params" in basis


def test_quantization_costs_per_weight_are_measured_from_llama_cpp_s_own_ggml():
    """ggml_quantize_chunk timed here: a K-quant searches each super-block's scales, several times the cost of
    rounding Q8_0's blocks; unquantized types cost nothing; an unknown type gives no calibration."""
    from pipeline.plan.quant_rates import seconds_per_weight

    rates = seconds_per_weight(("F16", "F32", "Q4_K", "Q8_0"))
    assert rates is not None and rates["F16"] == rates["F32"] == 0.0
    assert 0 < rates["Q8_0"] < 1e-6 and rates["Q4_K"] > rates["Q8_0"]
    assert seconds_per_weight(("NOT_A_TYPE",)) is None


def test_a_gguf_file_s_prompt_work_carries_by_its_ggml_types():
    """llama.cpp repacks some types for its CPU matrix products, so a planned file mostly in types that read
    prompts at half the cost per weight of the measured file's plans its prompt tokens at half the time per
    parameter; F32 norm vectors have no matrix product; without either file's types or the measurement, the
    parameters alone."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(quant_elements={"q8": {"F32": 1000, "Q5_0": 80_000_000, "Q8_0": 20_000_000}})
    rates = {"Q5_0": 8e-12, "Q8_0": 6e-12, "Q4_K": 4e-12, "Q6_K": 3e-12}
    asked = []
    kw = dict(factor=1.0, basis="", plan_budget={"s": 1000}, plan_work=run.work, plan_params=run.params,
              plan_vocab=run.vocab)
    tm = TimeModel(run=run, prompt_rates=lambda types: asked.append(types) or rates, **kw)
    planned = {"F32": 5000, "Q4_K": 700_000_000, "Q6_K": 300_000_000}
    factor = (0.7 * 4 + 0.3 * 3) / (0.8 * 8 + 0.2 * 6)
    assert tm._rates("q8", 600e6, 10 * run.params, planned=True, types=planned)["prefill"] == pytest.approx(
        10 / 1000.0 * factor)
    assert asked[-1] == ("Q4_K", "Q5_0", "Q6_K", "Q8_0")
    # scoring: load 1 s + 2.5 s of prompt and reply tokens read (carried) + 46.5 s of vocabulary work
    t, basis = tm.estimate("score", "q8", "ggml", 100e6, type_elements=planned)
    assert t == pytest.approx(1 + 2.5 * factor + 46.5) and f"prompt work x{factor:.2g} by ggml type" in basis
    for other in (TimeModel(run=_component_run(), prompt_rates=lambda types: rates, **kw),
                  TimeModel(run=run, prompt_rates=lambda types: None, **kw), TimeModel(run=run, **kw)):
        assert other._rates("q8", 600e6, 10 * run.params, planned=True, types=planned)["prefill"] == pytest.approx(
            10 / 1000.0)
        assert other.estimate("score", "q8", "ggml", 100e6, type_elements=planned)[0] == pytest.approx(50.0)


def test_free_running_s_own_cost_per_reply_token_carries_at_any_size():
    """A free-running wall 5 s under its components (load 1 + prompts 2 + 500 replies at the probe's 20 ms = 13 s:
    its loop decodes 10 ms a token faster than the speed probe measured) keeps that difference per reply token
    at ten times the replies, rather than scaling every component by 8/13."""
    from pipeline.plan.stage_rates import TimeModel

    run = _component_run(walls={("evaluate", "q8"): 8.0})
    longer = {"s": {**run.work["s"], "reply_tokens": 10_000}}
    tm = TimeModel(run=run, factor=1.0, basis="", plan_budget={"s": 10_000}, plan_work=longer,
                   plan_params=run.params, plan_vocab=run.vocab)
    assert tm.estimate("evaluate", "q8", "ggml", 100e6)[0] == pytest.approx(1 + 2 + 5000 * (0.020 - 0.010))


def test_a_measured_run_s_work_is_counted_with_the_settings_it_recorded(tiny_cfg):
    """A run made with a reply cap on the command line records its workload settings; the plan counts its token
    work with them, not with its profile file's."""
    from pipeline.plan.plan_times import measured_work

    cfg = tiny_cfg()
    run = _component_run(profile="smoke", suites=["smoke"])
    as_file = measured_work(cfg, run)
    run.workload = {"max_conversations": 1, "max_new_tokens_cap": 4, "per_suite": {}}
    capped = measured_work(cfg, run)
    assert capped["smoke"]["conversations"] == 1 < as_file["smoke"]["conversations"]
    assert capped["smoke"]["reply_tokens"] < as_file["smoke"]["reply_tokens"]


def test_a_run_s_gguf_types_and_workload_are_read_from_its_summary(tmp_path):
    """A finished run's summary carries each GGUF file's weights per ggml type and its workload settings, so a plan
    from it on a clone without its artifacts still carries prompt work by type and counts the work it did; a KV
    variant shares its base's file."""
    from pipeline.plan.measured_runs import read_run

    elements = {"F32": 100, "Q5_0": 1000, "Q8_0": 200}
    ok = {"status": "ok", "runtime": "llamacpp", "memory": {"artifact_bytes": 1e6},
          "artifact": {"gguf_type": "Q4_K_M", "type_elements": elements}}
    summary = {"run": {"name": "quick", "profile": "quick", "suites": ["s"],
                       "workload": {"max_conversations": 2, "max_new_tokens_cap": 64, "per_suite": {}}},
               "model": {"name": "m", "params": 1_000_000}, "stage_times": {"variants": {}},
               "variants": {"gguf_q4_k_m": ok, "gguf_q4_k_m+kv_q8_0": ok}}
    path = tmp_path / "m" / "quick" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(summary))
    run = read_run(path, tmp_path / "artifacts")
    assert run.quant_elements == {"gguf_q4_k_m": elements}
    assert run.workload == {"max_conversations": 2, "max_new_tokens_cap": 64, "per_suite": {}}


def test_a_noisy_compute_reading_is_taken_again_and_the_quieter_kept(monkeypatch):
    """As the bandwidth: when other processes took more than a tenth of the machine during the reading, it is
    measured once more and the quieter of the two kept, flagged when still noisy."""
    import pipeline.instruments.probe as probe
    from pipeline.instruments.bandwidth import measure_compute

    def shares(values):
        seq = iter(values)

        class Fake:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.share = next(seq)
        return Fake

    for values, kept, noisy in (([0.5, 0.05], 0.05, False), ([0.5, 0.6], 0.5, True), ([0.02], 0.02, False)):
        monkeypatch.setattr(probe, "OtherCpu", shares(values))
        r = measure_compute(1, repeats=1, rows=16, width=64)
        assert (r["cpu_noise"], r["noisy"]) == (kept, noisy) and r["flops_per_s"] > 0
