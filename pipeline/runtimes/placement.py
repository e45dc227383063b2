"""Where a model goes when one job may use several GPUs (``runtime.gpus``).

A model is a chain of blocks run in order: the token embedding, the decoder layers, then the final norm and the
output head (with the logits). A placement cuts that chain into contiguous runs, one per device, so that every
device holds what it is given with ``headroom`` of its free memory kept free (the KV cache beyond the planned
context and the activations live there) and the CUDA context beside it. The fewest devices that hold the model are
used (a model that fits one GPU stays on one: a split adds a device-to-device copy per layer boundary and per
token); over the devices used, the blocks are spread in proportion to each device's usable memory, which is
llama.cpp's own default rule for a layer split (``--tensor-split`` left unset: proportional to free memory).

The runtimes apply a placement in their libraries' own terms: transformers/accelerate through ``device_map="auto"``
with a per-device ``max_memory`` (``Placement.max_memory``; the map it chose is recorded beside the plan),
llama.cpp through ``split_mode=layer`` with a ``tensor_split`` that reproduces the planned layer counts
(``Placement.tensor_split``). Quantization needs no split: GPTQModel and llm-compressor hold the model on the host
and one decoder layer at a time on the device.

Pure arithmetic: no torch here except in ``visible_devices``, so the rules are tested with fake devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import MIB

GB = 1e9
CUDA_CONTEXT_B = 500 * MIB      # the CUDA context and kernels' workspace on each device a model touches


@dataclass(frozen=True)
class Device:
    index: int                  # the CUDA ordinal (torch's and ggml's order: both follow CUDA_VISIBLE_DEVICES)
    free_bytes: int
    total_bytes: int = 0
    name: str = ""


@dataclass(frozen=True)
class Block:
    name: str                   # "embedding", "layer 0" ... "layer N-1", "output"
    bytes: int


@dataclass
class Placement:
    devices: list[int]          # CUDA ordinals used, in the order the blocks run through them
    blocks: list[list[str]]     # the block names each holds (contiguous, in order)
    planned: list[int]          # bytes planned on each: its blocks (without the CUDA context)
    usable: list[int]           # what each may hold: free x (1 - headroom) - the CUDA context
    layers: list[int]           # decoder layers on each
    why: str
    visible: list[Device] = field(default_factory=list)
    largest_block: int = 0      # bytes of the largest block (the embedding or the head on most models)

    @property
    def split(self) -> bool:
        return len(self.devices) > 1

    def max_memory(self, margin: float = 0.02) -> dict:
        """transformers/accelerate's per-device budget for ``device_map="auto"``: each used device its planned bytes
        plus ``margin`` (rounding of the proportional share), the last device its usable memory (accelerate fills
        the devices in order, the last takes what is left), every other device and the host nothing, so that a
        model that does not fit raises instead of being offloaded to the CPU. accelerate's infer_auto_device_map
        keeps the largest single module's size free on the first GPU (a buffer for offloaded layers, which a host
        budget of 0 rules out): the first device's budget carries that much more, so what it is given stays the
        plan."""
        out: dict = {d.index: 0 for d in self.visible}
        for i, (dev, planned, usable) in enumerate(zip(self.devices, self.planned, self.usable)):
            budget = usable if i == len(self.devices) - 1 else min(usable, int(planned * (1 + margin)))
            out[dev] = budget + (self.largest_block if i == 0 and self.split else 0)
        out["cpu"] = 0
        return out

    def tensor_split(self) -> list[float]:
        """llama.cpp's ``tensor_split`` over every visible device (zero for the unused) that gives exactly the
        planned layer counts under its layer split. llama.cpp (src/llama-model.cpp, load_tensors) normalises the
        list into cumulative fractions ``c`` (float32) and puts layer ``il`` on the first device with
        ``il / (n_layer + 1) < c``, the output layer being layer ``n_layer``. Each cut is put half a layer before
        the first layer of the next device, away from float rounding: the first device's share is its layer count
        less one half, the last device's its count plus the output layer plus one half."""
        share = {dev: float(n) for dev, n in zip(self.devices, self.layers)}
        share[self.devices[0]] -= 0.5
        share[self.devices[-1]] += 1.5
        return [share.get(d.index, 0.0) for d in sorted(self.visible, key=lambda d: d.index)]

    def cli_args(self) -> list[str]:
        """The same placement for llama.cpp's own tools (llama-server, llama-bench)."""
        if not self.split:
            return single_device_args(self.devices[0])
        return ["-sm", "layer", "-mg", str(self.devices[0]), "-ts", ",".join(f"{x:g}" for x in self.tensor_split())]

    def hf_row(self, model) -> dict:
        """The summary's record for a transformers model loaded with this placement: the plan and the decoder layers
        per device in the map accelerate chose."""
        chosen = getattr(model, "hf_device_map", None) or {"": f"cuda:{self.devices[0]}"}
        layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        return {**self.row(), "hf_layers_per_device": hf_layers_per_device(chosen, layers)}

    def row(self) -> dict:
        """What the summary records (runtime_info.placement)."""
        return {"devices": self.devices, "layers": self.layers,
                "planned_gb": [round(b / GB, 3) for b in self.planned],
                "usable_gb": [round(b / GB, 3) for b in self.usable], "why": self.why}


def device_index(device: str) -> int:
    """The CUDA ordinal a device setting names: ``cuda:N`` -> N, ``cuda`` (or ``auto``) -> 0."""
    return int(str(device).split(":")[1]) if ":" in str(device) else 0


def single_device_args(index: int) -> list[str]:
    """llama.cpp's tools on CUDA device ``index`` alone (left to itself, llama.cpp splits over every visible GPU)."""
    return ["-sm", "none", "-mg", str(index)]


def usable_bytes(device: Device, headroom: float, context_bytes: int = CUDA_CONTEXT_B) -> int:
    return max(0, int(device.free_bytes * (1 - headroom)) - context_bytes)


def _proportional(blocks: list[Block], caps: list[int]) -> list[int] | None:
    """Cut points (block counts per device) spreading the bytes in proportion to ``caps``; None when a device
    would then hold more than its cap."""
    total, cap_total = sum(b.bytes for b in blocks), sum(caps)
    if cap_total <= 0:
        return None
    counts, d, done, cum_target = [0] * len(caps), 0, 0, total * caps[0] / cap_total
    for b in blocks:
        # a block goes to the device whose share its middle falls in
        while d < len(caps) - 1 and done + b.bytes / 2 > cum_target:
            d += 1
            cum_target += total * caps[d] / cap_total
        counts[d] += 1
        done += b.bytes
    return counts if _fits(blocks, counts, caps) else None


def _greedy(blocks: list[Block], caps: list[int]) -> list[int] | None:
    """Each device filled in order as far as it holds; None when blocks remain."""
    counts, d, used = [0] * len(caps), 0, 0
    for b in blocks:
        while used + b.bytes > caps[d]:
            d, used = d + 1, 0
            if d == len(caps):
                return None
        counts[d] += 1
        used += b.bytes
    return counts


def _fits(blocks: list[Block], counts: list[int], caps: list[int]) -> bool:
    i = 0
    for n, cap in zip(counts, caps):
        if sum(b.bytes for b in blocks[i:i + n]) > cap:
            return False
        i += n
    return True


def place(blocks: list[Block], devices: list[Device], gpus: int | str = 1, headroom: float = 0.2,
          context_bytes: int = CUDA_CONTEXT_B, what: str = "the model") -> Placement:
    """The placement of ``blocks`` on at most ``gpus`` of ``devices`` ("all": every one), fewest devices first;
    among equally many, those with the most free memory. ConfigError naming the numbers when none holds it."""
    if not devices:
        raise ConfigError("runtime.gpus asks for CUDA devices and none is visible (CUDA_VISIBLE_DEVICES, the "
                          "job's GPU allocation): use runtime.device=cpu or run where a GPU is")
    limit = len(devices) if gpus == "all" else int(gpus)
    if limit < 1:
        raise ConfigError(f"runtime.gpus={gpus!r}: expected a positive integer or all")
    candidates = sorted(devices, key=lambda d: (-d.free_bytes, d.index))[:limit]
    total = sum(b.bytes for b in blocks)
    for k in range(1, len(candidates) + 1):
        chosen = sorted(candidates[:k], key=lambda d: d.index)
        caps = [usable_bytes(d, headroom, context_bytes) for d in chosen]
        counts = _proportional(blocks, caps) or _greedy(blocks, caps)
        if counts is None:
            continue
        used = [(d, c, n) for d, c, n in zip(chosen, caps, counts) if n]   # a device given nothing is not used
        names, planned, i = [], [], 0
        for _, _, n in used:
            names.append([b.name for b in blocks[i:i + n]])
            planned.append(sum(b.bytes for b in blocks[i:i + n]))
            i += n
        why = (f"fits on one device ({total / GB:.2f} GB of {caps[0] / GB:.2f} GB usable)" if len(used) == 1 else
               f"{total / GB:.2f} GB spread over {len(used)} devices in proportion to their usable memory "
               f"(no {k - 1} of the {limit} allowed hold it with {headroom:.0%} of each kept free)")
        return Placement(devices=[d.index for d, _, _ in used], blocks=names, planned=planned,
                         usable=[c for _, c, _ in used],
                         layers=[sum(1 for n in group if n.startswith("layer ")) for group in names],
                         why=why, visible=list(devices), largest_block=max(b.bytes for b in blocks))
    usable = sum(usable_bytes(d, headroom, context_bytes) for d in candidates)
    largest = max(blocks, key=lambda b: b.bytes, default=Block("-", 0))
    more = (f"; {len(devices)} devices are visible: raise runtime.gpus (now {gpus})" if len(devices) > limit else
            "; a smaller format or more GPUs (hydra.launcher.gpus_per_node)")
    raise ConfigError(
        f"{what} needs {total / GB:.2f} GB on the device(s) (largest block {largest.name}: "
        f"{largest.bytes / GB:.2f} GB) and the {len(candidates)} device(s) this job may use hold "
        f"{usable / GB:.2f} GB with {headroom:.0%} of each kept free and {context_bytes / MIB:.0f} MiB for the CUDA "
        f"context (free: {', '.join(f'cuda:{d.index} {d.free_bytes / GB:.2f} GB' for d in candidates)}){more}")


def model_blocks(inv, weight_bytes: float, kv_cache_bytes: float = 0.0, logits_bytes: float = 0.0) -> list[Block]:
    """The chain of blocks of a model described by ``inv`` (pipeline.figures.footprint.Inventory) holding
    ``weight_bytes`` of weights (spread over its tensors in proportion to their elements: a quantized format keeps
    the same share per tensor to within its per-type choices), ``kv_cache_bytes`` (one equal share per layer) and
    ``logits_bytes`` (with the output head). Tensors outside the layers go with the embedding, except the final
    norm and the head; a head tied to the embedding is counted on the output side too (the last device reads it)."""
    layers = int(inv.facts.get("layers") or 1 + max((t.layer for t in inv.tensors if t.layer is not None),
                                                      default=-1))
    elements = sum(t.elements for t in inv.tensors) or 1
    scale = weight_bytes / elements
    first, last, per_layer = 0.0, float(logits_bytes), [kv_cache_bytes / max(layers, 1)] * layers
    embedding = 0.0
    for t in inv.tensors:
        b = t.elements * scale
        if t.layer is not None and t.layer < layers:
            per_layer[t.layer] += b
        elif t.role == "output" or (t.role == "norm" and "norm" in t.name):
            last += b
        else:
            first += b
            embedding += b if t.role == "embedding" else 0
    if not inv.has_output:
        last += embedding
    return ([Block("embedding", int(first))] + [Block(f"layer {i}", int(b)) for i, b in enumerate(per_layer)]
            + [Block("output", int(last))])


def hf_placement(artifact, dtype: str, gpus, headroom: float, trust_remote_code: bool = False) -> Placement:
    """The placement of an HF checkpoint's weights at ``dtype`` on the visible GPUs: a packed GPTQ/AWQ checkpoint at
    its stored size (its kernels keep the packed codes on the device), any other at its parameters x the dtype."""
    import json
    from pathlib import Path

    from pipeline.figures.footprint import DTYPE_BYTES
    from pipeline.runtimes.model_inventory import from_folder

    artifact = Path(artifact)
    inv = from_folder(artifact, trust_remote_code)
    config = json.loads((artifact / "config.json").read_text()) if (artifact / "config.json").is_file() else {}
    packed = (config.get("quantization_config") or {}).get("quant_method") in ("gptq", "awq")
    weights = inv.stored_bytes if packed else inv.params * DTYPE_BYTES[dtype]
    return place(model_blocks(inv, weights), visible_devices(), gpus, headroom, what=f"{artifact.name} at {dtype}")


def visible_devices() -> list[Device]:
    """The CUDA devices this process sees, with their free memory now (torch's CUDA runtime)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(Device(i, int(free), int(total), torch.cuda.get_device_name(i)))
    return out


def hf_layers_per_device(device_map: dict, layers: int) -> dict:
    """Decoder layers per device in the device map transformers/accelerate chose (``model.hf_device_map``):
    {device: count}, a layer counted where its first module went."""
    import re

    seen: dict[int, object] = {}
    for name, dev in device_map.items():
        m = re.search(r"(?:^|\.)(?:layers|h|blocks?)\.(\d+)(?:\.|$)", name)
        if m and int(m.group(1)) < layers:
            seen.setdefault(int(m.group(1)), dev)
    out: dict = {}
    for dev in seen.values():
        out[str(dev)] = out.get(str(dev), 0) + 1
    return out
