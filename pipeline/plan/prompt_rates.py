"""Seconds per weight of one prompt token through llama.cpp's matrix products of each ggml type on this CPU: what
the planner carries a GGUF variant's prompt work (prefill, teacher-forced scoring) with from one file's mix of
types to another's.

A type's prompt cost per weight does not follow its bytes: when llama.cpp loads a model its CPU backend repacks
some types (Q4_0, Q4_K, IQ4_NL, ...) into interleaved layouts for batched matrix products, and the others go
through tinyBLAS or per-row dot products. A small model's K-quant file is mostly fallbacks (Q5_0, Q8_0: rows not a
multiple of 256), a larger model's the K-quants themselves, so a prompt rate measured on one carries to the other
by its types, not its parameters alone (the llama-bench ratios: docs/plan.md, "The planner's constants and their
sources").

The repacking is the model loader's (a plain ggml graph does not do it), so each type is timed as llama.cpp's own
benchmark times a model: a synthetic Llama-shaped GGUF of two layers (2048 wide, 8192 feed-forward, every matrix
in that type, written by the build's own ggml_quantize_chunk; the vocabulary of llama.cpp's llama-spm test file)
and llama-bench reading a 512-token prompt on the run's threads, the types interleaved over two rounds and each
type's fastest repetition kept. About 3 s a type, once per llama.cpp build and thread count (kept beside the
tools); a plan that needs a type not kept measures its whole set again, so that one plan's types are always
measured together.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

NO_PRODUCT = ("F32",)        # norm and bias vectors (and F32 copies of them): no matrix product to time
_WIDTH, _FFN, _LAYERS, _HEADS, _KV_HEADS = 2048, 8192, 2, 32, 8
_PROMPT, _ROUNDS, _REPETITIONS = 512, 2, 2
_BLOCK_ROWS = 64             # rows quantized once and tiled (the values do not change the work)
_VOCAB = "llama-spm"         # llama.cpp's test vocabulary (32,000 SentencePiece tokens) the synthetic model carries
_VERSION = 1


def _matrices() -> list[tuple[str, int, int]]:
    """One layer's matrices: (name, rows, row length), as llama.cpp names a Llama block's tensors."""
    kv = _KV_HEADS * (_WIDTH // _HEADS)
    return [("attn_q", _WIDTH, _WIDTH), ("attn_k", kv, _WIDTH), ("attn_v", kv, _WIDTH),
            ("attn_output", _WIDTH, _WIDTH), ("ffn_gate", _FFN, _WIDTH), ("ffn_up", _FFN, _WIDTH),
            ("ffn_down", _WIDTH, _FFN)]


MATRIX_WEIGHTS = _LAYERS * sum(rows * row for _, rows, row in _matrices())


def write_model(path: Path, type_name: str, vocab_file: Path, lib) -> None:
    """A synthetic two-layer Llama GGUF at ``path`` whose matrices are all ``type_name`` (random values quantized
    by ggml itself; an importance matrix of ones for the types that require one), its embedding Q8_0."""
    import gguf
    import numpy as np

    from pipeline.infra.gguf_file import read_header
    from pipeline.plan.quant_rates import quantize_rows, type_ids

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    fields = read_header(vocab_file, arrays=arrays).fields
    rng = np.random.default_rng(0)
    ids = type_ids()

    def matrix(name: str, rows: int, row: int) -> tuple:
        t = ids[name]
        block = rng.standard_normal((min(rows, _BLOCK_ROWS), row)).astype(np.float32) * 0.02
        imatrix = np.ones(row, dtype=np.float32) if lib.ggml_quantize_requires_imatrix(t) else None
        data = quantize_rows(lib, t, block, imatrix)
        return np.tile(data, (-(-rows // len(data)), 1))[:rows], gguf.GGMLQuantizationType(t)

    logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)      # its per-file notices
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(_LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(_WIDTH)
    w.add_feed_forward_length(_FFN)
    w.add_head_count(_HEADS)
    w.add_head_count_kv(_KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(_WIDTH // _HEADS)
    w.add_tokenizer_model(fields["tokenizer.ggml.model"])
    w.add_tokenizer_pre(fields.get("tokenizer.ggml.pre") or "default")
    w.add_token_list(fields[arrays[0]])
    w.add_token_scores(fields[arrays[1]])
    w.add_token_types(fields[arrays[2]])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id)):
        if fields.get(f"tokenizer.ggml.{key}_token_id") is not None:
            add(fields[f"tokenizer.ggml.{key}_token_id"])
    data, raw = matrix("Q8_0", len(fields[arrays[0]]), _WIDTH)
    w.add_tensor("token_embd.weight", data, raw_dtype=raw)
    w.add_tensor("output_norm.weight", np.ones(_WIDTH, dtype=np.float32))
    for i in range(_LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(_WIDTH, dtype=np.float32))
        for name, rows, row in _matrices():
            data, raw = matrix(type_name, rows, row)
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _bench(exe: Path, model: Path, threads: int) -> float:
    """llama-bench's fastest prompt rate (tokens/s) of ``_PROMPT`` tokens on ``model``."""
    import subprocess

    from pipeline.infra.child_processes import child_options
    from pipeline.infra.llama_tools import parse_llama_bench

    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-b", str(_PROMPT), "-ub", str(_PROMPT), "-ngl", "0",
           "-p", str(_PROMPT), "-n", "0", "-r", str(_REPETITIONS), "-o", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **child_options())
    rows = parse_llama_bench(proc.stdout)
    if proc.returncode != 0 or not rows:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return max(rows[0].get("samples_ts") or [rows[0]["avg_ts"]])


def measure(types: tuple[str, ...], threads: int, exe: Path, vocab_file: Path, lib) -> dict[str, float]:
    """{type: seconds per prompt token per matrix weight}, every type built once and benched ``_ROUNDS`` times,
    the rounds interleaved (a slow spell of a shared machine lands on every type), each type's fastest kept."""
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="quantdrift-prompt-rates-") as tmp:
        files = {}
        for t in types:
            files[t] = Path(tmp) / f"{t}.gguf"
            write_model(files[t], t, vocab_file, lib)
        for _ in range(_ROUNDS):
            for t in types:
                best[t] = max(best.get(t, 0.0), _bench(exe, files[t], threads))
    return {t: 1.0 / rate / MATRIX_WEIGHTS for t, rate in best.items()}


def _record(tools: str, threads: int) -> Path:
    """Where the measurement is kept: beside the tools' build (one per llama.cpp version and CPU key)."""
    return Path(tools).parent / f"prompt-rates-t{threads}-v{_VERSION}.json"


@functools.lru_cache(maxsize=8)
def seconds_per_weight(types: tuple[str, ...], threads: int, tools: str = "") -> dict[str, float] | None:
    """{type: seconds per prompt token per matrix weight on ``threads`` threads} for ``types`` (those of
    ``NO_PRODUCT`` left out), measured with llama.cpp's tools in ``tools`` or kept from an earlier measurement of
    the same set; None (logged) where the tools, the vocabulary file or a type is missing here."""
    import subprocess

    from pipeline.infra.make_paths import vocab_dir
    from pipeline.infra.files import write_json
    from pipeline.plan.quant_rates import ggml_library, type_ids

    types = tuple(sorted(t for t in set(types) if t not in NO_PRODUCT))
    exe = Path(tools) / "llama-bench" if tools else None
    vocab_file = vocab_dir() / f"ggml-vocab-{_VOCAB}.gguf"
    lib = ggml_library(tools)
    missing = [why for why, gone in (("llama-bench (`make llama-tools`)", not (exe and exe.is_file())),
                                     (str(vocab_file), not vocab_file.is_file()), ("libggml-base", lib is None),
                                     (f"a ggml type of {types}", any(t not in type_ids() for t in types)))
               if gone]
    if missing or not types:
        log.info("prompt rates per ggml type not measured: %s", ", ".join(missing) or "no matrix types")
        return None
    record = _record(tools, threads)
    kept = {}
    try:
        kept = json.loads(record.read_text())["rates"]
    except (OSError, ValueError, KeyError):
        pass                                         # none yet, or damaged: measured again
    if all(t in kept for t in types):
        return {t: kept[t] for t in types}
    log.info("measuring llama.cpp's prompt rate of each ggml type %s on %d thread(s) (about 3 s a type)",
             ", ".join(types), threads)
    try:
        rates = measure(types, threads, exe, vocab_file, lib)
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
        log.warning("prompt rates per ggml type not measured: %s", exc)
        return None
    try:
        write_json(record, {"rates": {**kept, **rates}, "threads": threads, "prompt_tokens": _PROMPT,
                            "model": f"{_LAYERS} layers, {_WIDTH} wide, {_FFN} feed-forward"})
    except OSError as exc:                           # measured again next time
        log.warning("prompt rates per ggml type not kept at %s: %s", record, exc)
    return rates
