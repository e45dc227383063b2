"""`make load` / `quantdrift command=load`: every variant measured the way it will be served.

Each variant's artifact is served by a real engine with continuous batching (pipeline.servers: llama.cpp's
``llama-server`` for GGUF files, ``transformers serve`` for HF-format checkpoints); a variant no engine serves on
this device, or whose runtime ``load.runtimes`` leaves out, is reported as skipped with the reason.
guidellm (pipeline.instruments.loadgen) drives the engine's OpenAI-compatible endpoint at a list of concurrency levels with
the suites' own business text as prompts, at each context depth, with a fixed number of output tokens per request.

Trials are interleaved: round r serves every variant once (a fresh server each time), so drift of the machine over
the sweep lands on every variant alike; every figure is the median over rounds with an order-statistic interval.
Memory is sampled from the server process while each level runs (host RSS; device memory from NVML on CUDA).

Per variant the sweep yields the knee (the concurrency after which doubling adds less than ``load.knee_gain``
aggregate output tokens/s), the largest concurrency meeting the workload's latency targets at its context depth,
and ``throughput_at_slo``: the highest aggregate output tokens/s at a level that meets those targets and fits the
memory budget. The advice: operate at or left of the knee, within the targets."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from pipeline.figures.capacity import sequences_that_fit
from pipeline.infra.errors import ConfigError, Skip
from pipeline.instruments.probe import OtherCpu
from pipeline.infra.stage_cache import Journal, load_manifest, run_stage
from pipeline.infra.files import read_json, stable_hash, write_json
from pipeline.instruments.memory import MemorySampler
from pipeline.figures.served_load import (KNEE_RULE_LEVELS, advice, level_table, levels_within, numeric_order,
                                          past_the_knee, rejudge)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# prompts

def load_prompts(renderer, suites: dict, depth: int, n: int, reserve: int = 48) -> list[str]:
    """``n`` distinct prompts of about ``depth`` tokens once the chat template wraps them: consecutive windows of the
    suites' turns (real business text), each decoded back to text. ``reserve``: tokens left for the template."""
    from pipeline.suites.records import probe_prompt

    length = max(16, depth - reserve)
    ids = probe_prompt(renderer, suites, n * length)
    return [renderer.decode(ids[i * length:(i + 1) * length]) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# the sweep

def memory_budget_mb(cfg, gpu: bool) -> float:
    """load.memory_budget_gb, else the device's memory on CUDA, else the host's physical memory."""
    lc = cfg.load
    if lc.memory_budget_gb:
        return lc.memory_budget_gb * 1e9 / 2**20
    if gpu:
        try:
            import torch

            return torch.cuda.get_device_properties(0).total_memory / 2**20
        except Exception:
            pass
    import psutil

    return psutil.virtual_memory().total / 2**20


def plan_variant(cfg, name: str, original, depths: list[int], budget_mb: float) -> dict:
    """What serves variant ``name`` and how: its engine class, the file or folder served, the engine settings, the
    concurrency levels the capacity plan lets fit ``budget_mb`` at the deepest of ``depths``, and a hash of what is
    served. Raises Skip or ConfigError with the reason where nothing serves it (its runtime is not in
    ``load.runtimes``, no engine for it, no artifact)."""
    from pipeline.figures.capacity import kv_bytes_per_token_formula
    from pipeline.runtimes import runtime_class
    from pipeline.compose import variant_of
    from pipeline.servers import engine_class
    from pipeline.stages.quantize import build_artifact
    from pipeline.stages.variant_setup import load_result

    lc = cfg.load
    screened = (load_result(cfg, name) or {}).get("screened")
    if screened:
        raise Skip(f"screened out at its scoring: {screened['reason']}")
    variant = variant_of(cfg, name)
    engine = engine_class(variant.runtime)
    engine.check(variant)
    if variant.runtime not in lc.runtimes:
        raise Skip(f"not in this sweep: its runtime {variant.runtime!r} is not in load.runtimes {list(lc.runtimes)} "
                   "(`make load` serves every runtime)")
    artifact = build_artifact(variant, original, dataclasses.replace(cfg, variant=variant))
    served = engine.plan(cfg, variant, artifact, original.facts["head_dim"])
    ctx_per_slot = max(depths) + output_tokens(cfg) + lc.ctx_margin
    kv_tok = kv_bytes_per_token_formula(original.facts, served["kv_element_bytes"], ctx_per_slot,
                                         runtime_class(variant.runtime).latent_kv_cache)
    fits = sequences_that_fit(budget_mb * 2**20, cfg.capacity.headroom, served["weight_bytes"], kv_tok, ctx_per_slot)
    levels, _ = levels_within(lc.concurrency, fits)
    path = Path(served["served"])
    stat = path.stat()
    return {**served, "engine": engine, "levels": levels, "fits": fits, "output_tokens": output_tokens(cfg),
            "ctx_per_slot": ctx_per_slot,
            "file_hash": stable_hash({"file": path.name, "size": served["weight_bytes"],
                                      "mtime": int(stat.st_mtime)})}


def trial_prompts(plans: dict, lc) -> int:
    """Prompts per depth so that every request of a trial has its own (pipeline.instruments.loadgen.prompts_needed)."""
    from pipeline.instruments.loadgen import prompts_needed

    return max(prompts_needed(p["levels"], lc.min_requests, lc.requests_per_stream) for p in plans.values())


def run_load(cfg, generate=None) -> dict:
    """Run (or resume) the sweep over ``cfg.run.variants``; writes ``load.json`` into the run's stage folder and
    ``cfg.results_dir``; returns it. ``generate``: the load generator (pipeline.instruments.loadgen.run_guidellm; tests pass
    a fake with the same signature)."""
    from pipeline.suites.conversation import ChatRenderer
    from pipeline.stages.prepare import prepare
    from pipeline.stages.suite_files import load_suites

    lc, wl = cfg.load, cfg.workload
    if generate is None:
        from pipeline.instruments.loadgen import run_guidellm as generate, guidellm_version
        generator = guidellm_version()
    else:
        generator = getattr(generate, "version", "fake")
    names = cfg.run.variants or [cfg.variant.name]
    original = prepare(cfg.model, cfg.model_dir)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    suites = load_suites(cfg, original, renderer)
    gpu = cfg.runtime.device.startswith("cuda")
    depths = lc.sweep_depths(wl.context_tokens)
    budget_mb = memory_budget_mb(cfg, gpu)

    # per variant: what serves it, or why nothing does
    plans, skipped = {}, {}
    for name in names:
        try:
            plans[name] = plan_variant(cfg, name, original, depths, budget_mb)
        except (Skip, ConfigError) as exc:
            # a Skip states its own reason (no engine, not in this sweep); a bad input says what failed
            skipped[name] = str(exc) if isinstance(exc, Skip) else f"not served: {exc}"
            log.warning("load: %s skipped: %s", name, skipped[name])
    versions = {}
    for plan in plans.values():
        engine = plan["engine"]
        plan["version"] = versions.setdefault(engine.name, engine.version(cfg))
    prompts = {d: load_prompts(renderer, suites, d, trial_prompts(plans, lc)) for d in depths} if plans else {}
    run_dir = cfg.model_dir / "runs" / cfg.run.name
    # every sweep profile keeps its own stage (and its journal): a short sweep completed by `make compare` must not
    # replace, nor wipe the resumable trials of, the full one `make load` measures in the same run
    out_dir = run_dir / sweep_stage(lc.name)
    logs = logs_dir(out_dir)
    key = {"variants": {n: {"engine": p["engine"].name, **{k: p[k] for k in ("settings", "levels", "ctx_per_slot",
                                                                          "file_hash")}}
                        for n, p in plans.items()},
           # the workload's targets judge the tables (rejudge, at report time); only what it makes us measure counts
           "load": dataclasses.asdict(lc), "measured_for": {"output_tokens": output_tokens(cfg)}, "depths": depths,
           "gpu": gpu,
           "engine_versions": versions, "generator": generator,
           "prompts": stable_hash(prompts), "protocol": load_protocol(plans)}

    def build(tmp: Path) -> dict:
        journal = Journal(out_dir, "trials", key)
        order = list(plans)
        for r in range(lc.repeats):
            k = r % max(1, len(order))
            for name in order[k:] + order[:k]:         # rotated by one place per round
                item = f"{r}:{name}"
                if item in journal:
                    continue
                log.info("load: round %d/%d: %s at concurrency %s, depths %s", r + 1, lc.repeats, name,
                         plans[name]["levels"], depths)
                try:
                    trial = serve_trial(plans[name], depths, prompts, lc, gpu, generate, logs / f"{name}.r{r}.log")
                except Exception as exc:    # one failed trial is reported; the other variants go on
                    log.error("load trial %s failed: %s", item, exc)
                    trial = {"error": f"{type(exc).__name__}: {exc}"}
                journal.add(item, trial)
        raw = {"trials": {n: [journal.get(f"{r}:{n}") for r in range(lc.repeats)] for n in plans},
               "plans": {n: {"engine": p["engine"].name, "version": p["version"],
                             **{k: p[k] for k in ("settings", "levels", "fits", "ctx_per_slot")}}
                         for n, p in plans.items()},
               "skipped": skipped, "depths": depths, "memory_budget_mb": budget_mb, "generator": generator,
               "output_tokens": output_tokens(cfg), "load": dataclasses.asdict(lc)}
        write_json(tmp / "trials.json", raw)
        write_json(tmp / "load.json", summarize(raw, cfg.workload))
        return {"variants": len(plans), "skipped": len(skipped)}

    run_stage("load", out_dir, key, build, force=cfg.force)
    shown = wider_sweep(run_dir, out_dir, key)
    if shown is not None:
        log.info("load: the report keeps the %s sweep of this run (%s): it measured the same files at every depth and "
                 "level of this one and more", shown.name, shown)
    else:
        shown = out_dir
    from pipeline.stages.variant_setup import load_result

    result = {**sweep_figures(shown, cfg.workload), "logs": str(logs_dir(shown)), "stage": str(shown),
              # what the run's evaluation of each variant was made on: the summary shows this sweep only beside it
              "evaluated": {n: evaluated_as(load_result(cfg, n)) for n in names}}
    write_json(cfg.results_dir / "load.json", result)
    return result


def evaluated_as(result: dict | None) -> str | None:
    """The identity of a variant's evaluation that a load sweep must share to stand beside it: the artifact its
    result was measured on (path and hash) and its runtime; None where the variant has no evaluated result."""
    if not result or result.get("status") != "ok":
        return None
    artifact = result.get("artifact") or {}
    return stable_hash({"artifact": [artifact.get("path"), artifact.get("hash")], "runtime": result.get("runtime")})


def load_protocol(plans: dict) -> dict:
    """The version of the code a sweep's trials come from: how a trial serves (``serve_trial``, the memory sampler),
    how guidellm drives the endpoint (``pipeline.instruments.loadgen``) and the engines that served. The figures made of
    the trials (level tables, knee, targets) are computed from the stage's trials.json when they are read
    (``sweep_figures``), never cached."""
    from pipeline.infra.code_version import code_version

    engines = sorted({p["engine"].__module__ for p in plans.values()})
    return code_version("pipeline.instruments.loadgen", "pipeline.servers.base", *engines, serve_trial, MemorySampler)


def sweep_figures(stage: Path, wl) -> dict:
    """A sweep stage's load.json figures, computed now from its raw trials (trials.json) with this code; a stage
    written before trials were kept apart gives its stored load.json."""
    if (stage / "trials.json").is_file():
        return summarize(read_json(stage / "trials.json"), wl)
    return read_json(stage / "load.json")


def logs_dir(stage: Path) -> Path:
    """The folder beside a sweep's stage that keeps the logs of the servers it started."""
    return stage.with_name(f"{stage.name}-logs")


def sweep_stage(profile: str) -> str:
    """The stage folder of a sweep profile inside a run: ``load`` for the short sweep (``make compare``),
    ``load-NAME`` for any other (``load-full``: ``make load``)."""
    return "load" if profile == "short" else f"load-{profile}"


def completed_sweeps(run_dir: Path) -> list[tuple[Path, dict]]:
    """Every completed load sweep of a run, whatever its profile: its stage folder and manifest, in name order."""
    out = []
    for stage in sorted(run_dir.glob("load*")):
        manifest = load_manifest(stage) if (stage / "load.json").is_file() else None
        if manifest and manifest.get("stage") == "load":
            out.append((stage, manifest))
    return out


def wider_sweep(run_dir: Path, out_dir: Path, key: dict) -> Path | None:
    """Another completed sweep of this run that served every variant this one served, from the same files with the
    same engines and settings (threads, KV types, ...), at every depth and concurrency level this one measured,
    and at more (the full sweep beside the short one): the run's report shows it. None when there is none."""
    def plans(k: dict) -> dict:
        return {n: (p.get("engine"), p.get("file_hash"), stable_hash(p.get("settings"))) for n, p in
                k.get("variants", {}).items()}

    def reach(k: dict) -> tuple[set, set]:
        return set(k.get("depths", [])), {c for p in k.get("variants", {}).values() for c in p.get("levels", [])}

    depths, levels = reach(key)
    wider = []
    for other, manifest in completed_sweeps(run_dir):
        k = manifest.get("key") if other != out_dir else None
        theirs = plans(k) if k else {}
        if not theirs or any(theirs.get(n) != v for n, v in plans(key).items()):
            continue
        d, lv = reach(k)
        if d >= depths and lv >= levels and (d, lv) != (depths, levels):
            wider.append((len(d), max(lv, default=0), other))
    return max(wider)[2] if wider else None


def serve_trial(plan: dict, depths: list[int], prompts: dict, lc, gpu: bool, generate, log_path: Path) -> dict:
    """One round of one variant: a fresh server, then every depth's levels, with memory sampled per level."""
    engine = plan["engine"]
    server = engine.launch(plan, slots=max(plan["levels"]), ctx_per_slot=plan["ctx_per_slot"], gpu=gpu,
                           log_path=log_path)
    out: dict = {"depths": {}}
    t0 = time.perf_counter()
    with OtherCpu() as other, server, MemorySampler(server.proc.pid, gpu) as sampler:
        for depth in depths:
            levels = generate(server.url, prompts[depth], levels=plan["levels"], output_tokens=plan["output_tokens"],
                              request_body=engine.request_body(plan["output_tokens"]),
                              requests_per_stream=lc.requests_per_stream, min_requests=lc.min_requests,
                              max_seconds=lc.max_seconds_per_level, workdir=log_path.parent,
                              stop=(lambda rows: past_the_knee(rows, lc.knee_gain)) if lc.stop_past_knee else None,
                              idle=server.wait_idle, processes=lc.generator_processes,
                              grouped=1 if engine.serves_repeats_from_cache else KNEE_RULE_LEVELS)
            for row in levels:
                rss, dev = sampler.peak(row.get("start_time"), row.get("end_time"))
                row["peak_rss_mb"], row["device_peak_mb"] = rss, dev
            out["depths"][str(depth)] = levels
        out["server_peak_rss_mb"] = server.peak_rss_mb()
    out["wall_s"] = time.perf_counter() - t0
    # the server and guidellm (with its workers) are our own children, waited for: not counted as noise
    out["cpu_noise"] = other.share
    return out


def summarize(raw: dict, wl) -> dict:
    """load.json from a sweep's raw trials (trials.json): per variant and depth the level table, judged against
    workload ``wl`` (``rejudge``: the knee and the operating point); skipped variants with their reasons; the sweep's
    settings."""
    from pipeline.servers import describe

    lc = raw["load"]
    variants = {}
    trials, depths = raw["trials"], raw["depths"]
    # every trial's own time, over every sitting of a resumed sweep (the stage's manifest times the last one only)
    trials_wall_s = sum(t["wall_s"] for rounds in trials.values() for t in rounds if t and t.get("wall_s"))
    for name, rounds in trials.items():
        plan = raw["plans"][name]
        errors = [t["error"] for t in rounds if t and "error" in t]
        good = [t for t in rounds if t and "error" not in t]
        if not good:
            variants[name] = {"status": "failed", "reason": errors[0] if errors else "no trial ran"}
            continue
        per_depth = {str(d): {"levels": {str(c): f for c, f in
                                         level_table([t["depths"].get(str(d)) for t in good]).items()}}
                     for d in depths}
        settings = {**plan["settings"], "slots": max(plan["levels"]), "ctx_per_slot": plan["ctx_per_slot"]}
        variants[name] = {
            "status": "ok", "engine": plan["engine"], "engine_version": plan["version"],
            "settings": settings, "setup": describe(plan["engine"], settings),
            "levels": plan["levels"], "capacity_fits": plan["fits"], "rounds": len(good), "errors": errors,
            "cpu_noise_rounds": [t.get("cpu_noise") for t in good], "depths": per_depth,
        }
    for name, why in raw["skipped"].items():
        variants[name] = {"status": "skipped", "reason": why}
    return rejudge({"depths": depths, "concurrency": list(lc["concurrency"]), "output_tokens": raw["output_tokens"],
                    "repeats": lc["repeats"], "knee_gain": lc["knee_gain"], "stop_past_knee": lc["stop_past_knee"],
                    "memory_budget_mb": raw["memory_budget_mb"], "trials_wall_s": trials_wall_s,
                    "generator": raw["generator"], "profile": lc["name"], "variants": variants}, wl)


def output_tokens(cfg) -> int:
    """Tokens generated per request: load.output_tokens, else the workload's."""
    return cfg.load.output_tokens or cfg.workload.output_tokens


def format_load(result: dict) -> str:
    """The sweep as text: per variant and depth, one line per level; then knee, targets and throughput_at_slo."""
    from pipeline.servers import describe

    wl = result["workload"]
    lines = [f"load sweep ({result['profile']}), workload {wl['name']}: {result['output_tokens']} output tokens per "
             f"request, {result['repeats']} interleaved rounds, generator {result['generator']}"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for name, v in result["variants"].items():
        if v["status"] != "ok":
            lines.append(f"{name}: {v['status']}: {v['reason']}")
            continue
        lines.append(f"{name} on {v['engine']} ({v.get('setup') or describe(v['engine'], v['settings'])}):")
        for depth, block in numeric_order(v["depths"]):
            lines.append(f"  context {depth}: {'conc':>5}{'out tok/s':>11}{'req/s':>7}{'TTFT p50/p99 s':>17}"
                         f"{'ITL p50/p99 ms':>17}{'e2e p99 s':>11}{'peak MB':>9}  verdict")
            for c, f in numeric_order(block["levels"]):
                verdict = block["operating_point"]["verdicts"][c]["verdict"]
                lines.append(f"  {'':<{9 + len(depth)}}{c:>5}{fmt(f['output_tokens_per_s'], '11.1f')}"
                             f"{fmt(f['requests_per_s'], '7.2f')}"
                             f"{fmt(f['ttft_p50_s'], '8.2f')}/{fmt(f['ttft_p99_s'], '<8.2f')}"
                             f"{fmt(f['itl_p50_s'] and f['itl_p50_s'] * 1e3, '8.0f')}/"
                             f"{fmt(f['itl_p99_s'] and f['itl_p99_s'] * 1e3, '<8.0f')}"
                             f"{fmt(f['e2e_p99_s'], '11.2f')}{fmt(f['device_peak_mb'] or f['peak_rss_mb'], '9.0f')}"
                             f"  {verdict}")
        lines.append("  " + advice(v))
    return "\n".join(lines)
