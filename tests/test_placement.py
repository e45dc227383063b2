"""Multi-GPU placement (pipeline.runtimes.placement) with fake devices: which devices, how many layers on each, and
the same placement in transformers/accelerate's, llama.cpp's and the plan's terms. No GPU is needed; what only a
machine with several GPUs can show is listed in docs/cluster.md."""

from __future__ import annotations

import bisect

import pytest

from pipeline.config.schema import RuntimeConfig
from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import Inventory, Tensor
from pipeline.runtimes.placement import (CUDA_CONTEXT_B, GB, Block, Device, hf_layers_per_device, model_blocks,
                                         place, usable_bytes)

GIB = 2**30


def chain(layers: int, layer_gb: float, first_gb: float = 1.0, last_gb: float = 1.0) -> list[Block]:
    return ([Block("embedding", int(first_gb * GB))] + [Block(f"layer {i}", int(layer_gb * GB)) for i in range(layers)]
            + [Block("output", int(last_gb * GB))])


def h100s(*free_gb: float) -> list[Device]:
    return [Device(i, int(f * GB), int(80 * GB), "fake H100") for i, f in enumerate(free_gb)]


def test_a_model_that_fits_one_device_stays_on_the_one_with_most_free_memory():
    p = place(chain(32, 0.45), h100s(20, 70, 70), gpus="all")
    assert p.devices == [1] and p.layers == [32] and not p.split
    assert "fits on one device" in p.why


def test_a_70b_model_spreads_over_the_fewest_devices_in_proportion_to_their_free_memory():
    blocks = chain(80, 1.72, first_gb=2.1, last_gb=2.1)          # ~142 GB of bf16 weights, Llama-3-70B's shape
    p = place(blocks, h100s(79, 79, 79, 79), gpus=4)             # 62.7 GB usable each: three are needed
    assert p.devices == [0, 1, 2] and sum(p.layers) == 80 and max(p.layers) - min(p.layers) <= 2
    q8 = place(chain(80, 0.9, 1.1, 1.1), h100s(79, 79, 79, 79), gpus=4)      # ~74 GB at 8 bits: two
    assert q8.devices == [0, 1] and abs(q8.layers[0] - q8.layers[1]) <= 2
    assert all(planned <= usable for planned, usable in zip(p.planned, p.usable))
    assert sum(p.planned) == sum(b.bytes for b in blocks)
    assert p.blocks[0][0] == "embedding" and p.blocks[-1][-1] == "output"     # contiguous, in order
    assert [n for group in p.blocks for n in group] == [b.name for b in blocks]
    # uneven free memory: the device with more gets more layers
    q = place(chain(80, 0.9, 1.1, 1.1), [Device(0, int(80 * GB)), Device(1, int(40 * GB))], gpus=2)
    assert q.layers[0] > q.layers[1] and all(pl <= us for pl, us in zip(q.planned, q.usable))


def test_proportional_share_falls_back_to_filling_in_order_when_a_device_would_overflow():
    # one huge output block: the proportional cut overflows the last device, filling in order holds it
    blocks = chain(4, 1.0, first_gb=0.5, last_gb=9.0)
    caps = [Device(0, int(20 * GB)), Device(1, int(13 * GB))]
    p = place(blocks, caps, gpus=2, headroom=0.0, context_bytes=0)
    assert all(pl <= us for pl, us in zip(p.planned, p.usable))
    assert p.blocks[-1][-1] == "output"


def test_what_does_not_fit_is_refused_naming_the_numbers_and_the_way_out():
    blocks = chain(80, 1.72, first_gb=2.1, last_gb=2.1)
    with pytest.raises(ConfigError, match=r"raise runtime\.gpus \(now 1\)") as one:
        place(blocks, h100s(79, 79), gpus=1)
    assert "141.80 GB" in str(one.value) and "cuda:0 79.00 GB" in str(one.value)
    with pytest.raises(ConfigError, match="more GPUs"):
        place(blocks, h100s(40, 40), gpus="all")
    with pytest.raises(ConfigError, match="none is visible"):
        place(blocks, [], gpus=2)
    with pytest.raises(ConfigError, match="a single block"):
        # no split can cut inside a block: a layer larger than any device never fits
        place(chain(2, 50.0), h100s(40, 40, 40), gpus="all", what="a single block")


def test_headroom_and_the_cuda_context_are_kept_free_on_every_device():
    d = Device(0, int(10 * GB))
    assert usable_bytes(d, 0.2) == int(8 * GB) - CUDA_CONTEXT_B
    blocks = [Block("embedding", 0), Block("layer 0", usable_bytes(d, 0.2)), Block("output", 0)]
    assert place(blocks, [d], gpus=1).devices == [0]
    with pytest.raises(ConfigError):
        place([Block("layer 0", usable_bytes(d, 0.2) + 1)], [d], gpus=1)


def llama_cpp_layer_devices(tensor_split: list[float], n_layer: int) -> list[int]:
    """llama.cpp's rule for a layer split (src/llama-model.cpp, load_tensors, split_mode=layer, every layer
    offloaded): cumulative normalised fractions, layer il (the output layer being il = n_layer) on the device
    upper_bound(splits, il / (n_layer + 1)), in float32 as there."""
    import numpy as np

    f32 = np.float32
    splits, acc = [], f32(0)
    for x in tensor_split:
        acc = f32(acc + f32(x))
        splits.append(acc)
    splits = [f32(c / acc) for c in splits]
    act = n_layer + 1
    return [bisect.bisect_right(splits, f32(f32(il) / f32(act))) for il in range(n_layer + 1)]


def test_tensor_split_gives_llama_cpp_exactly_the_planned_layer_counts():
    for free, layers in (((79, 79), 80), ((100, 60), 80), ((79, 50, 79), 80), ((30, 30, 30, 30), 80),
                         ((45, 45, 45), 61), ((80, 80, 80, 80, 80, 80, 80, 80), 126)):
        devices = h100s(*free)
        # layers sized so that the model needs every device
        layer_gb = 0.9 * sum(usable_bytes(d, 0.2) for d in devices) / GB / (layers + 2)
        p = place([b for b in chain(layers, layer_gb, layer_gb, layer_gb) if b.name != "embedding"], devices,
                  gpus="all")
        assert p.devices == [d.index for d in devices], free
        assert p.split, free
        where = llama_cpp_layer_devices(p.tensor_split(), layers)
        for dev, n in zip(p.devices, p.layers):
            assert where[:layers].count(dev) == n, (free, p.layers, p.tensor_split())
        assert where[layers] == p.devices[-1]          # the output layer with the last decoder layers
        assert p.cli_args()[:4] == ["-sm", "layer", "-mg", str(p.devices[0])]
    single = place(chain(4, 1.0), h100s(10, 30), gpus=2)
    assert single.cli_args() == ["-sm", "none", "-mg", "1"]


def test_max_memory_makes_accelerate_choose_the_planned_split():
    """accelerate's own infer_auto_device_map (what device_map="auto" runs) on a small Llama built on the meta
    device, given Placement.max_memory for two fake devices, puts the layers where the plan does (to within one
    layer) and nothing on the CPU."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = [Tensor(n, tuple(p.shape)) for n, p in model.named_parameters()]
    inv = Inventory(tensors=tensors, facts={"layers": 12})
    weights = sum(t.elements for t in tensors) * 2
    blocks = model_blocks(inv, weights)
    assert sum(b.bytes for b in blocks) == pytest.approx(weights, rel=1e-6)
    per_device = weights * 0.6           # neither device alone holds the model
    devices = [Device(0, int((per_device + CUDA_CONTEXT_B) / 0.8)), Device(1, int((per_device + CUDA_CONTEXT_B) / 0.8))]
    p = place(blocks, devices, gpus=2)
    assert p.split and p.devices == [0, 1]
    chosen = infer_auto_device_map(model, max_memory=p.max_memory(), no_split_module_classes=model._no_split_modules,
                                   dtype=torch.bfloat16)
    assert "cpu" not in set(map(str, chosen.values())) and "disk" not in set(map(str, chosen.values()))
    counts = hf_layers_per_device(chosen, 12)
    assert sum(counts.values()) == 12
    for dev, n in zip(p.devices, p.layers):
        assert abs(counts.get(str(dev), 0) - n) <= 1, (counts, p.layers, p.max_memory())


def test_model_blocks_follow_the_tensors_and_count_a_tied_head_on_the_output_side():
    tensors = [Tensor("model.embed_tokens.weight", (1000, 64)), Tensor("model.norm.weight", (64,))]
    for i in range(3):
        tensors += [Tensor(f"model.layers.{i}.self_attn.q_proj.weight", (64, 64)),
                    Tensor(f"model.layers.{i}.mlp.down_proj.weight", (64, 256)),
                    Tensor(f"model.layers.{i}.input_layernorm.weight", (64,))]
    inv = Inventory(tensors=tensors, facts={"layers": 3})
    elements = sum(t.elements for t in tensors)
    blocks = model_blocks(inv, elements * 2, kv_cache_bytes=300, logits_bytes=5000)
    assert [b.name for b in blocks] == ["embedding", "layer 0", "layer 1", "layer 2", "output"]
    assert blocks[1].bytes == (64 * 64 + 64 * 256 + 64) * 2 + 100
    assert blocks[0].bytes == 1000 * 64 * 2
    assert blocks[-1].bytes == 64 * 2 + 5000 + 1000 * 64 * 2       # final norm, logits, the tied head
    untied = Inventory(tensors=tensors + [Tensor("lm_head.weight", (1000, 64))], facts={"layers": 3})
    assert model_blocks(untied, 1.0 * sum(t.elements for t in untied.tensors))[-1].bytes == 64 + 64000
    # GGUF names (blk.N): the layer count comes from the names when the facts have none
    gguf = Inventory(tensors=[Tensor("token_embd.weight", (100, 8)), Tensor("blk.0.attn_q.weight", (8, 8)),
                              Tensor("blk.1.attn_q.weight", (8, 8)), Tensor("output_norm.weight", (8,)),
                              Tensor("output.weight", (100, 8))], facts={})
    assert [b.name for b in model_blocks(gguf, 1000.0)] == ["embedding", "layer 0", "layer 1", "output"]


def test_the_device_map_transformers_chose_is_summarised_per_device():
    chosen = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
              "model.layers.3.self_attn": 1, "model.layers.3.mlp": 1, "model.norm": 1, "lm_head": 1}
    assert hf_layers_per_device(chosen, 4) == {"0": 2, "1": 2}
    assert hf_layers_per_device({"": "cuda:0"}, 4) == {}


def test_runtime_gpus_is_checked():
    assert RuntimeConfig(gpus="all", device="cuda").gpus == "all"
    for bad in (0, -1, "two", True, 1.5):
        with pytest.raises(ConfigError, match="runtime.gpus"):
            RuntimeConfig(gpus=bad)
    with pytest.raises(ConfigError, match="runtime.device"):
        RuntimeConfig(gpus=2, device="cuda:1")
    with pytest.raises(ConfigError, match="runtime.gpu_headroom"):
        RuntimeConfig(gpu_headroom=1.0)


def test_the_plan_refuses_a_run_its_devices_cannot_hold_and_accepts_one_they_can():
    from pipeline.plan.estimate import fit_problems

    plan = {"totals": {"disk_bytes": 0, "host_bytes": 0, "device_bytes": 150 * GB, "device_stage": "score q8"},
            "device_blocks": chain(80, 0.9, 1.1, 1.1)}
    free = {"disk_bytes": 1e15, "disk_path": "/", "memory_bytes": None, "devices": h100s(79, 79),
            "gpus": 2, "gpu_headroom": 0.2}
    assert fit_problems(plan, free, 0.2) == []
    problems = fit_problems(plan, {**free, "gpus": 1}, 0.2)
    assert len(problems) == 1 and problems[0].startswith("device memory: the largest stage (score q8) needs")


def test_llama_server_is_given_the_device_or_the_placement(tmp_path, monkeypatch):
    from pipeline.servers.llama_server import LlamaServer

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    kw = dict(threads=2, slots=4, ctx_per_slot=512, flash_attn=True, log_path=tmp_path / "log")
    assert "-sm" not in LlamaServer(tmp_path / "llama-server", gguf, **kw).command(1)      # the CPU
    cmd = LlamaServer(tmp_path / "llama-server", gguf, gpu=True, device="cuda:1", **kw).command(1)
    assert cmd[-4:] == ["-sm", "none", "-mg", "1"]

    import pipeline.runtimes.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "gguf_placement",
                        lambda path, gpus, headroom: place(chain(80, 0.9, 1.1, 1.1), h100s(79, 79), gpus, headroom))
    server = LlamaServer(tmp_path / "llama-server", gguf, gpu=True, gpus="all", **kw)
    assert server.command(1)[-6:-2] == ["-sm", "layer", "-mg", "0"] and server.settings["placement"]["layers"]


def test_the_plan_places_the_stage_that_needs_the_most_device_memory():
    from pipeline.figures.footprint import Footprint
    from pipeline.plan.estimate import device_blocks

    tensors = [Tensor("model.embed_tokens.weight", (1000, 64))] + [
        Tensor(f"model.layers.{i}.mlp.down_proj.weight", (64, 256)) for i in range(4)] + [
        Tensor("lm_head.weight", (1000, 64))]
    inv = Inventory(tensors=tensors, facts={"layers": 4})
    rows = [Footprint("speed", "a", device_bytes=10.0, parts={"weights": 100.0}),
            Footprint("score", "a", device_bytes=90.0, parts={"weights": 1000.0, "kv_cache": 400.0, "logits": 50.0}),
            Footprint("score", "b", device_bytes=500.0, exists=True, parts={"weights": 9e9})]
    blocks = device_blocks(inv, rows)           # the largest stage still to run, not one already built
    assert sum(b.bytes for b in blocks) == pytest.approx(1450, abs=len(blocks))
    assert [b.name for b in blocks][1:5] == ["layer 0", "layer 1", "layer 2", "layer 3"]
    assert blocks[1].bytes == pytest.approx(1000 * 64 * 256 / (2 * 64000 + 4 * 64 * 256) + 100, abs=1)
    assert blocks[-1].bytes == pytest.approx(1000 * 64000 / (2 * 64000 + 4 * 64 * 256) + 50, abs=1)
