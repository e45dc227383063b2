"""The working set of every stage of a run, per variant: disk written, peak host and device memory.

Each figure is the footprint arithmetic (``pipeline.figures.footprint``) plus a runtime's own memory: its libraries
and buffers, each a measured peak minus the weights and the KV cache it held; their sources are in docs/plan.md,
"The planner's constants and their sources". A variant is classified by its settings, never by its backend's name: a
``type`` in its quantize settings is a GGUF file, ``bits`` a packed GPTQ/AWQ checkpoint, neither the original
itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.figures.footprint import (MIB, Footprint, Inventory, dense_bytes, gguf_file, gguf_tensor_type,
                                        ggml_quant_sizes, kv_bytes, logits_bytes, packed_bytes, tensor_bytes)
from pipeline.runtimes.placement import CUDA_CONTEXT_B  # the CUDA context and its workspace on each device

# the runtime's own memory beside weights, KV and logits (peak RSS - weights - KV) (docs/plan.md, "The planner's
# constants and their sources")
HF_OVERHEAD_B = 450 * MIB           # the original on transformers
HF_QUANTIZED_EXTRA_B = 160 * MIB    # a GPTQ kernel / compressed-tensors checkpoint beyond the original's
GGUF_OVERHEAD_B = 90 * MIB          # llama.cpp beside a GGUF file
# the GPTQModel / llm-compressor child: torch, transformers, the quantizer beyond the modelled weights,
# activations and Hessians (docs/plan.md, "The planner's constants and their sources")
QUANTIZER_LIBS_B = 830 * MIB
CONVERTER_LIBS_B = 300 * MIB        # llama.cpp's converter (torch for the lazy tensors, gguf-py)
# the pipeline's own process, under a stage that loads a runtime in it: Python, torch, transformers, the tokenizer
# and the run's data (docs/plan.md, "The planner's constants and their sources"); a speed probe or a server is a
# process of its own, with only its runtime's overhead above
PIPELINE_PROCESS_B = 600 * MIB
LOADGEN_B = 900 * MIB               # guidellm's process during a load level (docs/plan.md, as above)
# reference transcripts: per reply token the top-K ids and log-probs (int32 + float32 each, K = 1024: 8 KB), and
# the whole distribution (4 bytes x vocabulary) at the share of positions whose tail mass is above the limit
# (docs/plan.md, "The planner's constants and their sources")
EXACT_ROW_SHARE = 0.12
REPACKED = ("Q4_0", "Q4_K", "IQ4_NL")
EXACT_SAMPLE_TOKENS = 256           # the exactness sample: full rows of two runtimes on one 256-token reply


@dataclass
class Workload:
    """Token counts of the run's suites under its profile (budgets: an upper bound, replies may stop earlier)."""

    conversations: int
    reply_tokens: int
    prompt_tokens: int
    context_tokens: int              # the longest conversation, rounded up to 256 as the runtimes size n_ctx
    per_suite: dict

    @staticmethod
    def of(cfg) -> "Workload":
        from pipeline.suites.records import load_suite, select

        per_suite = {}
        for suite in cfg.selected_suites():
            if suite.generate:
                g = suite.generate
                docs = len(g.get("lengths", [])) * len(g.get("depths", []))
                answer = int(g.get("answer_tokens", 32))
                prompt = sum(g.get("lengths", [])) * len(g.get("depths", []))
                per_suite[suite.name] = {"conversations": docs, "reply_tokens": docs * answer,
                                         "longest_reply": answer if docs else 0,
                                         "prompt_tokens": prompt, "prefill_tokens": prompt,
                                         "context_tokens": max(g.get("lengths", [0]), default=0) + answer + 64}
                continue
            convs = select(load_suite(suite.name, suite.path), *cfg.profile.limits(suite.name))
            replies = prompts = longest = prefill = longest_reply = 0
            for c in convs:
                chars = len(c.system or "")
                own = 0
                for t in c.turns:
                    chars += len(t.user)
                    own += t.max_new_tokens or 0
                    prompts += chars // 4 + own           # each turn re-reads the history (prefix reuse aside)
                replies += own
                longest_reply = max(longest_reply, own)
                prefill += chars // 4 + 16 * len(c.turns)  # each text read once (the history's prefix reused)
                longest = max(longest, chars // 4 + own + 16 * len(c.turns))
            per_suite[suite.name] = {"conversations": len(convs), "reply_tokens": replies,
                                     "longest_reply": longest_reply, "prompt_tokens": prompts,
                                     "prefill_tokens": prefill, "context_tokens": longest}
        rows = per_suite.values()
        context = max((r["context_tokens"] for r in rows), default=0)
        return Workload(conversations=sum(r["conversations"] for r in rows),
                        reply_tokens=sum(r["reply_tokens"] for r in rows),
                        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
                        context_tokens=int(math.ceil(context / 256) * 256), per_suite=per_suite)


def weight_kind(variant) -> str:
    """ggml (a GGUF file) | packed | original, from the variant's quantize settings."""
    q = variant.quantize or {}
    if q.get("type"):
        return "ggml"
    if q.get("bits"):
        return "packed"
    return "original"


def time_kind(variant, stage: str = "") -> str:
    """What a stage's time is matched on among measured variants: the weight kind, a packed one with its method
    (GPTQ and AWQ quantize at very different speeds); free-running by where the replies come from (a GGUF file,
    the variant's own or its dequantized stand-in)."""
    kind = weight_kind(variant)
    if kind == "packed":
        if stage == "evaluate" and variant.runtime_options.get("free_running") == "dequantized":
            return "ggml"
        return f"packed:{variant.quantize.get('method', 'gptq')}"
    return kind


class StagePlanner:
    """Footprints of one run's stages. ``on_device``: the runtimes hold their weights on a CUDA device."""

    def __init__(self, cfg, inv: Inventory, workload: Workload, on_device: bool):
        self.cfg, self.inv, self.work, self.on_device = cfg, inv, workload, on_device
        self.sizes = ggml_quant_sizes(cfg.paths.cache)
        self.facts = inv.facts
        self.vocab = int(self.facts.get("vocab_size") or 0)
        self.compute_dtype = "bfloat16" if on_device else "float32"

    # -------------------------------------------------------------- artifacts
    def gguf(self, ftype: str) -> dict:
        return gguf_file(self.inv, ftype, self.sizes)

    def packed(self, variant) -> int:
        from pipeline.quantizers.gptq import GROUP_SIZES

        q = variant.quantize
        group = q.get("group_size", "auto")
        if group == "auto":
            rows = {t.row for t in self.inv.tensors if self.inv.quantizable(t)}
            group = next((g for g in GROUP_SIZES if all(r % g == 0 for r in rows)), GROUP_SIZES[-1])
        dtype = self.quantize_dtype(q)
        save = q.get("save_dtype") or ("float16" if dtype == "float32" else dtype)
        return packed_bytes(self.inv, int(q["bits"]), int(group), q.get("method", "gptq") == "gptq", save)

    def quantize_dtype(self, q: dict) -> str:
        """The dtype GPTQModel quantizes in here (``pipeline.quantizers.gptq.quantize_dtype``; on a device the
        checkpoint's own half type is taken as bfloat16)."""
        from pipeline.quantizers.gptq import quantize_dtype

        return quantize_dtype(q, "cuda" if self.on_device else "cpu", None)

    def artifact_bytes(self, variant) -> int:
        kind = weight_kind(variant)
        if kind == "ggml":
            return self.gguf(variant.quantize["type"])["bytes"]
        if kind == "packed":
            return self.packed(variant) + self.inv.extra_bytes
        return self.original_bytes()

    def original_bytes(self) -> int:
        return dense_bytes(self.inv, self.cfg.model.save_dtype) if self.inv.stored_bytes is None \
            else self.inv.stored_bytes

    def standin(self, variant) -> bool:
        """Free-running from the dequantized weights as an F16 GGUF (runtime_options.free_running: dequantized)."""
        return weight_kind(variant) == "packed" and variant.runtime_options.get("free_running") == "dequantized"

    def repacked(self, ftype: str) -> int:
        """Bytes llama.cpp's CPU backend copies into interleaved buffers at load (its repack of Q4_0, Q4_K and
        IQ4_NL matrices for its AVX2/AVX-512 kernels; the embedding, read row by row, is not repacked); the
        measured extra is in docs/plan.md, "The planner's constants and their sources"."""
        return sum(tensor_bytes(t, kind, self.sizes) for t in self.inv.tensors
                   if t.role != "embedding" and (kind := gguf_tensor_type(ftype, t, self.inv, self.sizes)) in REPACKED)

    # -------------------------------------------------------------- a loaded runtime
    def kv_element_bytes(self, variant, dtype: str) -> float:
        from pipeline.runtimes import runtime_class

        return runtime_class(variant.runtime).cache_element_bytes({"dtype": dtype, **variant.runtime_options},
                                                                  int(self.facts["head_dim"]))

    def loaded(self, variant, context: int, sequences: int = 1, logits_rows: int = 0, copies: int = 1,
               gguf_type: str | None = None, in_process: bool = True) -> tuple[float, float, dict]:
        """(host, device, parts) of ``variant``'s runtime holding its weights, ``sequences`` KV caches of
        ``context`` tokens and ``logits_rows`` float32 rows of logits (``copies`` of them); ``in_process``: loaded
        in the pipeline's own process (whose libraries and data come on top), not in a probe or a server."""
        from pipeline.runtimes import runtime_class

        kind = "ggml" if gguf_type or weight_kind(variant) == "ggml" else "torch"
        latent = runtime_class("llamacpp" if kind == "ggml" else variant.runtime).latent_kv_cache
        if kind == "ggml":
            ftype = gguf_type or variant.quantize["type"]
            weights = self.gguf(ftype)["bytes"]
            overhead = GGUF_OVERHEAD_B + (0 if self.on_device else self.repacked(ftype))
            element = self.kv_element_bytes(variant, "float16")
        else:
            dtype = variant.runtime_options.get("dtype") or self.compute_dtype
            if weight_kind(variant) == "packed" and self.on_device:
                weights = self.packed(variant)         # Marlin / ExLlama keep the packed codes
            else:
                # on a CPU the plan takes a quantized checkpoint at its dense size: compressed-tensors is
                # dequantized at load, and GPTQModel's CPU kernel measured above the dense original
                weights = dense_bytes(self.inv, dtype)
            overhead = HF_OVERHEAD_B + (HF_QUANTIZED_EXTRA_B if weight_kind(variant) == "packed" else 0)
            element = self.kv_element_bytes(variant, dtype)
        if in_process:
            # transformers' own overhead is the same libraries the process has already imported
            overhead += PIPELINE_PROCESS_B - (HF_OVERHEAD_B if kind == "torch" else 0)
        parts = {"weights": weights, "kv_cache": kv_bytes(self.facts, element, context, sequences, latent),
                 "logits": logits_bytes(logits_rows, self.vocab, copies)}
        if self.on_device:
            device = sum(parts.values()) + CUDA_CONTEXT_B
            return overhead, device, {**parts, "runtime": overhead, "cuda_context": CUDA_CONTEXT_B}
        parts["runtime"] = overhead
        return sum(parts.values()), 0.0, parts

    # -------------------------------------------------------------- stages
    def prepare(self, kind: str) -> Footprint:
        fp = Footprint("prepare", "-")
        if kind in ("pypi-gguf", "gguf"):
            dense = dense_bytes(self.inv, self.cfg.model.save_dtype)
            fp.disk_bytes = dense + self.inv.extra_bytes
            # transformers dequantizes into a dense model, then save_pretrained serializes a second copy
            fp.parts = {"dense_model": dense, "serialized": dense, "source_file": self.inv.source_file_bytes,
                        "pipeline_process": PIPELINE_PROCESS_B}
        else:       # a folder is used in place: config and tokenizer only
            fp.parts = {"pipeline_process": PIPELINE_PROCESS_B}
        fp.host_bytes = sum(fp.parts.values())
        return fp

    def convert_f16(self) -> Footprint:
        f16 = self.gguf("F16")["bytes"]
        parts = {"tensor_buffers": 3 * 4 * self.inv.largest_tensor, "libraries": CONVERTER_LIBS_B}
        return Footprint("convert_f16", "-", disk_bytes=f16, host_bytes=sum(parts.values()), parts=parts)

    def quantize(self, variant) -> Footprint:
        fp = Footprint("quantize", variant.base)
        kind = weight_kind(variant)
        if kind == "ggml":
            ftype = variant.quantize["type"].upper()
            fp.disk_bytes = 0 if ftype == "F16" else self.gguf(ftype)["bytes"]   # F16: a hard link to the conversion
            # llama-quantize's buffers, beside the pipeline's process that waits for it
            fp.parts = {"tensor_buffers": 2 * 4 * self.inv.largest_tensor, "runtime": GGUF_OVERHEAD_B,
                        "pipeline_process": PIPELINE_PROCESS_B}
            if variant.quantize.get("imatrix"):
                host, _, parts = self.loaded(variant, int(variant.quantize.get("imatrix_ctx", 512)),
                                             logits_rows=int(variant.quantize.get("imatrix_ctx", 512)),
                                             gguf_type="F16")
                fp.parts = {f"imatrix_{k}": v for k, v in parts.items()}
        else:
            fp.disk_bytes = self.artifact_bytes(variant)
            q = variant.quantize
            cal = {**{"samples": 64, "seq_len": 256}, **(q.get("calibration") or {})}
            dtype = self.quantize_dtype(q)
            cb = 4 if dtype == "float32" else 2
            hidden = int(self.facts["hidden_size"])
            inner = int(self.facts.get("intermediate_size") or 4 * hidden)
            tokens = int(cal["samples"]) * int(cal["seq_len"])
            rows = sorted((t.row for t in self.inv.tensors if self.inv.quantizable(t)), reverse=True)
            layer = max((sum(t.elements for t in self.inv.tensors if t.layer == i)
                         for i in range(int(self.facts["layers"]))), default=0)
            fp.parts = {"weights": dense_bytes(self.inv, dtype),
                        # a layer's inputs, outputs and residual for every calibration token, and its MLP's inside
                        "calibration_activations": tokens * (3 * hidden + inner) * cb
                        # AWQ's scale search keeps every linear's inputs of the layer as well
                        + (tokens * (2 * hidden + inner) * cb if q.get("method") == "awq" else 0),
                        "hessians": 4 * sum(r * r for r in rows[:7]), "layer_copy": 4 * layer,
                        "libraries": QUANTIZER_LIBS_B}
            if self.on_device:      # the model stays on the host; one layer and its activations on the device
                fp.device_bytes = 4 * layer * 2 + fp.parts["calibration_activations"] + CUDA_CONTEXT_B
                fp.parts = {k: v for k, v in fp.parts.items() if k in ("weights", "libraries")}
        fp.host_bytes = sum(fp.parts.values())
        return fp

    def standin_stage(self, variant) -> Footprint:
        """The dequantized stand-in: a dense fp32 checkpoint and its F16 GGUF."""
        dense = dense_bytes(self.inv, "float32")
        parts = {"dense_model": dense, "libraries": HF_OVERHEAD_B}
        return Footprint("standin", variant.base, disk_bytes=dense + self.inv.extra_bytes + self.gguf("F16")["bytes"],
                         host_bytes=sum(parts.values()), parts=parts)

    def scored_rows(self, variant, rows: int, gguf_type: str | None = None) -> int:
        """float32 logit rows a teacher-forced pass over ``rows`` positions holds at once, with streamed scoring
        (drift.score_chunks): the block the runtime hands over (runtimes.base.block_rows) and, on llama.cpp, its
        own output buffer of up to n_batch rows. ``loaded(..., copies=2)`` adds one chunk of float64 temporaries
        of about the same size (drift.CHUNK_BYTES = runtimes.base.BLOCK_BYTES)."""
        from pipeline.runtimes.base import block_rows

        held = min(int(rows), block_rows(max(self.vocab, 1)))
        if gguf_type or weight_kind(variant) == "ggml":
            held += min(int(rows), int(self.cfg.runtime.n_batch))
        return held

    def parity(self, original, f16) -> Footprint:
        tokens = int(self.cfg.reference.parity_tokens)
        # one runtime at a time: the F16 file's rows are spilled to disk, then streamed beside the original's
        h1, d1, p1 = self.loaded(original, tokens, logits_rows=self.scored_rows(original, tokens), copies=2)
        h2, d2, p2 = self.loaded(f16, max(tokens + 8, 512), logits_rows=self.scored_rows(f16, tokens, "F16"))
        parts = p1 if h1 + d1 >= h2 + d2 else p2
        return Footprint("parity", "-", host_bytes=max(h1, h2), device_bytes=max(d1, d2), parts=parts)

    def reference(self, suite: str, producer, original) -> Footprint:
        w = self.work.per_suite[suite]
        ctx = min(self.work.context_tokens or 256, int(self.facts.get("context_length") or 1 << 30))
        batch = self.cfg.profile.batch
        h1, d1, p1 = self.loaded(producer, ctx, sequences=batch, logits_rows=batch)
        # the original's log-probs on the transcripts: one teacher-forced pass per conversation, streamed
        h2, d2, p2 = self.loaded(original, ctx, logits_rows=self.scored_rows(original, ctx), copies=2)
        rows = w["reply_tokens"]
        disk = rows * 8 * 1024 + EXACT_ROW_SHARE * rows * 4 * self.vocab + 2 * EXACT_SAMPLE_TOKENS * 4 * self.vocab
        return Footprint("reference", suite, disk_bytes=disk, host_bytes=max(h1, h2), device_bytes=max(d1, d2),
                         parts=p1 if h1 + d1 >= h2 + d2 else p2)

    def evaluate(self, variant, name: str | None = None, reuses_reference: bool = False) -> Footprint:
        fp = Footprint("evaluate", name or variant.name)
        if reuses_reference:
            fp.time_basis = "reuses the reference transcripts"
            fp.host_bytes, fp.parts = PIPELINE_PROCESS_B, {"pipeline_process": PIPELINE_PROCESS_B}
            return fp
        ctx = min(self.work.context_tokens or 256, int(self.facts.get("context_length") or 1 << 30))
        batch = self.cfg.profile.batch
        fp.host_bytes, fp.device_bytes, fp.parts = self.loaded(variant, ctx, sequences=batch, logits_rows=batch,
                                                               gguf_type="F16" if self.standin(variant) else None)
        fp.disk_bytes = 16 * 1024 * self.work.conversations + 64 * self.work.reply_tokens
        return fp

    def exact_rows_read(self, exactness: bool) -> dict:
        """What a scoring stage maps of the original's full rows beside its runtime, both vocabulary-sized: the
        worker maps one conversation's exact rows at a time (float32, at the share of positions that have one),
        and the exactness check also maps each suite's sample of the original's float64 log-softmax
        (``exactness``: the variant's scoring compares the stored KLD with the exact one)."""
        longest = [w["longest_reply"] for w in self.work.per_suite.values()]
        parts = {"exact_rows_mapped": int(EXACT_ROW_SHARE * max(longest, default=0) * 4 * self.vocab)}
        if exactness:
            parts["exact_sample_mapped"] = sum(min(EXACT_SAMPLE_TOKENS, n) * 8 * self.vocab for n in longest)
        return parts

    def score(self, variant, builds_exact_sample_with=None, exactness: bool = False) -> Footprint:
        """``builds_exact_sample_with``: the original, when this scoring stage is the one that builds the
        original's exact rows (the first variant with full logits: its own stage, run before the variant loads).
        ``exactness``: the stage also compares the stored KLD with the exact one (``exact_rows_read``)."""
        ctx = min(self.work.context_tokens or 256, int(self.facts.get("context_length") or 1 << 30))
        host, device, parts = self.loaded(variant, ctx, logits_rows=self.scored_rows(variant, ctx), copies=2)
        mapped = self.exact_rows_read(exactness)
        host, parts = host + sum(mapped.values()), {**parts, **mapped}
        if builds_exact_sample_with is not None:
            # the original on transformers, its full float64 rows at the sample written a block at a time
            h2, d2, p2 = self.loaded(builds_exact_sample_with, ctx,
                                     logits_rows=self.scored_rows(builds_exact_sample_with, EXACT_SAMPLE_TOKENS),
                                     copies=3)
            if h2 + d2 > host + device:
                host, device, parts = h2, d2, {f"exact_sample_{k}": v for k, v in p2.items()}
        # per scored token: the KLD and its top-K comparison (about 150 bytes in the committed run's scores)
        return Footprint("score", variant.name, disk_bytes=150 * self.work.reply_tokens, host_bytes=host,
                         device_bytes=device, parts=parts)

    def speed(self, variant) -> Footprint:
        sp = self.cfg.profile.speed
        host, device, parts = self.loaded(variant, sp.prompt_tokens + sp.decode_tokens, logits_rows=1,
                                          in_process=False)
        return Footprint("speed", variant.name, disk_bytes=16 * 1024, host_bytes=host, device_bytes=device,
                         parts=parts)

    def load(self, variant) -> Footprint:
        lc = self.cfg.load
        depth = max(lc.depths) if lc.depths else 512
        out = lc.output_tokens or 256
        slots = max(lc.concurrency) if lc.concurrency else 1
        host, device, parts = self.loaded(variant, depth + out + lc.ctx_margin, sequences=slots, logits_rows=slots,
                                          in_process=False)
        # beside the server: the load generator and the pipeline's process that drives them
        parts = {**parts, "load_generator": LOADGEN_B, "pipeline_process": PIPELINE_PROCESS_B}
        return Footprint("load", variant.name, disk_bytes=64 * 1024, host_bytes=host + LOADGEN_B + PIPELINE_PROCESS_B,
                         device_bytes=device, parts=parts)
