"""transformers runtime: fp32 on CPU (this class of CPU has no fast half precision), bf16 on CUDA."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from typing import TYPE_CHECKING

from pipeline.infra.errors import ConfigError, Skip
from pipeline.runtimes.hf_load import check_loaded, free_memory, range_overflow, safe_dtype
from pipeline.runtimes.placement import device_index, hf_placement
from pipeline.runtimes.base import FullLogitsRuntime, Generation, TokenChoice, greedy_decode, greedy_decode_many
from pipeline.runtimes.hf_scoring import HFScoring, _inference_mode

if TYPE_CHECKING:
    from pipeline.config.schema import RuntimeConfig


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"runtime.device={requested!r} but torch {torch.__version__} sees no CUDA device: "
                              "use runtime.device=cpu, or install a CUDA torch (make setup TORCH=cuda)")
        index = device_index(requested)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"runtime.device={requested!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return requested


@dataclass
class HFSettings:
    """variant.runtime_options for hf."""

    dtype: str | None = None            # None: chosen by pipeline.runtimes.compute_dtype (recorded in info)
    kv_cache: dict | None = None        # {bits, residual_length, score_chunk}: the integer KV cache (kv_quant)
    # GPTQ/AWQ free-running: 'dequantized' (the exact dequantized weights as an F16 GGUF on llama.cpp, after a
    # check against the kernel) or 'kernel'
    free_running: str | None = None

    def __post_init__(self) -> None:
        from pipeline.config.settings import one_of, positive_int

        if self.dtype is not None:
            one_of("variant.runtime_options.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.free_running is not None:
            one_of("variant.runtime_options.free_running", self.free_running, ("dequantized", "kernel"))
        if self.kv_cache is not None:
            for k, v in self.kv_cache.items():
                one_of("variant.runtime_options.kv_cache", k, ("bits", "residual_length", "score_chunk"))
                positive_int(f"variant.runtime_options.kv_cache.{k}", v)


class HFRuntime(HFScoring, FullLogitsRuntime):
    name = "hf"
    Settings = HFSettings
    # transformers 5's latent attention (DeepSeek V2/V3 and the models built on it) caches the compressed latent
    # and the rotary key per token (its cache.update(k_nope, k_pe)), not per-head keys and values
    latent_kv_cache = True

    @classmethod
    def apply_kv_cache(cls, options: dict, kv) -> tuple[dict, str]:
        cache = {"bits": kv.bits, "residual_length": kv.residual_length, "score_chunk": kv.score_chunk}
        return {**options, "kv_cache": cache}, f"kv_int{kv.bits}"

    @classmethod
    def kv_cache_applied(cls, options: dict) -> bool:
        return "kv_cache" in options

    @classmethod
    def cache_element_bytes(cls, info: dict, head_dim: int) -> float:
        """The integer cache (KIVI layout): K codes are bits/8 bytes per element with per-channel scales (a fixed
        cost per sequence, not per token); V codes are bits/8 plus an fp16 scale and zero point per token and head,
        i.e. 4 / head_dim bytes per element. Averaged over K and V: bits/8 + 2/head_dim."""
        kv = info.get("kv_cache")
        if kv:
            return kv["bits"] / 8 + 2 / head_dim
        return super().cache_element_bytes(info, head_dim)

    @classmethod
    def kv_cache_label(cls, info: dict) -> str | None:
        return f"int{info['kv_cache']['bits']}" if info.get("kv_cache") else info.get("dtype")

    def __init__(self, artifact: Path, options: dict, rcfg: RuntimeConfig, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(rcfg.device)
        if options.get("dtype"):
            dtype, dtype_why = options["dtype"], "variant.runtime_options.dtype"
        else:
            dtype, dtype_why = self._default_dtype(Path(artifact), rcfg.n_threads)
        self.dtype = getattr(torch, dtype)
        torch.set_num_threads(rcfg.n_threads)
        torch.manual_seed(0)
        load = self._load_options(Path(artifact))
        self.placement = None
        if self.device.startswith("cuda") and rcfg.gpus != 1:
            self.placement = hf_placement(Path(artifact), dtype, rcfg.gpus, rcfg.gpu_headroom, trust_remote_code)
            self.device = f"cuda:{self.placement.devices[0]}"      # where the input ids and the embedding are
            if self.placement.split:
                load.setdefault("device_map", "auto")
                load.setdefault("max_memory", self.placement.max_memory())
        if self.device.startswith("cuda"):
            # Load straight onto the GPU: a GPTQ/AWQ checkpoint picks its GPTQModel kernel for the device it is
            # loaded on, and transformers' GPTQ quantizer assumes the CPU when no device_map is given (a CPU kernel
            # class such as TorchAtenLinear, which .to("cuda") then only moves, dequantizing on every forward).
            load.setdefault("device_map", {"": self.device})
        while True:
            model, loading = AutoModelForCausalLM.from_pretrained(
                str(artifact), dtype=self.dtype, trust_remote_code=trust_remote_code, output_loading_info=True, **load,
            )
            # a model split across devices stays where accelerate put it (its hooks move activations between them)
            split = self.placement is not None and self.placement.split
            self.model = (model if split else model.to(self.device)).eval()
            check_loaded(Path(artifact), type(model).__name__, loading)
            overflow = range_overflow(self.model, dtype, self.device)
            if overflow is None:
                break
            dtype, dtype_why = safe_dtype(dtype, overflow, self.device, bool(options.get("dtype")))
            self.dtype = getattr(torch, dtype)
            del model, self.model
            free_memory(self.device)
        self._cache = None
        self._cache_ids: list[int] = []
        self.choice = TokenChoice.from_config(rcfg)
        self.kv = options.get("kv_cache")     # {"bits", "residual_length", "score_chunk"} or None
        if self.kv:
            kinds = set(getattr(self.model.config, "layer_types", None) or ["full_attention"])
            if kinds != {"full_attention"}:
                raise Skip(f"the hf integer KV cache supports full-attention layers only; this model has "
                           f"{sorted(kinds)} layers")
        self.info = {
            "runtime": "hf",
            "device": self.device,
            "dtype": str(self.dtype).replace("torch.", ""),
            "dtype_choice": dtype_why,
            "threads": torch.get_num_threads(),
            "kernel": self._kernel_name(),
            # False where the format's own kernel does not run here and the weights were made dense at load: the
            # drift is the format's (the same quantized values), its speed and memory are not
            "native_kernel": not getattr(self, "_dequantized_at_load", None),
            "kv_cache_dtype": f"int{self.kv['bits']}" if self.kv else str(self.dtype).replace("torch.", ""),
        }
        if self.kv:
            self.info["kv_cache"] = {**self.kv, "layout": "KIVI: keys per channel, values per token, fp16 scales"}
        if self.placement is not None:
            self.info["placement"] = self.placement.hf_row(self.model)

    def _default_dtype(self, artifact: Path, threads: int) -> tuple[str, str]:
        """The compute dtype when the variant sets none (pipeline.runtimes.compute_dtype), against the memory
        available now."""
        import psutil

        from pipeline.runtimes.compute_dtype import resolve

        return resolve(self.device, artifact, threads, psutil.virtual_memory().available)

    def _load_options(self, artifact: Path) -> dict:
        """A compressed-tensors checkpoint (llm-compressor's) is dequantized at load: transformers 5.24 cannot
        load its packed asymmetric zero points in compressed form (llm-compressor#1618), and on a CPU there is no
        packed-int4 kernel for it to run anyway (vLLM runs one on a GPU). Its linears are then dense, holding the
        quantized weights exactly."""
        config = artifact / "config.json"
        if not config.is_file():
            return {}
        import json

        qc = json.loads(config.read_text()).get("quantization_config") or {}
        if qc.get("quant_method") != "compressed-tensors":
            return {}
        from transformers import CompressedTensorsConfig

        self._dequantized_at_load = f"compressed-tensors {qc.get('format') or ''}".strip()

        return {"quantization_config": CompressedTensorsConfig(dequantize=True)}

    def _kernel_name(self) -> str:
        """The linear-layer implementations actually used: every leaf module class inside the decoder layers that
        does a matmul with its own weights (a torch.nn.Linear, a GPTQ/AWQ QuantLinear with packed ``qweight``, a
        compressed-tensors layer, ...), not only those that name a ``qweight``."""
        import torch

        if getattr(self, "_dequantized_at_load", None):
            return (f"torch.nn.Linear ({str(self.dtype).replace('torch.', '')}), dequantized at load from "
                    f"{self._dequantized_at_load}")
        kinds = set()
        for name, m in self.model.named_modules():
            if ".layers." not in f".{name}." or any(True for _ in m.children()):
                continue
            if type(m) is torch.nn.Linear:
                kinds.add(f"torch.nn.Linear ({str(self.dtype).replace('torch.', '')})")
            elif "linear" in type(m).__name__.lower() or hasattr(m, "qweight"):
                kinds.add(type(m).__name__)
        return ",".join(sorted(kinds)) or f"torch.nn.Linear ({str(self.dtype).replace('torch.', '')})"

    def _sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def reset(self) -> None:
        self._cache = None
        self._cache_ids = []

    def _new_cache(self, pads=None):
        """A fresh cache; ``pads`` (left padding per batch row) matters to the integer cache only."""
        if self.kv:
            from pipeline.runtimes.kv_quant import new_cache

            return new_cache(self.model.config.num_hidden_layers, self.kv["bits"], self.kv["residual_length"], pads)
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @_inference_mode
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> Generation:
        import torch

        prompt = list(prompt_ids)
        reuse = 0
        if self._cache is not None and len(self._cache_ids) < len(prompt) and prompt[:len(self._cache_ids)] == self._cache_ids:
            reuse = len(self._cache_ids)
        else:
            self._cache = self._new_cache()
        cache = self._cache

        reply: list[int] = []          # the reply tokens fed back so far (the penalty's window)

        def forward(input_ids: list[list[int]]) -> int:
            out = self.model(input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device), cache=cache,
                             use_cache=True, logits_to_keep=1)
            token = self._pick(out.logits[0, -1], prompt, reply)
            self._sync()
            return token

        def step(t: int) -> int:
            reply.append(t)
            return forward([[t]])

        ids, stop, ttft, times = greedy_decode(lambda: forward([prompt[reuse:]]), step, max_new_tokens, stop_ids)
        self._cache_ids = prompt + ids[: len(times)]
        return Generation(ids=ids, stop=stop, prompt_tokens=len(prompt), prefill_tokens=len(prompt) - reuse,
                          ttft_s=ttft, decode_times_s=times)

    def _pick(self, logits, prompt: Sequence[int], reply: Sequence[int]) -> int:
        """The next id from one row of logits (a tensor) by ``self.choice``: torch's argmax for plain greedy (the
        first maximum, as numpy's), else the shared penalty arithmetic on the float32 row."""
        if self.choice.greedy:
            return int(logits.argmax())
        return self.choice.pick(logits.float().cpu().numpy(), prompt, reply)

    # Several sequences decode together in one left-padded batch (the integer cache keeps padding out of its
    # per-channel key ranges: kv_quant.IntKVLayer.pads).
    batched = True

    @_inference_mode
    def generate_many(self, requests: Sequence[tuple[int, Sequence[int], int]], stop_ids: Sequence[int],
                      slots: int = 1) -> list[Generation]:
        """Greedy replies to several prompts in one batch, as transformers' batched generation does: prompts
        left-padded and masked, positions counted from each prompt's first real token, one forward pass per step
        for every live sequence; a finished sequence leaves the batch (its cache rows are dropped). Every call
        prefills its prompts afresh (padding would shift a kept cache), so ``slots`` only bounds the batch.
        Batched float arithmetic may differ from one sequence at a time in the last bits."""
        import time

        import torch

        if not self.batched or len(requests) <= 1:
            return super().generate_many(requests, stop_ids, slots)
        prompts = [[int(t) for t in p] for _, p, _ in requests]
        budgets = [int(r[2]) for r in requests]
        n, width = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        pads = [width - len(p) for p in prompts]
        ids = torch.tensor([[0] * k + p for k, p in zip(pads, prompts)], dtype=torch.long, device=dev)
        mask = torch.tensor([[0] * k + [1] * len(p) for k, p in zip(pads, prompts)], dtype=torch.long, device=dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(torch.tensor(pads, dtype=torch.long, device=dev))
        t0 = time.perf_counter()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        first = [self._pick(out.logits[i, -1], prompts[i], []) for i in range(n)]
        self._sync()
        ttft = time.perf_counter() - t0
        batch = {"rows": list(range(n)), "mask": mask, "last": pos[:, -1]}   # request index of each batch row

        def step(live: list[int], replies: list[list[int]]) -> list[int]:
            if len(live) < len(batch["rows"]):          # finished sequences leave the batch
                index = torch.tensor([batch["rows"].index(i) for i in live], dtype=torch.long, device=dev)
                cache.batch_select_indices(index)
                batch.update(rows=live, mask=batch["mask"][index], last=batch["last"][index])
            m = batch["mask"] = torch.cat([batch["mask"], batch["mask"].new_ones((len(live), 1))], dim=-1)
            last = batch["last"] = batch["last"] + 1
            feed = torch.tensor([[replies[i][-1]] for i in live], dtype=torch.long, device=dev)
            out = self.model(input_ids=feed, attention_mask=m, position_ids=last[:, None], cache=cache,
                             use_cache=True, logits_to_keep=1)
            nxt = [self._pick(out.logits[j, -1], prompts[i], replies[i]) for j, i in enumerate(live)]
            self._sync()
            return nxt

        replies, stop, times = greedy_decode_many(first, step, budgets, stop_ids)
        self.reset()             # the single-sequence cache no longer matches anything generate() saw
        return [Generation(ids=replies[i], stop=stop[i], prompt_tokens=len(prompts[i]),
                           prefill_tokens=len(prompts[i]), ttft_s=ttft, decode_times_s=times[i]) for i in range(n)]

    def kv_cache_bytes(self) -> dict | None:
        """Bytes held by the live cache's key/value tensors, measured on the tensors themselves."""
        import torch

        if self._cache is None or not self._cache_ids:
            return None
        if self.kv:
            from pipeline.runtimes.kv_quant import cache_bytes

            return cache_bytes(self._cache)
        total = 0
        for layer in getattr(self._cache, "layers", []):
            for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        tokens = self._cache.get_seq_length()
        return {"bytes": int(total), "tokens": int(tokens), "source": "hf cache tensors"} if tokens else None

    def close(self) -> None:
        self.reset()
        del self.model
