"""llama.cpp runtime through llama-cpp-python: greedy decoding and teacher-forced scoring on token ids."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from typing import TYPE_CHECKING

from pipeline.infra.errors import ConfigError, Skip, raise_if_interrupted
from pipeline.infra.llama_tools import load_llama_cpp
from pipeline.runtimes.base import (FullLogitsRuntime, Generation, TokenChoice, block_rows, greedy_decode,
                                    in_position_order)
from pipeline.runtimes.llamacpp_batched import LlamaCppBatching, _reusable

if TYPE_CHECKING:
    from pipeline.config.schema import RuntimeConfig

log = logging.getLogger(__name__)

_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")
_OFFLOAD_LINE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_CACHE_TYPES = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0", "f32": "GGML_TYPE_F32"}
# Bytes per cached element: block types count their per-block fp16 scale (q8_0: 32 int8 + 2 bytes).
_CACHE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# kv_cache.bits -> the llama.cpp cache type
_KV_BITS = {8: "q8_0", 4: "q4_0"}


@dataclass
class LlamaCppSettings:
    """variant.runtime_options for llamacpp."""

    flash_attn: bool | None = None      # None: runtime.flash_attn (on for every variant by default)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"

    def __post_init__(self) -> None:
        from pipeline.config.settings import one_of

        for side in ("k", "v"):
            one_of(f"variant.runtime_options.cache_type_{side}", getattr(self, f"cache_type_{side}"),
                   tuple(_CACHE_TYPES))


def gguf_file(artifact: Path) -> Path:
    artifact = Path(artifact)
    if artifact.is_file():
        return artifact
    files = sorted(artifact.glob("*.gguf"))
    if len(files) != 1:
        raise ConfigError(f"{artifact}: expected exactly one .gguf file, found {[f.name for f in files]}")
    return files[0]


def vocab_loads_in_child(path: Path, timeout_s: float = 600) -> None:
    """Load ``path``'s vocabulary in a child process first: llama.cpp aborts the whole process (GGML_ASSERT) on
    some converted files (two ids sharing one token text), which in process would take every variant's job down
    with it, the transformers ones included. Raises RuntimeError with the child's last lines when it fails."""
    import os
    import subprocess
    import sys

    from pipeline.infra.child_processes import child_options
    from pipeline.infra.make_paths import PROJECT_ROOT

    code = ("import sys\nfrom pipeline.infra.llama_tools import load_llama_cpp\n"
            "load_llama_cpp().Llama(sys.argv[1], vocab_only=True, verbose=True)\n")   # the abort's own words
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          timeout=timeout_s, **child_options())
    raise_if_interrupted(proc.returncode, f"loading the vocabulary of {path.name} in a child process")
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        cause = [ln for ln in lines if re.search(r"GGML_ASSERT|error|failed|exception", ln, re.I)] or lines[-3:]
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise RuntimeError(f"llama.cpp could not load the vocabulary of {path.name} ({how}): "
                           + " | ".join(cause[-3:])[-500:])


def cuda_supported() -> bool:
    llama_cpp = load_llama_cpp()

    return bool(llama_cpp.llama_supports_gpu_offload())


def gguf_placement(path: Path, gpus, headroom: float):
    """The placement (pipeline.runtimes.placement) of a GGUF file's tensors on the visible GPUs: the file's
    tensor table at the file's size, without the token embedding (llama.cpp keeps the input layer on the CPU)."""
    from pipeline.figures.footprint import Inventory
    from pipeline.runtimes.model_inventory import gguf_tensors
    from pipeline.runtimes.placement import model_blocks, place, visible_devices

    inv = Inventory(tensors=gguf_tensors(path), facts={}, source=f"GGUF tensor table of {path.name}")
    blocks = [b for b in model_blocks(inv, path.stat().st_size) if b.name != "embedding"]
    return place(blocks, visible_devices(), gpus, headroom, what=path.name)


class LlamaCppRuntime(LlamaCppBatching, FullLogitsRuntime):
    """Options (variant.runtime_options): flash_attn, cache_type_k/v (LlamaCppSettings); callers add n_ctx."""

    name = "llamacpp"
    Settings = LlamaCppSettings
    own_tokenizer = True
    own_process = True          # never in a process that imported torch (pipeline.runtimes.worker)

    @classmethod
    def apply_kv_cache(cls, options: dict, kv) -> tuple[dict, str]:
        kind = _KV_BITS[kv.bits]
        # llama.cpp requires flash attention for a quantized V cache
        return {**options, "cache_type_k": kind, "cache_type_v": kind, "flash_attn": True}, f"kv_{kind}"

    @classmethod
    def kv_cache_applied(cls, options: dict) -> bool:
        return options.get("cache_type_k", "f16") != "f16" or options.get("cache_type_v", "f16") != "f16"

    @classmethod
    def key_settings(cls, rcfg) -> dict:
        # kv_unified only when on, so the stages stored before the setting existed (one stream per sequence) stay;
        # "prefill": generate_many prefills each sequence in chunks of its own since this was added (replies
        # decoded batched before it came from prompts packed across sequences, which changed some picks)
        return {"flash_attn": rcfg.flash_attn, **({"kv_unified": True} if rcfg.kv_unified else {}),
                "prefill": "per-sequence"}

    @classmethod
    def cache_element_bytes(cls, info: dict, head_dim: int) -> float:
        return (_CACHE_BYTES[info.get("cache_type_k", "f16")] + _CACHE_BYTES[info.get("cache_type_v", "f16")]) / 2

    @classmethod
    def kv_cache_label(cls, info: dict) -> str | None:
        return info.get("cache_type_k")

    def __init__(self, artifact: Path, options: dict, rcfg: RuntimeConfig, trust_remote_code: bool = False):
        llama_cpp = load_llama_cpp()

        path = gguf_file(artifact)
        if rcfg.device.startswith("cuda") and not cuda_supported():
            raise ConfigError(f"runtime.device={rcfg.device!r} but this llama-cpp-python build has no GPU offload: "
                              "rebuild it with CMAKE_ARGS=-DGGML_CUDA=on (make setup TORCH=cuda)")
        use_gpu = rcfg.device.startswith("cuda") or (rcfg.device == "auto" and cuda_supported())
        self.n_ctx = int(options.get("n_ctx", 2048))
        flash = bool(rcfg.flash_attn if options.get("flash_attn") is None else options["flash_attn"])
        kwargs = {}
        for side in ("k", "v"):
            kind = options.get(f"cache_type_{side}", "f16")
            if kind not in _CACHE_TYPES:
                raise ConfigError(f"variant.runtime_options.cache_type_{side}={kind!r}: expected one of "
                                  + ", ".join(_CACHE_TYPES))
            kwargs[f"type_{side}"] = getattr(llama_cpp, _CACHE_TYPES[kind])
        if kwargs["type_v"] != llama_cpp.GGML_TYPE_F16 and not flash:
            raise ConfigError("llama.cpp needs flash attention for a quantized V cache: set "
                              "variant.runtime_options.flash_attn=true")
        self.placement = None
        if use_gpu:
            kwargs.update(self._gpu_split(path, rcfg, llama_cpp))
        log_buffer = io.StringIO()
        try:
            with contextlib.redirect_stderr(log_buffer):
                self.llm = llama_cpp.Llama(
                    str(path), n_ctx=self.n_ctx, n_batch=rcfg.n_batch, n_ubatch=rcfg.n_batch,
                    n_threads=rcfg.n_threads, n_threads_batch=rcfg.n_threads,
                    n_gpu_layers=rcfg.n_gpu_layers if use_gpu else 0, logits_all=False,   # scoring asks for the rows it needs (logits())
                    flash_attn=flash, seed=0, verbose=True, **kwargs,
                )
        except (ValueError, RuntimeError) as exc:
            tail = "\n".join(log_buffer.getvalue().strip().splitlines()[-5:])
            quantized_cache = kwargs["type_k"] != llama_cpp.GGML_TYPE_F16 or kwargs["type_v"] != llama_cpp.GGML_TYPE_F16
            if quantized_cache and "context" in str(exc).lower():   # the weights loaded; the cache did not
                raise Skip(f"llama.cpp could not create a context with a {options.get('cache_type_k')}/"
                               f"{options.get('cache_type_v')} KV cache on this build ({exc}); its log ended "
                               f"with:\n{tail}") from None
            raise ConfigError(f"llama.cpp could not load {path} ({exc}); its log ended with:\n{tail}\n"
                              "The file may be truncated or corrupted: delete it and rerun to rebuild it") from None
        self._load_log = log_buffer.getvalue()
        # Verbose was only needed to capture the KV-cache size at context creation.
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.llm.verbose = False
        self.n_vocab = self.llm.n_vocab()
        self.choice = TokenChoice.from_config(rcfg)
        self.kv_unified = rcfg.kv_unified
        self.info = {
            "runtime": "llamacpp",
            "device": "cuda" if use_gpu else "cpu",
            "threads": rcfg.n_threads,
            "n_ctx": self.n_ctx,
            "n_batch": self.llm.n_batch,       # llama-cpp-python clips it to n_ctx
            "flash_attn": flash,
            "kv_unified": rcfg.kv_unified,     # how generate_many lays out several sequences' cells
            # llama.cpp's context default keeps a full-size cache on sliding-window layers too (llama-server's
            # does not): what the KV formula must count for this runtime
            "swa_full": bool(self.llm.context_params.swa_full),
            "cache_type_k": options.get("cache_type_k", "f16"),
            "cache_type_v": options.get("cache_type_v", "f16"),
            "kernel": f"ggml-{'cuda' if use_gpu else 'cpu'}",
            "file": path.name,
            # llama.cpp's own count from its load log ("offloaded 31/31 layers to GPU"; 0/N on the CPU, None unlogged)
            "offloaded_layers": (m.group(1) + "/" + m.group(2)) if (m := _OFFLOAD_LINE.search(self._load_log)) else None,
            # whether the process that loaded the file had imported torch (never, by pipeline.runtimes.worker)
            "torch_in_process": "torch" in sys.modules,
        }
        if self.placement is not None:
            self.info["placement"] = {**self.placement.row(), "tensor_split": kwargs.get("tensor_split")}

    def _gpu_split(self, path: Path, rcfg, llama_cpp) -> dict:
        """llama.cpp's device arguments. One device (runtime.gpus=1): that device alone (split mode none; left to
        itself llama.cpp splits the layers over every visible GPU). Several: the placement
        (pipeline.runtimes.placement) of the file's tensors, applied as a layer split whose tensor_split gives
        exactly the planned layer counts."""
        if rcfg.gpus == 1:
            from pipeline.runtimes.placement import device_index

            return {"split_mode": llama_cpp.LLAMA_SPLIT_MODE_NONE, "main_gpu": device_index(rcfg.device)}
        self.placement = gguf_placement(path, rcfg.gpus, rcfg.gpu_headroom)
        if not self.placement.split:
            return {"split_mode": llama_cpp.LLAMA_SPLIT_MODE_NONE, "main_gpu": self.placement.devices[0]}
        return {"split_mode": llama_cpp.LLAMA_SPLIT_MODE_LAYER, "main_gpu": self.placement.devices[0],
                "tensor_split": self.placement.tensor_split()}

    def _last_logits(self) -> np.ndarray:
        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def reset(self) -> None:
        """Forget cached prefixes: the single-sequence context's and every batched slot's."""
        self.llm.reset()
        multi = getattr(self, "_multi", None)
        if multi:
            llama_cpp = load_llama_cpp()

            llama_cpp.llama_memory_clear(multi["ctx"].memory, True)
            multi["cached"] = [[] for _ in range(multi["slots"])]

    def _check_fits(self, n: int) -> None:
        if n > self.n_ctx:
            raise ConfigError(f"sequence of {n} tokens does not fit llama.cpp's n_ctx={self.n_ctx}")

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> Generation:
        prompt = [int(t) for t in prompt_ids]
        self._check_fits(len(prompt) + max_new_tokens)
        reuse = _reusable(self.llm.input_ids[: self.llm.n_tokens].tolist(), prompt)
        self.llm.n_tokens = reuse             # eval() drops KV cells from here on

        reply: list[int] = []          # the reply tokens fed back so far (the penalty's window)

        def feed(tokens: list[int]) -> int:
            self.llm.eval(tokens)
            return self.choice.pick(self._last_logits(), prompt, reply)

        def step(t: int) -> int:
            reply.append(t)
            return feed([t])

        ids, stop, ttft, times = greedy_decode(lambda: feed(prompt[reuse:]), step, max_new_tokens, stop_ids)
        return Generation(ids=ids, stop=stop, prompt_tokens=len(prompt), prefill_tokens=len(prompt) - reuse,
                          ttft_s=ttft, decode_times_s=times)

    batched = True
    latent_kv_cache = True       # llama.cpp's DeepSeek V2/V3 graph caches the MLA latent

    def logit_blocks(self, ids: Sequence[int], positions: Sequence[int]) -> Iterator[np.ndarray]:
        """One pass over ``ids`` in n_batch chunks, asking llama.cpp for output rows only at ``positions``: the
        vocabulary projection of every other token is skipped (about 30 % of prefill time on small models). Each
        chunk's rows are copied out of llama.cpp's output buffer (``llama_get_logits_ith``) ``block_rows`` at a
        time as soon as that chunk is decoded. What the library holds meanwhile is its own: the output buffer of
        one decode (at most n_batch rows x vocab float32) and llama-cpp-python's ``scores`` array (n_batch x vocab
        float32 with logits_all=False, allocated but never written on this path)."""
        ids = [int(t) for t in ids]
        self._check_fits(len(ids))
        positions = [int(p) for p in positions]
        for p in positions:
            if not 0 <= p < len(ids):
                raise ValueError(f"position {p} outside a sequence of {len(ids)} tokens")
        yield from in_position_order(positions, lambda wanted: self._ascending_blocks(ids, wanted))

    def _ascending_blocks(self, ids: list[int], positions: list[int]) -> Iterator[np.ndarray]:
        llm, batch = self.llm, self.llm._batch
        wanted = set(positions)
        step = block_rows(self.n_vocab)
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        next_row = 0
        for start in range(0, len(ids), llm.n_batch):
            chunk = ids[start:start + llm.n_batch]
            batch.set_batch(chunk, n_past=start, logits_all=False)
            for i in range(len(chunk)):
                batch.batch.logits[i] = (start + i) in wanted
            batch.batch.logits[len(chunk) - 1] = True   # llama.cpp wants at least one output per batch
            llm._ctx.decode(batch)
            stop = next_row
            while stop < len(positions) and positions[stop] < start + len(chunk):
                stop += 1
            for a in range(next_row, stop, step):
                yield self._output_rows([p - start for p in positions[a:min(a + step, stop)]])
            next_row = stop
        llm.input_ids[: len(ids)] = ids
        llm.n_tokens = len(ids)

    def _output_rows(self, batch_rows: list[int]) -> np.ndarray:
        """A float32 copy of the last decode's logits at ``batch_rows`` (indices into its batch)."""
        llama_cpp = load_llama_cpp()

        block = np.empty((len(batch_rows), self.n_vocab), dtype=np.float32)
        for r, i in enumerate(batch_rows):
            block[r] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, i),
                                             shape=(self.n_vocab,))
        return block

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def tokenize_document(self, text: str) -> tuple[list[int], int | None]:
        # As llama.cpp's tools tokenize a text file (common_tokenize(ctx, text, add_special=true,
        # parse_special=false)): BOS where the GGUF's metadata says the model adds it, special-token strings as
        # plain text. Returns the ids and the BOS id when the model adds one (else None).
        llama_cpp = load_llama_cpp()

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        adds_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        ids = self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        return ids, (int(llama_cpp.llama_vocab_bos(vocab)) if adds_bos else None)

    def tokenize_served(self, text: str) -> list[int]:
        # As llama-server tokenizes a chat prompt: special tokens parsed, add_special=true (BOS only where the
        # GGUF's tokenizer.ggml.add_bos_token says so).
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def detokenize_served(self, ids: Sequence[int]) -> str:
        return self.llm.detokenize([int(t) for t in ids]).decode("utf-8", errors="replace")

    def kv_cache_bytes(self) -> dict | None:
        """KV bytes llama.cpp holds for the live sequence, as it serialises them (llama_state_seq_get_size: the
        K/V data of the filled cells plus 12 bytes of cell metadata each and a small header), and the size of
        the whole allocated cache from its own log at context creation."""
        llama_cpp = load_llama_cpp()

        n = int(self.llm.n_tokens)
        if n == 0:
            return None
        out = {"bytes": int(llama_cpp.llama_state_seq_get_size(self.llm._ctx.ctx, 0)), "tokens": n,
               "source": "llama_state_seq_get_size"}
        # an interleaved sliding-window model logs two caches (the global layers', then the local layers'): the
        # allocation is both, per cell of the context (the larger cell count)
        caches = _KV_LINE.findall(self._load_log)
        if caches:
            out["allocated_bytes"] = int(round(sum(float(size) for size, _ in caches) * 2**20))
            out["allocated_cells"] = max(int(cells) for _, cells in caches)
        return out

    def close(self) -> None:
        multi = getattr(self, "_multi", None)
        if multi:
            with contextlib.suppress(Exception):
                multi["batch"].close()
                multi["ctx"].close()
            self._multi = None
        with contextlib.suppress(Exception):
            self.llm.close()
