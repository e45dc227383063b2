"""`make stage-costs` (`quantdrift stage_costs`): each llama.cpp stage of a finished comparison set beside llama.cpp's
own tools doing the same work, on the same file with the same threads, batch size, flash-attention setting and KV
types, on this machine now. Nothing of the run is measured again; its stage times are its manifests'.

    free-running   the tokens the stage prefilled and decoded, per suite, at the suite's llama-batched-bench rates
                   for that many sequences at once (the run's ``profile.batch``, at most the suite's conversations),
                   a prompt of the suite's mean context and a reply of its mean length (the median of three runs)
    scoring        the tokens read teacher-forced (each reference transcript once, and the exactness check's
                   sample once more), at llama-bench's prompt rate for the mean transcript, plus the least
                   arithmetic per scored row (the log-softmax normaliser of a float32 row of the vocabulary and the
                   gather of its top-K candidates, timed here with numpy); and beside it the same tokens with
                   every scored row computed by the engine: llama-bench's prompt processing computes one output
                   row per batch, llama-perplexity one for each position of the second half of every chunk, so a
                   row's cost is llama-perplexity's time per chunk less llama-bench's for as many tokens, over
                   the rows it computed (its own normaliser of each row included)
    references     per suite, the reference's free-running as a variant's, and its log-probs as scoring with the
                   selection of each reply position's top K in place of the gather (where a GGUF file on
                   llama.cpp produced them, with the run's runtime settings)

The ratio stage ÷ tool says what the pipeline's own work (Python, sampling, the logits it copies, sequences that
finish early in a batch) costs over the engine. A variant that is not a GGUF file, one whose replies are the
reference's, and one screened out before free-running are listed with that reason, as is a reference produced on
another runtime. Written to ``stage_costs.json`` in the run's results folder."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Callable

from pipeline.config.schema import Config
from pipeline.infra.files import read_json, read_jsonl, write_json
from pipeline.infra.stage_cache import load_manifest
from pipeline.infra.stage_folders import own_seconds, stage_span

log = logging.getLogger(__name__)

# llama-batched-bench runs each shape once: the median of this many runs (llama-bench takes the median of its own 5)
BATCHED_REPETITIONS = 3

# llama-perplexity's time per chunk: the difference of a run of this many chunks and a run of one, per chunk (the
# load and the tokenization of the text are the same in both)
PERPLEXITY_CHUNKS = 4

# (gguf, settings, prompt tokens) -> prompt tokens/s; (gguf, settings, prompt, reply, sequences) -> (prefill, decode);
# (gguf, settings) -> llama-perplexity's seconds per computed row beyond prompt processing, with its detail
PromptRate = Callable[[Path, dict, int], float]
BatchedRates = Callable[[Path, dict, int, int, int], tuple[float, float]]
RowCost = Callable[[Path, dict], dict]


def run_stage_costs(cfg: Config, prompt_rate: PromptRate | None = None, batched_rates: BatchedRates | None = None,
                    row_seconds: float | None = None, row_cost: RowCost | None = None) -> dict:
    """The table for every variant of ``cfg.run.variants``; the tools' rates from ``prompt_rate``,
    ``batched_rates`` and ``row_cost`` (llama-bench, llama-batched-bench and llama-perplexity unless given: tests
    pass their own)."""
    from pipeline.plan.budget import kept_allocation
    from pipeline.stages.variant_setup import load_result

    cfg = kept_allocation(cfg)       # a run cut to its budget batched as it ran
    prompt_rate = prompt_rate or _llama_bench_rate(cfg)
    batched_rates = batched_rates or _batched_bench_rates(cfg)
    row_cost = row_cost or _perplexity_row_cost(cfg, prompt_rate)
    rows, vocab, select_seconds, lengths_by_suite = [], None, None, {}
    for name in cfg.run.variants or [cfg.variant.name]:
        result = load_result(cfg, name)
        why = _not_costed(result)
        if why:
            rows.append({"variant": name, "stage": "-", "status": "skipped", "reason": why})
            continue
        vocab = vocab or result["model"]["facts"]["vocab_size"]
        if row_seconds is None:
            row_seconds = extraction_seconds_per_row(vocab, cfg.reference.top_k)
        gguf = Path(result["artifact"]["path"])
        ev = result["evaluation"]
        rows.append(free_running_cost(name, gguf, Path(ev["free_running_dir"]) if ev.get("free_running_dir") else None,
                                      cfg.profile.batch, batched_rates))
        rows.append(with_engine_rows(scoring_cost(name, gguf, Path(ev["scores_dir"]),
                                                  cfg.model_dir / "reference" / cfg.run.name, lengths_by_suite,
                                                  prompt_rate, row_seconds), gguf, row_cost))
    if vocab is not None:
        select_seconds = extraction_seconds_per_row(vocab, cfg.reference.top_k, select=True)
    rows[:0] = reference_costs(cfg, prompt_rate, batched_rates, select_seconds, row_cost, row_seconds)
    out = {"model": cfg.model.name, "run": cfg.run.name, "top_k": cfg.reference.top_k,
           "row_seconds": row_seconds, "select_row_seconds": select_seconds, "rows": rows}
    write_json(cfg.results_dir / "stage_costs.json", out)
    print(format_costs(out))
    return out


def _not_costed(result: dict | None) -> str | None:
    if result is None:
        return "not evaluated in this run (no result file)"
    if result.get("status") != "ok":
        return f"{result.get('status')}: {result.get('reason')}"
    if not str((result.get("artifact") or {}).get("path", "")).endswith(".gguf"):
        return f"on {result.get('runtime')}, not a GGUF file: llama.cpp's tools time GGUF files only"
    return None


def _settings(manifest: dict) -> dict:
    info = manifest.get("runtime_info") or {}
    return {k: info.get(k) for k in ("threads", "n_batch", "flash_attn", "cache_type_k", "cache_type_v", "kv_unified")}


def reference_costs(cfg: Config, prompt_rate: PromptRate, batched_rates: BatchedRates,
                    select_seconds: float | None, row_cost: RowCost, row_seconds: float | None) -> list[dict]:
    """Per suite, the reference's free-running and log-probs stages beside the tools, where a GGUF file on llama.cpp
    produced them (``reference.producer``) with the run's runtime settings: the log-probs read each transcript once
    and keep every reply position's top-K, whose least arithmetic is a row's normaliser and the selection of its
    top K (``select_seconds`` per row; beside the engine's rows, what the selection adds to the normaliser and
    gather of ``row_seconds``)."""
    from pipeline.compose import variant_of

    base, rows = cfg.model_dir / "reference" / cfg.run.name, []
    for suite in cfg.run.suites:
        label = f"reference {suite}"
        if not (base / suite / "manifest.json").is_file():
            rows.append({"variant": label, "stage": "-", "status": "skipped", "reason": "not built for this run"})
            continue
        producer = read_json(base / suite / "manifest.json").get("producer", "")
        name, _, runtime = producer.partition("@")
        files = sorted((cfg.model_dir / "variants" / name).glob("*.gguf")) if name else []
        if not files or select_seconds is None:
            why = (f"produced by {producer}, not a GGUF file: llama.cpp's tools time GGUF files only" if not files
                   else "no variant of this run was costed (the vocabulary's row arithmetic is timed with them)")
            rows.append({"variant": label, "stage": "-", "status": "skipped", "reason": why})
            continue
        opts = variant_of(cfg, name).runtime_options
        settings = {"threads": cfg.runtime.n_threads, "n_batch": cfg.runtime.n_batch,
                    "flash_attn": cfg.runtime.flash_attn if opts.get("flash_attn") is None else opts["flash_attn"],
                    "cache_type_k": opts.get("cache_type_k", "f16"), "cache_type_v": opts.get("cache_type_v", "f16"),
                    "kv_unified": cfg.runtime.kv_unified}
        rows.append(free_running_cost(label, files[0], base / suite, cfg.profile.batch, batched_rates, settings))
        convs = read_jsonl(base / suite / "transcripts.jsonl")
        read = sum(len(c["ids"]) for c in convs)
        kept = sum(t["end"] - t["start"] for c in convs for t in c["turns"])
        rate = prompt_rate(files[0], settings, round(read / len(convs)))
        tool_s = read / rate + kept * select_seconds
        wall = read_json(base / f"{suite}-logprobs" / "manifest.json")["wall_s"]
        rows.append(with_engine_rows({
            "variant": label, "stage": "log-probs", "status": "ok", "stage_s": wall, "tool_s": tool_s,
            "ratio": wall / tool_s, "work": f"{read:,} tokens read, {kept:,} rows' top-{cfg.reference.top_k}",
            "tool": "llama-bench + numpy rows", "settings": settings, "tokens_read": read, "rows_kept": kept,
            "tool_prompt_tokens_per_s": rate, "file": files[0].name, "producer": producer}, files[0], row_cost,
            max(0.0, select_seconds - row_seconds)))
    return rows


def free_running_cost(name: str, gguf: Path, stage: Path | None, batch: int, batched_rates: BatchedRates,
                      settings: dict | None = None) -> dict:
    """The free-running stage of one variant (or of the reference, with the run's ``settings``: its manifest keeps
    none) beside llama-batched-bench (module docstring)."""
    row = {"variant": name, "stage": "free-running"}
    if stage is None:
        return {**row, "status": "skipped", "reason": "screened out before free-running"}
    manifest = read_json(stage / "manifest.json")
    if manifest.get("reused_reference"):
        return {**row, "status": "skipped", "reason": "its replies are the reference's (no free-running of its own)"}
    by_suite: dict[str, list[dict]] = {}
    for conv in read_jsonl(stage / "transcripts.jsonl"):
        by_suite.setdefault(conv["suite"], []).append(conv)
    settings = settings or _settings(manifest)
    engine_s, prefill, decode, suites = 0.0, 0, 0, {}
    for suite, convs in by_suite.items():
        turns = [t for c in convs for t in c["turns"]]
        p = sum(t.get("prefill_tokens", t["prompt_tokens"]) for t in turns)
        d = sum(t["end"] - t["start"] for t in turns)
        ctx = round(statistics.mean(t["prompt_tokens"] for t in turns))
        reply = max(1, round(d / len(turns)))
        seqs = max(1, min(batch, len(convs)))
        pp, tg = batched_rates(gguf, settings, ctx, reply, seqs)
        s = p / pp + d / tg
        suites[suite] = {"prefill_tokens": p, "decode_tokens": d, "context": ctx, "reply": reply, "sequences": seqs,
                         "tool_prefill_tokens_per_s": pp, "tool_decode_tokens_per_s": tg, "tool_s": s}
        engine_s, prefill, decode = engine_s + s, prefill + p, decode + d
    return {**row, "status": "ok", "stage_s": manifest["wall_s"], "tool_s": engine_s,
            "ratio": manifest["wall_s"] / engine_s if engine_s else None,
            "work": f"{prefill:,} prefilled + {decode:,} decoded tokens", "tool": "llama-batched-bench",
            "settings": settings, "suites": suites}


def transcript_lengths(references: Path, suite: str) -> dict[str, int]:
    """Each reference transcript's length in tokens, by conversation id."""
    return {c["id"]: len(c["ids"]) for c in read_jsonl(references / suite / "transcripts.jsonl")}


def scoring_cost(name: str, gguf: Path, stage: Path, references: Path, lengths_by_suite: dict[str, dict[str, int]],
                 prompt_rate: PromptRate, row_seconds: float) -> dict:
    """The teacher-forced scoring stage of one variant beside llama-bench's prompt processing (module docstring);
    ``lengths_by_suite``: ``transcript_lengths`` per suite, filled as suites are first read (shared by every variant
    of the run)."""
    manifest = read_json(stage / "manifest.json")
    scored = read_json(stage / "teacher_forced.json")
    lengths = []
    positions = 0
    for suite, convs in scored.items():
        if suite not in lengths_by_suite:
            lengths_by_suite[suite] = transcript_lengths(references, suite)
        ids = lengths_by_suite[suite]
        for cid, conv in convs.items():
            lengths.append(ids[cid])
            positions += len(conv["kld"])
        # the exactness check: the sample transcript read once more, its sampled rows against the exact ones
        exact = (manifest.get("kld_exactness") or {}).get(suite)
        if exact:
            lengths.append(ids[exact["sample"].split("/", 1)[1]])
            positions += exact["tokens"]
    settings = _settings(manifest)
    mean_len = round(statistics.mean(lengths))
    rate = prompt_rate(gguf, settings, mean_len)
    tool_s = sum(lengths) / rate + positions * row_seconds
    spans = {"scoring": stage_span(manifest)}
    for suite in scored:
        if span := stage_span(load_manifest(references / f"{suite}-exact_sample")):
            spans[suite] = span
    stage_s = own_seconds(spans)["scoring"]      # the original's exact rows built inside it are not its own work
    nested = max(0.0, manifest["wall_s"] - stage_s)      # the two clocks of a stage built alone differ by rounding
    return {"variant": name, "stage": "scoring", "status": "ok", "stage_s": stage_s, "tool_s": tool_s,
            "ratio": stage_s / tool_s if tool_s else None, "nested_s": nested,
            "work": f"{sum(lengths):,} tokens read, {positions:,} rows scored"
                    + (f" (less {nested:.1f} s of the original's exact rows built inside it)" if nested >= 0.05 else ""),
            "tool": "llama-bench + numpy rows",
            "settings": settings, "tokens_read": sum(lengths), "rows_scored": positions, "mean_transcript": mean_len,
            "tool_prompt_tokens_per_s": rate, "rows_s": positions * row_seconds}


def with_engine_rows(row: dict, gguf: Path, row_cost: RowCost, extra_row_s: float = 0.0) -> dict:
    """A scoring or log-probs ``row`` with the engine's figure for its work beside it: the tokens it read at
    llama-bench's prompt rate plus every row it scored at llama-perplexity's cost of a computed row and
    ``extra_row_s`` (the reference's selection of each row's top K, which llama-perplexity does not do)
    (``engine_rows_s``), and the stage's time over that (``ratio_engine_rows``)."""
    cost = row_cost(gguf, row["settings"])
    scored = row["rows_scored"] if "rows_scored" in row else row["rows_kept"]
    engine = row["tokens_read"] / row["tool_prompt_tokens_per_s"] + scored * (cost["row_s"] + extra_row_s)
    return {**row, "engine_rows_s": engine, "ratio_engine_rows": row["stage_s"] / engine if engine else None,
            "perplexity": cost}


def perplexity_row_seconds(exe: Path, gguf: Path, s: dict, text: str, prompt_rate: PromptRate,
                           timeout: float = 1800) -> dict:
    """llama-perplexity's cost of one computed output row on ``gguf`` with settings ``s``: chunks of 2 x n_batch
    tokens (two decodes each, the second half's n_batch positions computed and normalised), its time per chunk
    from a run of 1 + PERPLEXITY_CHUNKS chunks less a run of one (the same load and tokenization of ``text``),
    less llama-bench's prompt processing of as many tokens, over the rows a chunk computes."""
    import subprocess
    import tempfile

    from pipeline.infra.child_processes import child_options

    n_batch, threads = int(s["n_batch"]), int(s["threads"])
    ctx, counts = 2 * n_batch, (1, 1 + PERPLEXITY_CHUNKS)
    args = [str(exe), "-m", str(gguf), "-c", str(ctx), "-b", str(n_batch), "-ub", str(n_batch), "-t", str(threads),
            "-tb", str(threads), "-fa", "on" if s["flash_attn"] else "off", "-ctk", s["cache_type_k"] or "f16",
            "-ctv", s["cache_type_v"] or "f16", "-ngl", "0"]
    walls = {}
    with tempfile.TemporaryDirectory(prefix="quantdrift-ppl-") as folder:
        path = Path(folder) / "text.txt"
        # at most one token per 16 characters is assumed: enough tokens for the longer run whatever the tokenizer
        path.write_text(text * (1 + 16 * counts[-1] * ctx // max(len(text), 1)), encoding="utf-8")
        for chunks in counts:
            cmd = args + ["-f", str(path), "--chunks", str(chunks)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **child_options())
            walls[chunks] = time.perf_counter() - start
            if proc.returncode != 0 or "Final estimate" not in proc.stdout + proc.stderr:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
                raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    chunk_s = (walls[counts[1]] - walls[counts[0]]) / PERPLEXITY_CHUNKS
    prompt_s = ctx / prompt_rate(gguf, s, ctx)
    return {"row_s": max(0.0, chunk_s - prompt_s) / n_batch, "chunk_s": chunk_s, "chunk_tokens": ctx,
            "chunk_rows": n_batch, "prompt_s": prompt_s, "wall_s": walls}


def extraction_seconds_per_row(vocab: int, top_k: int, select: bool = False, rows: int = 256,
                               repeats: int = 5) -> float:
    """The least work scoring does per row beyond the engine: a float32 row's log-softmax normaliser and the gather
    of ``top_k`` candidates (``select``: the reference's selection of its top ``top_k`` first), in numpy; the median
    of ``repeats`` timings of ``rows`` rows, per row."""
    import numpy as np

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    cand = rng.integers(0, vocab, (rows, top_k))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        top = logits.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        if select:
            k = min(top_k, vocab)
            cand = np.argpartition(logits, vocab - k, axis=1)[:, vocab - k:]
        np.take_along_axis(logits, cand, axis=1) - lse[:, None]
        times.append(time.perf_counter() - t)
    return statistics.median(times) / rows


def _llama_bench_rate(cfg: Config) -> PromptRate:
    from pipeline.commands.llama_bench import run_llama_bench
    from pipeline.infra.llama_tools import tool

    def rate(gguf: Path, s: dict, prompt: int) -> float:
        out = run_llama_bench(tool("llama-bench", cfg.bench.llama_tools), gguf, s["threads"], s["n_batch"],
                              bool(s["flash_attn"]), (s["cache_type_k"], s["cache_type_v"]), prompt, 1)
        return out["prefill_tokens_per_s"]

    return rate


def _perplexity_row_cost(cfg: Config, prompt_rate: PromptRate) -> RowCost:
    """``perplexity_row_seconds`` once per file and settings, on the text of the run's suites (read once)."""
    import functools

    from pipeline.infra.llama_tools import tool
    from pipeline.suites.records import load_suite

    done: dict[tuple, dict] = {}

    @functools.cache
    def text() -> str:
        out = "\n\n".join("\n".join([c.system or ""] + [t.user for t in c.turns])
                           for suite in cfg.selected_suites() if not suite.generate
                           for c in load_suite(suite.name, suite.path))
        if not out.strip():
            raise ValueError("stage costs: the run's suites hold no text for llama-perplexity to read "
                             f"(suites {cfg.run.suites})")
        return out

    def cost(gguf: Path, s: dict) -> dict:
        key = (str(gguf), tuple(sorted(s.items())))
        if key not in done:
            done[key] = perplexity_row_seconds(tool("llama-perplexity", cfg.bench.llama_tools), gguf, s, text(),
                                               prompt_rate)
        return done[key]

    return cost


def _batched_bench_rates(cfg: Config) -> BatchedRates:
    from pipeline.instruments.batched_bench import run_llama_batched_bench
    from pipeline.infra.llama_tools import tool

    def rates(gguf: Path, s: dict, prompt: int, reply: int, sequences: int) -> tuple[float, float]:
        runs = [run_llama_batched_bench(tool("llama-batched-bench", cfg.bench.llama_tools), gguf, s["threads"],
                                        s["n_batch"], bool(s["flash_attn"]), prompt, reply, [sequences],
                                        (s["cache_type_k"], s["cache_type_v"]),
                                        kv_unified=bool(s["kv_unified"]))[sequences]
                for _ in range(BATCHED_REPETITIONS)]
        return (statistics.median(r["prefill_tokens_per_s"] for r in runs),
                statistics.median(r["decode_tokens_per_s"] for r in runs))

    return rates


def format_costs(out: dict) -> str:
    lines = [f"stage costs of run {out['run']} ({out['model']}) beside llama.cpp's tools on this machine now",
             "| variant | stage | work | stage s | tool s | stage / tool | tool with every scored row s "
             "(llama-perplexity's rows) | stage / that |", "|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['stage']} | not costed: {r['reason']} | | | | | |")
            continue
        rows = (f"{r['engine_rows_s']:.1f} | {r['ratio_engine_rows']:.2f}" if r.get("engine_rows_s")
                else " | ")
        lines.append(f"| {r['variant']} | {r['stage']} | {r['work']} | {r['stage_s']:.1f} | {r['tool_s']:.1f} "
                     f"| {r['ratio']:.2f} | {rows} |")
    return "\n".join(lines)
