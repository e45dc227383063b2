"""`make bench`, batched decoding: the pipeline's batched llama.cpp path (``LlamaCppRuntime.generate_many``, what
``profile.batch`` > 1 uses for free-running) against llama.cpp's own ``llama-batched-bench`` built from the same
vendored source, on the same GGUF file, threads, batch size, flash-attention setting, KV layout (one buffer for
all sequences, or one stream each: ``runtime.kv_unified``), prompt and reply lengths and numbers of sequences.

Per round (``bench.batched_rounds`` of them, interleaved, so drift in the machine's speed hits every path alike):
llama-batched-bench over every number of sequences, then our single-sequence path (``generate``, what
``profile.batch=1`` uses), then our batched path at every number of sequences. The figure compared is the speed-up
of aggregate decode tokens/s over single-sequence decoding, ours against llama-batched-bench's, taken round by round
(both sides of a round share the machine's state) and reported as the median over rounds with its order-statistic
range; the target (``bench.min_ratio``) is met where the whole range lies at or above it, missed where it lies
below, and undecided where the range straddles it. Our prompts are real business text (distinct windows of the
suites' turns); llama-batched-bench feeds random ids: decode cost does not depend on which ids are fed. Also
measured: the greedy tokens of the batched path against single-sequence decoding on the same prompts (batched float
arithmetic may differ in the last bits) and whether two batched runs give the same tokens. The agreement is measured
two ways: free running (each path continues its own tokens, so one early difference changes every later position;
also counted as whole sequences identical), and after the same history (the batched path decodes on single-sequence
decoding's tokens and its pick at every position is compared with single's: how often the last bits change a
choice).
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
from pathlib import Path

from pipeline.infra.child_processes import child_options
from pipeline.figures.stats import median_interval

log = logging.getLogger(__name__)


def parse_batched_bench(text: str) -> dict[int, dict]:
    """llama-batched-bench --output-format jsonl: {sequences: {"decode_tokens_per_s", "prefill_tokens_per_s",
    "pp", "tg"}} from its JSON lines (log lines around them are ignored)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        row = json.loads(line)
        out[int(row["pl"])] = {"decode_tokens_per_s": float(row["speed_tg"]),
                               "prefill_tokens_per_s": float(row["speed_pp"]), "pp": int(row["pp"]),
                               "tg": int(row["tg"]),
                               # output tokens over the whole wall (prefill included), as a served level counts them
                               "output_tokens_per_s": int(row["pl"]) * int(row["tg"]) / float(row["t"])
                               if float(row.get("t") or 0) > 0 else None}
    return out


def run_llama_batched_bench(exe: Path, gguf: Path, threads: int, n_batch: int, flash_attn: bool, prompt: int,
                            gen: int, sequences: list[int], cache_types: tuple[str, str] = ("f16", "f16"),
                            timeout: float = 900, kv_unified: bool = False) -> dict[int, dict]:
    """One llama-batched-bench run over every number of sequences: one KV buffer for all (``kv_unified``, as our
    batched context by default) or one KV stream per sequence (as llama-server with ``-np N``)."""
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-ctk", cache_types[0], "-ctv", cache_types[1],
           "-c", str(max(sequences) * (prompt + gen)), "-b", str(n_batch), "-ub", str(n_batch),
           "-fa", "on" if flash_attn else "off", "-kvu" if kv_unified else "-no-kvu", "-ngl", "0",
           "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(str(n) for n in sequences),
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **child_options())
    rows = parse_batched_bench(proc.stdout + "\n" + proc.stderr)
    missing = [n for n in sequences if n not in rows]
    if proc.returncode != 0 or missing:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"llama-batched-bench failed (exit {proc.returncode}; no result for {missing} "
                           f"sequences): {' '.join(cmd)}\n{tail}")
    return rows


def bench_prompts(renderer, suites: dict, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``length`` tokens: consecutive windows of the suites' turns as text."""
    from pipeline.suites.records import probe_prompt

    ids = probe_prompt(renderer, suites, n * length)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def _aggregate_decode(gens) -> float:
    """Aggregate decode tokens/s of generations decoded together: tokens fed back / wall time of the steps (every
    sequence of one batched call shares each step's time, so one sequence's step times are the wall)."""
    steps = sum(len(g.decode_times_s) for g in gens)
    wall = max(sum(g.decode_times_s) for g in gens)
    return steps / wall if wall > 0 else float("nan")


def agreement(single: list[list[int]], batched: list[list[int]]) -> float:
    """Share of reply positions where the batched path's greedy token equals single-sequence decoding's."""
    same = sum(a == b for s, b_ids in zip(single, batched) for a, b in zip(s, b_ids))
    return same / max(1, sum(len(s) for s in single))


def first_differences(single: list[list[int]], batched: list[list[int]]) -> list[int | None]:
    """Per sequence, the first reply position where the two paths' tokens differ (None: identical)."""
    out: list[int | None] = []
    for s, b in zip(single, batched):
        d = next((k for k, (x, y) in enumerate(zip(s, b)) if x != y), None)
        out.append(d if d is not None or len(s) == len(b) else min(len(s), len(b)))
    return out


def compare_batched(cfg, variant, gguf: Path, prompts: list[list[int]]) -> dict:
    """The comparison itself (see the module docstring): ``variant`` loaded on ``gguf`` (a llama.cpp variant without
    a quantized KV cache is what llama-batched-bench runs by default). ``prompts``: at least max(bench.sequences)."""
    from pipeline.infra.llama_tools import tool
    from pipeline.runtimes import load_runtime

    b = cfg.bench
    seqs = sorted(set(b.sequences))
    top = max(seqs)
    if len(prompts) < top:
        raise ValueError(f"compare_batched: {len(prompts)} prompts for up to {top} sequences")
    exe = tool("llama-batched-bench", b.llama_tools)
    # n_ctx at least n_batch: llama-cpp-python clips n_batch to n_ctx, and llama-batched-bench gets the same n_batch
    rt = load_runtime(variant, gguf, cfg, n_ctx=max(256, cfg.runtime.n_batch, b.prompt_tokens + b.gen_tokens + 8))
    info = dict(rt.info)
    threads, n_batch, flash = info["threads"], info["n_batch"], info["flash_attn"]
    rounds = []
    single_ids: list[list[int]] = []
    batched_ids: dict[int, list[list[list[int]]]] = {n: [] for n in seqs}
    try:
        # greedy tokens of single-sequence decoding for every prompt (untimed; the agreement's baseline)
        for p in prompts[:top]:
            rt.reset()
            single_ids.append(rt.generate(p, b.gen_tokens, []).ids)
        rt.generate_many([(i, prompts[i], 2) for i in range(top)], [], slots=top)    # warm-up, builds the context
        for r in range(b.batched_rounds):
            tool_rows = run_llama_batched_bench(exe, gguf, threads, n_batch, flash, b.prompt_tokens, b.gen_tokens,
                                                seqs, (info["cache_type_k"], info["cache_type_v"]),
                                                kv_unified=info["kv_unified"])
            k = r % top
            rt.reset()
            single = _aggregate_decode([rt.generate(prompts[k], b.gen_tokens, [])])
            ours = {}
            for n in seqs:
                rt.reset()
                gens = rt.generate_many([(i, prompts[i], b.gen_tokens) for i in range(n)], [], slots=top)
                ours[n] = _aggregate_decode(gens)
                batched_ids[n].append([g.ids for g in gens])
            rounds.append({"tool": {n: tool_rows[n]["decode_tokens_per_s"] for n in seqs},
                           "single": single, "batched": ours})
        # untimed: the batched path on single-sequence decoding's tokens, its pick at every position after the
        # same history
        same_history = {}
        for n in seqs:
            rt.reset()
            gens = rt.generate_many([(i, prompts[i], len(single_ids[i])) for i in range(n)], [], slots=top,
                                    forced=single_ids[:n])
            same_history[n] = [g.ids for g in gens]
    finally:
        rt.close()
    med = statistics.median
    tool1 = med(x["tool"][min(seqs)] for x in rounds) if 1 in seqs else None
    single = med(x["single"] for x in rounds)
    rows = {}
    for n in seqs:
        ours_n = med(x["batched"][n] for x in rounds)
        tool_n = med(x["tool"][n] for x in rounds)
        ours_up = med(x["batched"][n] / x["single"] for x in rounds)
        tool_up = med(x["tool"][n] / x["tool"][1] for x in rounds) if 1 in seqs else None
        # the ratio of the speed-ups round by round (both sides of a round share the machine's state), its median
        # and order-statistic interval over rounds: the target is judged on the interval, never inside the noise
        paired = median_interval([(x["batched"][n] / x["single"]) / (x["tool"][n] / x["tool"][1])
                                  for x in rounds]) if 1 in seqs else None
        rows[n] = {
            "decode_tokens_per_s": ours_n, "speedup": ours_up,
            "tool_decode_tokens_per_s": tool_n, "tool_speedup": tool_up,
            "ratio": paired["estimate"] if paired else None, "ratio_interval": paired,
            "verdict": ratio_verdict(paired, b.min_ratio) if n > 1 and paired else None,
            "agreement": agreement(single_ids[:n], batched_ids[n][0]),
            "agreement_same_history": agreement(single_ids[:n], same_history[n]),
            "first_difference": first_differences(single_ids[:n], batched_ids[n][0]),
            "deterministic": all(run == batched_ids[n][0] for run in batched_ids[n]),
            "rounds": {"ours": [x["batched"][n] for x in rounds], "tool": [x["tool"][n] for x in rounds]},
        }
    verdicts = [rows[n]["verdict"] for n in seqs if rows[n]["verdict"]]
    return {
        "variant": b.batched_variant, "file": gguf.name, "threads": threads, "n_batch": n_batch,
        "flash_attn": flash, "kv_unified": info["kv_unified"], "prompt_tokens": b.prompt_tokens,
        "gen_tokens": b.gen_tokens, "rounds": b.batched_rounds,
        "single_decode_tokens_per_s": single, "tool_single_decode_tokens_per_s": tool1,
        "single_rounds": [x["single"] for x in rounds], "sequences": {str(n): rows[n] for n in seqs},
        "min_ratio": b.min_ratio,
        # fails when one count's interval lies below the target, meets when every one lies at or above it
        "verdict": (None if not verdicts else "fails" if "fails" in verdicts
                    else "meets" if set(verdicts) == {"meets"} else "undecided"),
        "min_agreement": min(rows[n]["agreement"] for n in seqs),
        "min_agreement_same_history": min(rows[n]["agreement_same_history"] for n in seqs),
        "tool": str(exe),
    }


def ratio_verdict(interval: dict, target: float) -> str:
    """meets: the interval of the speed-up ratio lies at or above the target; fails: wholly below; undecided: it
    straddles the target (a difference inside the rounds' spread decides nothing)."""
    if interval["low"] >= target:
        return "meets"
    return "fails" if interval["high"] < target else "undecided"


def format_batched(out: dict) -> str:
    lines = [f"batched decoding, {out['variant']} ({out['file']}): {out['threads']} threads, n_batch "
             f"{out['n_batch']}, flash attention {'on' if out['flash_attn'] else 'off'}, "
             f"{'one KV buffer for all sequences' if out.get('kv_unified') else 'one KV stream per sequence'}, "
             f"{out['prompt_tokens']}-token "
             f"prompts + {out['gen_tokens']} generated, median of {out['rounds']} interleaved rounds",
             f"  single-sequence path (generate): {out['single_decode_tokens_per_s']:.1f} tok/s decode",
             f"{'  sequences':<13}{'ours tok/s':>11}{'speed-up':>10}{'llama-batched-bench':>21}{'speed-up':>10}"
             f"{'ratio [range]':>20}{'same tokens: free running':>27}{'same history':>14}{'same twice':>12}"]
    # bench.json stores the counts as string keys, which a JSON round trip may sort as strings ("16" before "4")
    for n, r in sorted(out["sequences"].items(), key=lambda kv: int(kv[0])):
        iv = r.get("ratio_interval")
        span = f" [{iv['low']:.2f}-{iv['high']:.2f}]" if iv else ""
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}{span}"
        tool_up = "-" if r["tool_speedup"] is None else f"{r['tool_speedup']:.2f}x"
        firsts = r.get("first_difference")
        whole = "" if firsts is None else f" ({sum(d is None for d in firsts)}/{len(firsts)} seqs)"
        free = f"{r['agreement']:.1%}{whole}"
        hist = r.get("agreement_same_history")
        hist = "-" if hist is None else f"{hist:.2%}"
        lines.append(f"  {n:<11}{r['decode_tokens_per_s']:>11.1f}{r['speedup']:>9.2f}x"
                     f"{r['tool_decode_tokens_per_s']:>21.1f}{tool_up:>10}{ratio:>20}{free:>27}{hist:>14}"
                     f"{'yes' if r['deterministic'] else 'NO':>12}")
    hist = out.get("min_agreement_same_history")
    hist = "-" if hist is None else f"{hist:.2%}"
    undecided = [n for n, r in sorted(out["sequences"].items(), key=lambda kv: int(kv[0]))
                 if r.get("verdict") == "undecided"]
    verdict = {"meets": "yes", "fails": "NO", None: "not judged"}.get(
        out.get("verdict"), f"undecided (the range straddles {out['min_ratio']} at {', '.join(undecided)} "
                            "sequences)")
    lines.append(f"  speed-up ratio >= {out['min_ratio']} at every number of sequences > 1: "
                 f"{verdict}; lowest token agreement free running "
                 f"{out['min_agreement']:.2%}, after the same history {hist}")
    return "\n".join(lines)
