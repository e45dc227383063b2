"""Exact dequantization of GPTQ (v1 "gptq" checkpoint format), AWQ (GEMM) and compressed-tensors folders into a
dense checkpoint.

Used for one purpose: a fast stand-in for free-running generation on CPU, where the real GPTQ/AWQ kernels
decode too slowly for a whole suite. The dense weights are the quantized weights exactly (codes x scales);
the stand-in is converted to an F16 GGUF and run on llama.cpp. It is used only when a check on a sample shows
that it reproduces the real kernel (see ``pipeline.evaluate``); speed, memory and teacher-forced drift always
come from the real kernel.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _unpack_rows(packed, bits: int):
    """GPTQ qweight int32 [in / (32/bits), out] -> codes [in, out]."""
    import torch

    per_word, mask = 32 // bits, (1 << bits) - 1
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(packed.shape[0] * per_word, packed.shape[1], dtype=torch.int64)
    for i in range(per_word):
        out[i::per_word, :] = (p >> (i * bits)) & mask
    return out


def _unpack_cols(packed, bits: int):
    """GPTQ qzeros int32 [groups, out / (32/bits)] -> codes [groups, out]."""
    import torch

    per_word, mask = 32 // bits, (1 << bits) - 1
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(packed.shape[0], packed.shape[1] * per_word, dtype=torch.int64)
    for i in range(per_word):
        out[:, i::per_word] = (p >> (i * bits)) & mask
    return out


def dequant_gptq(qweight, qzeros, scales, g_idx, bits: int, checkpoint_format: str = "gptq"):
    """Dense nn.Linear weight [out, in], float32: scale[g] * (code - zero[g])."""
    w = _unpack_rows(qweight, bits)
    z = _unpack_cols(qzeros, bits)[:, : scales.shape[1]]
    if checkpoint_format == "gptq":   # v1 stores zero - 1
        z = (z + 1) & ((1 << bits) - 1)
    g = g_idx.long()
    return (scales.float()[g] * (w - z[g]).float()).t().contiguous()


def dequant_awq_gemm(qweight, qzeros, scales, bits: int, group_size: int):
    """AWQ GEMM layout: nibbles LSB-first along the output dim with AWQ's interleave undone; [out, in] float32."""
    import torch

    if bits != 4:
        raise ValueError(f"AWQ GEMM dequantization supports 4 bits, got {bits}")
    shifts = torch.arange(0, 32, 4)
    order = list(AWQ_REVERSE_ORDER)

    def unpack(q):
        u = ((q.to(torch.int64)[:, :, None] >> shifts[None, None, :]) & 15).reshape(q.shape[0], -1)
        perm = torch.arange(u.shape[1]).view(-1, 8)[:, order].reshape(-1)
        return u[:, perm]

    w, z = unpack(qweight), unpack(qzeros)
    dense = (w - z.repeat_interleave(group_size, 0)).float() * scales.float().repeat_interleave(group_size, 0)
    return dense.t().contiguous()


def compressed_tensors_state_dict(folder: Path, config: dict) -> dict:
    """A compressed-tensors checkpoint (llm-compressor's) dequantized by compressed-tensors itself, through
    transformers' ``dequantize=True`` load: every quantized linear becomes its dense float32 weight."""
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, device_map="cpu",
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    # the model's own tensors (no clone: one copy of the weights in memory), contiguous for safetensors
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    del model
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)       # the embedding, shared
    leftover = [k for k in state if k.rsplit(".", 1)[-1] not in ("weight", "bias")]
    if leftover:
        raise ValueError(f"{folder}: dequantizing left quantization tensors behind: {leftover[:4]}")
    return state


def dense_state_dict(folder: Path) -> tuple[dict, dict]:
    """Every tensor of a GPTQ/AWQ folder with quantized linears replaced by dense float32 weights."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    if qc.get("quant_method") == "compressed-tensors":
        return compressed_tensors_state_dict(folder, config), config
    bits, group, method = qc["bits"], qc["group_size"], qc["quant_method"]
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    state, packed = {}, defaultdict(dict)
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                for suffix in ("qweight", "qzeros", "scales", "g_idx"):
                    if name.endswith("." + suffix):
                        packed[name[: -len(suffix) - 1]][suffix] = fh.get_tensor(name)
                        break
                else:
                    state[name] = fh.get_tensor(name).to(torch.float32)
    for prefix, b in packed.items():
        if method == "gptq":
            w = dequant_gptq(b["qweight"], b["qzeros"], b["scales"], b["g_idx"], bits, fmt)
        elif method == "awq":
            w = dequant_awq_gemm(b["qweight"], b["qzeros"], b["scales"], bits, group)
        else:
            raise ValueError(f"unsupported quant_method {method!r}")
        state[prefix + ".weight"] = w
    return state, config


def write_dense_checkpoint(folder: Path, out: Path) -> None:
    """A plain float32 HF checkpoint holding the quantized model's exact weights (tokenizer files copied)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state, config = dense_state_dict(folder)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(folder).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja",
                                                                          "generation_config.json")):
            shutil.copy(f, out / f.name)
