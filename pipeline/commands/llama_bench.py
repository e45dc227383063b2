"""`make bench`: per variant, decode and prefill tokens/s measured through the pipeline's probe, teacher-forced
scoring tokens/s, and the wall time of every stage that built the comparison. Numbers are for the notes and
for trends on one machine; no test asserts absolute timings.
"""

from __future__ import annotations

import logging
import time

from pipeline.config.schema import Config
from pipeline.compose import variant_of
from pipeline.infra.files import write_json
from pipeline.infra.llama_tools import parse_llama_bench

log = logging.getLogger(__name__)


def _stage_walls(cfg: Config, name: str) -> dict:
    from pipeline.decide.stage_times import reference_stages, variant_stages

    out = variant_stages(cfg, name)
    out.update({f"reference_{suite}": w for suite, w in reference_stages(cfg).items()})
    return out


def run_bench(cfg: Config) -> int:
    import dataclasses

    from pipeline.suites.conversation import ChatRenderer
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.reference import n_ctx_for, reply_positions
    from pipeline.runtimes import load_runtime
    from pipeline.stages.suite_files import load_suites
    from pipeline.commands.variant_job import evaluate_job
    from pipeline.stages.variant_setup import setup_reference
    from pipeline.suites.records import probe_prompt

    names = cfg.run.variants or [cfg.variant.name]
    original = prepare(cfg.model, cfg.model_dir)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    suites = load_suites(cfg, original, renderer)
    refs, producer, _ = setup_reference(cfg, original, renderer, suites)
    longest = max((tr for r in refs.values() for tr in r.transcripts), key=lambda tr: len(tr["ids"]))
    positions = reply_positions(longest)[0].tolist()
    prompt = probe_prompt(renderer, suites, cfg.profile.speed.prompt_tokens)
    rows = {}
    for name in names:
        variant = variant_of(cfg, name)
        vcfg = dataclasses.replace(cfg, variant=variant, command="evaluate")
        t0 = time.perf_counter()
        result = evaluate_job(vcfg)   # cached when `make compare` already ran
        if result["status"] != "ok":
            rows[name] = {"status": result["status"], "reason": result.get("reason")}
            continue
        artifact = build_artifact(variant, original, vcfg)
        speed, tool_row = _probe_beside_llama_bench(vcfg, variant, artifact, prompt)
        rt = load_runtime(variant, artifact.path, vcfg,
                          n_ctx=n_ctx_for(len(longest["ids"]) + 8, original.facts.get("context_length")))
        rt.score(longest["ids"], positions[:1], [[0]])   # warm-up
        t = time.perf_counter()
        rt.score(longest["ids"], positions, [[0]] * len(positions))
        score_s = time.perf_counter() - t
        rt.close()
        rows[name] = {
            "status": "ok",
            "decode_tokens_per_s": speed["decode_tokens_per_s"],
            "prefill_tokens_per_s": speed["prefill_tokens_per_s"],
            "ttft_s": speed["ttft_s"],
            "cpu_noise": speed["cpu_noise"],
            "scoring_tokens_per_s": len(longest["ids"]) / score_s,
            "scored_sequence_tokens": len(longest["ids"]),
            "stage_wall_s": _stage_walls(vcfg, name),
            "llama_bench": tool_row,
            "bench_wall_s": time.perf_counter() - t0,
        }
    out = {"model": cfg.model.name, "run": cfg.run.name, "threads": cfg.runtime.n_threads, "variants": rows}
    if cfg.bench.batched_variant:
        out["batched"] = _batched(cfg, original, renderer, suites)
    out["served"] = _served_beside_batched_bench(cfg, original, renderer, suites)
    write_json(cfg.results_dir / "bench.json", out)
    print(format_bench(out))
    return 0


LLAMA_BENCH_REPETITIONS = 5      # llama-bench's own default (-r); the probe repeats as many times beside it


def run_llama_bench(exe, gguf, threads: int, n_batch: int, flash_attn: bool, cache_types: tuple[str, str],
                    prompt: int, gen: int, repetitions: int = LLAMA_BENCH_REPETITIONS, timeout: float = 900) -> dict:
    """llama-bench on the pipeline's own file and settings, as the speed probe measures: prefill of ``prompt``
    tokens (pp) and decode of ``gen`` tokens after a ``prompt``-token context (tg at depth ``prompt``). Figures are
    the medians of the tool's per-repetition samples, as the probe's are medians of its repeats."""
    import statistics
    import subprocess

    from pipeline.infra.child_processes import child_options

    common = [str(exe), "-m", str(gguf), "-t", str(threads), "-b", str(n_batch), "-ub", str(n_batch),
              "-fa", "on" if flash_attn else "off", "-ctk", cache_types[0], "-ctv", cache_types[1], "-ngl", "0",
              "-r", str(repetitions), "-o", "jsonl"]
    out = {}
    for label, extra in (("pp", ["-p", str(prompt), "-n", "0"]), ("tg", ["-p", "0", "-n", str(gen), "-d", str(prompt)])):
        proc = subprocess.run(common + extra, capture_output=True, text=True, timeout=timeout, **child_options())
        rows = parse_llama_bench(proc.stdout)
        if proc.returncode != 0 or not rows:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {' '.join(common + extra)}\n{tail}")
        samples = rows[0].get("samples_ts") or [rows[0]["avg_ts"]]
        out[label] = {"tokens_per_s": float(statistics.median(samples)), "mean": float(rows[0]["avg_ts"]),
                      "stddev": float(rows[0]["stddev_ts"]), "samples": samples}
    return {"prefill_tokens_per_s": out["pp"]["tokens_per_s"], "decode_tokens_per_s": out["tg"]["tokens_per_s"],
            "detail": out, "prompt_tokens": prompt, "gen_tokens": gen, "depth": prompt}


def _probe_beside_llama_bench(cfg: Config, variant, artifact, prompt: list[int]) -> tuple[dict, dict | None]:
    """The pipeline's speed probe for one variant and, for a GGUF file, llama-bench beside it on the same file,
    threads, batch, flash attention, KV types, prompt length and decode depth.

    The two alternate over ``bench.rounds`` rounds (probe trial, then llama-bench), the probe repeating as often
    as llama-bench does (``LLAMA_BENCH_REPETITIONS``), so that a slow spell of a shared machine lands on both
    sides. Each side's figure is the median over rounds; the ratio ours / llama-bench is the median of the
    per-round ratios, with their range. The second value is None where the artifact is no GGUF file and carries
    the reason when the tool is not built or fails."""
    import dataclasses
    import statistics

    from pipeline.infra.errors import ConfigError
    from pipeline.infra.llama_tools import tool
    from pipeline.instruments.probe import probe_speed
    from pipeline.runtimes.llamacpp import gguf_file

    try:
        gguf = gguf_file(artifact.path)        # llama-bench runs GGUF files
    except ConfigError:
        return probe_speed(cfg, variant, artifact, prompt), None
    try:
        exe = tool("llama-bench", cfg.bench.llama_tools)
    except ConfigError as exc:
        return probe_speed(cfg, variant, artifact, prompt), {"status": "skipped", "reason": str(exc)}
    from pipeline.servers.llama_server import serve_settings

    st = serve_settings(cfg, variant)
    sp = cfg.profile.speed
    pcfg = dataclasses.replace(cfg, profile=dataclasses.replace(
        cfg.profile, speed=dataclasses.replace(sp, repeats=LLAMA_BENCH_REPETITIONS)))
    ours, tools = [], []
    for _ in range(cfg.bench.rounds):
        ours.append(probe_speed(pcfg, variant, artifact, prompt))
        try:
            tools.append(run_llama_bench(exe, gguf, st["threads"], st["n_batch"], st["flash_attn"],
                                         (st["cache_type_k"], st["cache_type_v"]), sp.prompt_tokens, sp.decode_tokens))
        except (RuntimeError, OSError) as exc:
            return ours[-1], {"status": "failed", "reason": str(exc)}

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key)]
        return float(statistics.median(vals)) if vals else None

    speed = dict(ours[len(ours) // 2])      # memory and the other fields from one trial; speeds are medians
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s"):
        speed[key] = med(ours, key)
    speed["cpu_noise"] = max((o["cpu_noise"] for o in ours if o.get("cpu_noise") is not None), default=None)
    row = {"status": "ok", "rounds": len(tools), "repetitions": LLAMA_BENCH_REPETITIONS,
           "prompt_tokens": sp.prompt_tokens, "gen_tokens": sp.decode_tokens, "depth": sp.prompt_tokens,
           "decode_tokens_per_s": med(tools, "decode_tokens_per_s"),
           "prefill_tokens_per_s": med(tools, "prefill_tokens_per_s"),
           "detail": [t["detail"] for t in tools]}
    for side in ("decode", "prefill"):
        key = f"{side}_tokens_per_s"
        per_round = [o[key] / t[key] for o, t in zip(ours, tools) if o.get(key) and t.get(key)]
        row[f"{side}_ratio"] = float(statistics.median(per_round)) if per_round else None
        row[f"{side}_ratio_range"] = [min(per_round), max(per_round)] if per_round else None
        row[f"{side}_ours_per_round"] = [o.get(key) for o in ours]
        row[f"{side}_tool_per_round"] = [t.get(key) for t in tools]
    return speed, row


def _served_beside_batched_bench(cfg: Config, original, renderer, suites: dict, generate=None) -> dict | None:
    """Every GGUF variant served as the load sweep serves it (a fresh llama-server, the sweep's levels at its first
    depth, ``load`` settings) next to llama-batched-bench at the same N, threads, batch, flash attention, KV types,
    prompt (the depth) and output length: N x output tokens over the tool's whole wall, prefill included, as a
    served level counts them. The two alternate over ``bench.rounds`` rounds (served trial, then the tool), the
    variants rotated by one place a round, so a slow spell of the machine lands on both sides of a ratio. Per level:
    each side's median over rounds and the median of the per-round ratios, with their range. The tool decodes in
    lockstep with no HTTP, scheduling or tokenization: the ratio is what serving costs on top of the engine's own
    batched decoding. None where ``bench.served`` is off; skipped, with the reason, where a tool is not built."""
    import dataclasses
    import statistics
    import subprocess

    from pipeline.stages import load
    from pipeline.instruments.batched_bench import run_llama_batched_bench
    from pipeline.servers.llama_server import LlamaServer, engine_version
    from pipeline.infra.errors import ConfigError, Skip
    from pipeline.infra.llama_tools import tool

    if not cfg.bench.served:
        return None
    try:
        server_exe = tool("llama-server", cfg.bench.llama_tools)
        exe = tool("llama-batched-bench", cfg.bench.llama_tools)
    except ConfigError as exc:
        return {"status": "skipped", "reason": str(exc)}
    if generate is None:
        from pipeline.instruments.loadgen import run_guidellm as generate
    lc = dataclasses.replace(cfg.load, stop_past_knee=False)   # the same levels in every round
    depth = lc.depths[0]
    gpu = cfg.runtime.device.startswith("cuda")
    budget_mb = load.memory_budget_mb(cfg, gpu)
    plans, rows = {}, {}
    for name in cfg.run.variants or [cfg.variant.name]:
        try:
            plan = load.plan_variant(cfg, name, original, [depth], budget_mb)
        except (Skip, ConfigError) as exc:
            rows[name] = {"status": "skipped", "reason": str(exc)}
            continue
        if plan["engine"] is not LlamaServer:
            rows[name] = {"status": "skipped", "reason": f"served by {plan['engine'].name}: llama-batched-bench "
                                                         "runs llama.cpp's GGUF files only"}
            continue
        plans[name] = plan
    if not plans:
        return {"status": "skipped", "reason": "no variant is served by llama-server",
                "depth": depth, "variants": rows}
    version = engine_version(server_exe)
    for plan in plans.values():
        plan["version"] = version
    prompts = {depth: load.load_prompts(renderer, suites, depth, load.trial_prompts(plans, lc))}
    logs = cfg.model_dir / "runs" / cfg.run.name / "bench-logs"
    rounds: dict[str, list] = {name: [] for name in plans}
    order = list(plans)
    for r in range(cfg.bench.rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            plan, st = plans[name], plans[name]["settings"]
            log.info("bench: round %d/%d: %s served at %s, then llama-batched-bench", r + 1, cfg.bench.rounds,
                     name, plan["levels"])
            try:
                trial = load.serve_trial(plan, [depth], prompts, lc, gpu, generate, logs / f"{name}.r{r}.log")
                served = {int(x["concurrency"]): x for x in trial["depths"][str(depth)]}
                tool_rows = run_llama_batched_bench(exe, plan["served"], st["threads"], st["n_batch"], st["flash_attn"],
                                                    depth, plan["output_tokens"], plan["levels"],
                                                    (st["cache_type_k"], st["cache_type_v"]))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:    # reported; the others go on
                log.error("bench: served comparison of %s failed: %s", name, exc)
                rounds[name].append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            rounds[name].append({"cpu_noise": trial.get("cpu_noise"), "levels": {
                c: (served[c]["output_tokens_per_s"] if c in served else None, tool_rows[c]["output_tokens_per_s"])
                for c in plan["levels"]}})

    def med(xs):
        xs = [x for x in xs if x]
        return float(statistics.median(xs)) if xs else None

    for name, plan in plans.items():
        good = [t for t in rounds[name] if "error" not in t]
        if not good:
            rows[name] = {"status": "failed", "reason": rounds[name][0]["error"]}
            continue
        per = {}
        for c in plan["levels"]:
            pairs = [t["levels"][c] for t in good]
            ratios = [ours / theirs for ours, theirs in pairs if ours and theirs]
            per[str(c)] = {"served_output_tokens_per_s": med([o for o, _ in pairs]),
                           "tool_output_tokens_per_s": med([t for _, t in pairs]),
                           "ratio": med(ratios), "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                           "served_per_round": [o for o, _ in pairs], "tool_per_round": [t for _, t in pairs]}
        rows[name] = {"status": "ok", "rounds": len(good), "errors": [t["error"] for t in rounds[name] if "error" in t],
                      "cpu_noise_rounds": [t["cpu_noise"] for t in good], "settings": plan["settings"],
                      "engine_version": version, "levels": per}
    return {"status": "ok", "depth": depth, "output_tokens": load.output_tokens(cfg), "rounds": cfg.bench.rounds,
            "min_ratio": cfg.bench.min_ratio, "variants": rows}


def _batched(cfg: Config, original, renderer, suites: dict) -> dict:
    """The batched path against llama-batched-bench (pipeline.instruments.batched_bench); skipped, with the reason, where
    the variant is not a llama.cpp one or the tool is not built."""
    import dataclasses

    from pipeline.instruments.batched_bench import bench_prompts, compare_batched
    from pipeline.infra.errors import ConfigError, Skip
    from pipeline.stages.quantize import build_artifact
    from pipeline.runtimes import runtime_class
    from pipeline.runtimes.llamacpp import gguf_file

    name = cfg.bench.batched_variant
    try:
        variant = variant_of(cfg, name)
        if not runtime_class(variant.runtime).batched:
            raise ConfigError(f"bench.batched_variant={name!r} runs on {variant.runtime!r}, which does not batch "
                              "sequences: the comparison with llama-batched-bench needs a llama.cpp variant")
        artifact = build_artifact(variant, original, dataclasses.replace(cfg, variant=variant))
        prompts = bench_prompts(renderer, suites, max(cfg.bench.sequences), cfg.bench.prompt_tokens)
        return {"status": "ok", **compare_batched(cfg, variant, gguf_file(artifact.path), prompts)}
    except (ConfigError, Skip) as exc:
        log.warning("batched comparison skipped: %s", exc)
        return {"status": "skipped", "variant": name, "reason": str(exc)}


def format_bench(out: dict) -> str:
    head = (f"{'variant':<22}{'decode tok/s':>13}{'prefill tok/s':>14}{'score tok/s':>12}{'noise':>7}  "
            "stage wall s (prepare/convert/quantize/parity/reference/free-running/scoring)")
    lines = [f"quantdrift bench: {out['model']} ({out['run']}), {out['threads']} threads", head]
    for name, r in out["variants"].items():
        if r["status"] != "ok":
            lines.append(f"{name:<22}{r['status']}: {r.get('reason')}")
            continue
        w = r["stage_wall_s"]
        ref = sum(v for k, v in w.items() if k.startswith("reference_") and v)
        fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        stages = "/".join(fmt(x) for x in (w["prepare"], w["convert_f16"], w["quantize"], w["parity"], ref,
                                           w["free_running"], w["scoring"]))
        noise = "-" if r["cpu_noise"] is None else f"{r['cpu_noise']:.0%}"
        lines.append(f"{name:<22}{r['decode_tokens_per_s']:>13.1f}{r['prefill_tokens_per_s']:>14.0f}"
                     f"{r['scoring_tokens_per_s']:>12.0f}{noise:>7}  {stages}")
    tool_rows = {n: r["llama_bench"] for n, r in out["variants"].items() if r.get("llama_bench")}
    if tool_rows:
        lines.append("")
        rounds = next((t.get("rounds") for t in tool_rows.values() if t.get("rounds")), 1)
        lines.append("single stream against llama-bench (same file, threads, batch, flash attention, KV types; decode "
                     f"at the probe's depth; {rounds} interleaved rounds of {LLAMA_BENCH_REPETITIONS} repetitions a "
                     "side), ratio = ours / llama-bench, median of the rounds [range]:")
        lines.append(f"  {'variant':<22}{'decode ours':>12}{'llama-bench tg':>16}{'ratio':>7}{'prefill ours':>14}"
                     f"{'llama-bench pp':>16}{'ratio':>7}")
        for name, t in tool_rows.items():
            r = out["variants"][name]
            if t["status"] != "ok":
                lines.append(f"  {name:<22}llama-bench {t['status']}: {t['reason']}")
                continue
            span = lambda k: ("" if not t.get(k) else f" [{t[k][0]:.2f}-{t[k][1]:.2f}]")  # noqa: E731
            lines.append(f"  {name:<22}{r['decode_tokens_per_s']:>12.1f}{t['decode_tokens_per_s']:>16.1f}"
                         f"{t['decode_ratio']:>7.2f}{span('decode_ratio_range')}{r['prefill_tokens_per_s']:>14.0f}"
                         f"{t['prefill_tokens_per_s']:>16.0f}{t['prefill_ratio']:>7.2f}{span('prefill_ratio_range')}")
    served = out.get("served")
    if served and served.get("status") == "ok":
        lines.append("")
        lines.append(f"served (llama-server under guidellm) against llama-batched-bench at the same N (context "
                     f"{served['depth']}, {served['output_tokens']} output tokens per request; output tok/s over the "
                     f"whole wall, prefill included; {served.get('rounds', 1)} interleaved rounds), served / tool = "
                     "ratio, median of the rounds [range]:")
        for name, r in served["variants"].items():
            if r["status"] != "ok":
                lines.append(f"  {name:<22}{r['status']}: {r['reason']}")
                continue
            cells = []
            for c, x in r["levels"].items():
                if x["ratio"] is None:
                    cells.append(f"N={c}: -")
                    continue
                span = f" [{x['ratio_range'][0]:.2f}-{x['ratio_range'][1]:.2f}]" if x.get("ratio_range") else ""
                cells.append(f"N={c}: {x['served_output_tokens_per_s']:.1f} / {x['tool_output_tokens_per_s']:.1f}"
                             f" = {x['ratio']:.2f}{span}")
            lines.append(f"  {name:<22}" + "  ".join(cells))
    elif served:
        lines.append(f"served against llama-batched-bench: skipped: {served['reason']}")
    batched = out.get("batched")
    if batched:
        from pipeline.instruments.batched_bench import format_batched

        lines.append("")
        lines.append(format_batched(batched) if batched["status"] == "ok"
                     else f"batched decoding ({batched['variant']}): skipped: {batched['reason']}")
    return "\n".join(lines)
