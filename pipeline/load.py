"""`make load` / `quantdrift command=load`: every variant measured the way it will be served.

Each variant's artifact is served by a real engine with continuous batching (pipeline.engines: llama.cpp's
``llama-server`` for GGUF files, ``transformers serve`` for HF-format checkpoints); a variant no engine serves on
this device, or whose runtime ``load.runtimes`` leaves out, is reported as skipped with the reason.
guidellm (pipeline.loadgen) drives the engine's OpenAI-compatible endpoint at a list of concurrency levels with the
suites' own business text as prompts, at each context depth, with a fixed number of output tokens per request.

Trials are interleaved: round r serves every variant once (a fresh server each time), so drift of the machine over
the sweep lands on every variant alike; every figure is the median over rounds with an order-statistic interval.
Memory is sampled from the server process while each level runs (host RSS; device memory from NVML on CUDA).

Per variant the sweep yields the knee (the concurrency after which doubling adds less than ``load.knee_gain``
aggregate output tokens/s), the largest concurrency meeting the workload's latency targets at its context depth,
and ``throughput_at_slo``: the highest aggregate output tokens/s at a level that meets those targets and fits the
memory budget. The advice: operate at or left of the knee, within the targets.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

from pipeline.aggregate import sequences_that_fit
from pipeline.errors import ConfigError, Skip
from pipeline.memory import status_mb
from pipeline.probe import OtherCpu
from pipeline.stats import median_interval
from pipeline.store import Journal, load_manifest, read_json, run_stage, stable_hash, write_json

log = logging.getLogger(__name__)

# the per-level figures of one trial (pipeline.loadgen's parse) that get a median and an interval over rounds
LEVEL_FIGURES = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                 "e2e_p50_s", "e2e_p99_s", "peak_rss_mb", "device_peak_mb")
# workload target -> (the level figure it limits, how a limit compares); every target is an upper limit
TARGETS = {"max_ttft_p99_s": "ttft_p99_s", "max_itl_p99_s": "itl_p99_s", "max_e2e_p99_s": "e2e_p99_s"}


# ---------------------------------------------------------------------------------------------------------------
# the figures (pure functions, tested on synthetic sweeps)

def level_table(trials: list[list[dict] | None]) -> dict[int, dict]:
    """Per concurrency level, every figure's median over rounds with its interval and the rounds' values.
    ``trials``: one list of per-level results per round (None for a round that failed). A level a round did not
    measure (its climb ended past the knee) has None in that round's place, so the rounds' values of two levels
    stay paired by round."""
    by_level: dict[int, list[dict | None]] = {}
    for r, levels in enumerate(trials):
        for row in levels or []:
            by_level.setdefault(int(row["concurrency"]), [None] * len(trials))[r] = row
    out = {}
    for c in sorted(by_level):
        rows = [row for row in by_level[c] if row is not None]
        fig = {"concurrency": c, "rounds": len(rows), "completed": sum(r.get("completed", 0) for r in rows),
               "errored": sum(r.get("errored", 0) for r in rows)}
        for k in LEVEL_FIGURES:
            values = [row.get(k) if row is not None else None for row in by_level[c]]
            iv = median_interval([v for v in values if v is not None])
            fig[k] = iv["estimate"] if iv else None
            fig[f"{k}_interval"] = iv
            fig[f"{k}_rounds"] = values
        out[c] = fig
    return out


def knee(table: dict[int, dict], gain: float) -> dict:
    """The knee of aggregate throughput against concurrency: the first level c after which the next level (about
    double) adds less than ``gain`` (a fraction) output tokens/s. The gain of each step is the median over rounds
    of the paired ratio (round r's next level over round r's level: measured back to back, so a slow round does
    not fake a knee). ``reached`` is False when throughput still rose by ``gain`` at the highest level measured:
    the knee lies beyond it."""
    levels = sorted(c for c, f in table.items() if f.get("output_tokens_per_s"))
    steps = []
    for a, b in zip(levels, levels[1:]):
        ra, rb = table[a]["output_tokens_per_s_rounds"], table[b]["output_tokens_per_s_rounds"]
        ratios = [y / x for x, y in zip(ra, rb) if x and y]
        iv = median_interval(ratios)
        steps.append({"from": a, "to": b, "gain": (iv["estimate"] - 1) if iv else None,
                      "gain_low": (iv["low"] - 1) if iv else None, "gain_high": (iv["high"] - 1) if iv else None})
    for s in steps:
        if s["gain"] is not None and s["gain"] < gain:
            return {"concurrency": s["from"], "reached": True, "steps": steps, "knee_gain": gain}
    return {"concurrency": levels[-1] if levels else None, "reached": False, "steps": steps, "knee_gain": gain}


KNEE_RULE_LEVELS = 3      # past_the_knee judges two doublings: it needs this many levels measured


def past_the_knee(rows: list[dict], gain: float) -> bool:
    """Whether one round's climb can end: its last two doublings each added less than ``gain`` aggregate output
    tokens/s (the knee lies behind, and the next level is the costliest), or its last level completed no request.
    One flat step is not enough: a single step of a noisy machine can look flat."""
    if rows and not rows[-1].get("completed"):
        return True
    if len(rows) < KNEE_RULE_LEVELS:
        return False
    a, b, c = (r.get("output_tokens_per_s") or 0.0 for r in rows[-KNEE_RULE_LEVELS:])
    return a > 0 and b > 0 and b < a * (1 + gain) and c < b * (1 + gain)


def judge_level(fig: dict, targets: dict) -> dict:
    """Whether one level meets the workload's latency targets: "meets" when every target's interval lies at or
    under its limit, "fails" when some interval lies wholly above, else "undecided" (a limit inside the noise
    decides nothing). No targets: "meets"."""
    verdict, why = "meets", []
    for key, limit in targets.items():
        if limit is None:
            continue
        figure = TARGETS[key]
        iv = fig.get(f"{figure}_interval")
        if not iv:
            verdict = "fails" if verdict != "fails" else verdict
            why.append(f"{figure} not measured (no request completed)")
            continue
        if iv["low"] > limit:
            verdict = "fails"
            why.append(f"{figure} {iv['estimate']:.3g} s > {limit:g} s")
        elif iv["high"] > limit and verdict == "meets":
            verdict = "undecided"
            why.append(f"{figure} {iv['estimate']:.3g} s [{iv['low']:.3g}, {iv['high']:.3g}] straddles {limit:g} s")
    return {"verdict": verdict, "why": why}


def operating_point(table: dict[int, dict], targets: dict, memory_budget_mb: float | None, gain: float) -> dict:
    """The knee, the largest concurrency meeting every target (levels above a failing one are not trusted: latency
    only grows with load), and throughput_at_slo: the highest median aggregate output tokens/s among levels that
    meet the targets and whose peak memory fits ``memory_budget_mb``. The recommendation: the knee, or the
    largest level meeting the targets when that is lower."""
    verdicts = {}
    for c in sorted(table):
        v = judge_level(table[c], targets)
        peak = table[c].get("device_peak_mb") or table[c].get("peak_rss_mb")
        if memory_budget_mb is not None and peak is not None and peak > memory_budget_mb:
            v = {"verdict": "fails", "why": v["why"] + [f"peak memory {peak:.0f} MB > budget {memory_budget_mb:.0f} MB"]}
        verdicts[c] = v
    meeting = []
    for c in sorted(table):
        if verdicts[c]["verdict"] != "meets":
            break
        meeting.append(c)
    k = knee(table, gain)
    best = max(meeting, key=lambda c: table[c]["output_tokens_per_s"] or 0.0) if meeting else None
    top = meeting[-1] if meeting else None
    recommend = None
    if top is not None and k["concurrency"] is not None:
        recommend = min(top, k["concurrency"])
    return {"knee": k, "verdicts": {str(c): v for c, v in verdicts.items()},
            "max_concurrency_meeting_targets": top,
            "throughput_at_slo": table[best]["output_tokens_per_s"] if best is not None else None,
            "throughput_at_slo_interval": table[best]["output_tokens_per_s_interval"] if best is not None else None,
            "throughput_at_slo_concurrency": best,
            "recommended_concurrency": recommend}


def levels_within(levels: list[int], fits: int | None) -> tuple[list[int], int | None]:
    """The configured concurrency levels the capacity plan allows (at least the first one)."""
    if fits is None:
        return sorted(levels), None
    kept = [c for c in sorted(levels) if c <= fits] or sorted(levels)[:1]
    return kept, fits


# ---------------------------------------------------------------------------------------------------------------
# memory while a level runs

class MemorySampler:
    """Samples a process's resident memory (and, on CUDA, its device memory from NVML) every ``interval_s`` in a
    thread, so that each level's peak can be read from its own time window."""

    def __init__(self, pid: int, gpu: bool = False, interval_s: float = 0.2):
        self.pid, self.gpu, self.interval_s = pid, gpu, interval_s
        self.samples: list[tuple[float, float | None, float | None]] = []   # (unix time, rss MB, device MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _device_mb(self) -> float | None:
        if not self.gpu:
            return None
        from pipeline.memory import nvml_process_mb

        reading = nvml_process_mb(self.pid)
        return reading["used_mb"] if reading else None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), status_mb("VmRSS", self.pid), self._device_mb()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peak(self, start: float | None = None, end: float | None = None) -> tuple[float | None, float | None]:
        """(peak RSS MB, peak device MB) over samples in [start, end] (the whole run without bounds)."""
        inside = [s for s in self.samples if (start is None or s[0] >= start) and (end is None or s[0] <= end)]
        inside = inside or self.samples
        rss = [s[1] for s in inside if s[1] is not None]
        dev = [s[2] for s in inside if s[2] is not None]
        return (max(rss) if rss else None), (max(dev) if dev else None)


# ---------------------------------------------------------------------------------------------------------------
# prompts

def load_prompts(renderer, suites: dict, depth: int, n: int, reserve: int = 48) -> list[str]:
    """``n`` distinct prompts of about ``depth`` tokens once the chat template wraps them: consecutive windows of the
    suites' turns (real business text), each decoded back to text. ``reserve``: tokens left for the template."""
    from pipeline.run import probe_prompt

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
    from pipeline.aggregate import kv_bytes_per_token_formula
    from pipeline.config import variant_of
    from pipeline.engines import engine_class
    from pipeline.quantizers import build_artifact

    lc = cfg.load
    variant = variant_of(cfg, name)
    engine = engine_class(variant.runtime)
    engine.check(variant)
    if variant.runtime not in lc.runtimes:
        raise Skip(f"not in this sweep: its runtime {variant.runtime!r} is not in load.runtimes {list(lc.runtimes)} "
                   "(`make load` serves every runtime)")
    artifact = build_artifact(variant, original, dataclasses.replace(cfg, variant=variant))
    served = engine.plan(cfg, variant, artifact, original.facts["head_dim"])
    ctx_per_slot = max(depths) + output_tokens(cfg) + lc.ctx_margin
    kv_tok = kv_bytes_per_token_formula(original.facts, served["kv_element_bytes"])
    fits = sequences_that_fit(budget_mb * 2**20, cfg.capacity.headroom, served["weight_bytes"], kv_tok, ctx_per_slot)
    levels, _ = levels_within(lc.concurrency, fits)
    path = Path(served["served"])
    stat = path.stat()
    return {**served, "engine": engine, "levels": levels, "fits": fits, "output_tokens": output_tokens(cfg),
            "ctx_per_slot": ctx_per_slot,
            "file_hash": stable_hash({"file": path.name, "size": served["weight_bytes"],
                                      "mtime": int(stat.st_mtime)})}


def trial_prompts(plans: dict, lc) -> int:
    """Prompts per depth so that every request of a trial has its own (pipeline.loadgen.prompts_needed)."""
    from pipeline.loadgen import prompts_needed

    return max(prompts_needed(p["levels"], lc.min_requests, lc.requests_per_stream) for p in plans.values())


def run_load(cfg, generate=None) -> dict:
    """Run (or resume) the sweep over ``cfg.run.variants``; writes ``load.json`` into the run's stage folder and
    ``cfg.results_dir``; returns it. ``generate``: the load generator (pipeline.loadgen.run_guidellm; tests pass a
    fake with the same signature)."""
    from pipeline.conversation import ChatRenderer
    from pipeline.prepare import prepare
    from pipeline.run import load_suites

    lc, wl = cfg.load, cfg.workload
    if generate is None:
        from pipeline.loadgen import run_guidellm as generate, guidellm_version
        generator = guidellm_version()
    else:
        generator = getattr(generate, "version", "fake")
    names = cfg.run.variants or [cfg.variant.name]
    original = prepare(cfg.model, cfg.model_dir)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    suites = load_suites(cfg, original, renderer)
    gpu = cfg.runtime.device.startswith("cuda")
    depths = sorted(set(lc.depths) | {wl.context_tokens}) if lc.include_workload_depth else sorted(set(lc.depths))
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
           "prompts": stable_hash(prompts)}

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
        trials = {n: [journal.get(f"{r}:{n}") for r in range(lc.repeats)] for n in plans}
        write_json(tmp / "load.json", summarize(trials, plans, skipped, depths, cfg, budget_mb, generator))
        return {"variants": len(plans), "skipped": len(skipped)}

    run_stage("load", out_dir, key, build, force=cfg.force)
    shown = wider_sweep(run_dir, out_dir, key)
    if shown is not None:
        log.info("load: the report keeps the %s sweep of this run (%s): it measured the same files at every depth and "
                 "level of this one and more", shown.name, shown)
    else:
        shown = out_dir
    result = {**read_json(shown / "load.json"), "logs": str(logs_dir(shown))}
    write_json(cfg.results_dir / "load.json", result)
    return result


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


def summarize(trials: dict, plans: dict, skipped: dict, depths: list[int], cfg, budget_mb: float,
              generator: str) -> dict:
    """load.json: per variant and depth the level table, judged against the workload (``rejudge``: the knee and
    the operating point); skipped variants with their reasons; the sweep's settings."""
    lc = cfg.load
    variants = {}
    # every trial's own time, over every sitting of a resumed sweep (the stage's manifest times the last one only)
    trials_wall_s = sum(t["wall_s"] for rounds in trials.values() for t in rounds if t and t.get("wall_s"))
    for name, rounds in trials.items():
        plan = plans[name]
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
            "status": "ok", "engine": plan["engine"].name, "engine_version": plan["version"],
            "settings": settings, "setup": plan["engine"].describe(settings),
            "levels": plan["levels"], "capacity_fits": plan["fits"], "rounds": len(good), "errors": errors,
            "cpu_noise_rounds": [t.get("cpu_noise") for t in good], "depths": per_depth,
        }
    for name, why in skipped.items():
        variants[name] = {"status": "skipped", "reason": why}
    return rejudge({"depths": depths, "concurrency": list(lc.concurrency), "output_tokens": output_tokens(cfg),
                    "repeats": lc.repeats, "knee_gain": lc.knee_gain, "stop_past_knee": lc.stop_past_knee,
                    "memory_budget_mb": budget_mb, "trials_wall_s": trials_wall_s,
                    "generator": generator, "profile": lc.name, "variants": variants}, cfg.workload)


def output_tokens(cfg) -> int:
    """Tokens generated per request: load.output_tokens, else the workload's."""
    return cfg.load.output_tokens or cfg.workload.output_tokens


def slo_depth(depths: list[int], context_tokens: int) -> int:
    """The measured depth the workload's targets are judged at: its own context, else the deepest shallower one."""
    return context_tokens if context_tokens in depths else max([d for d in depths if d <= context_tokens] or depths[:1])


def load_sweep(cfg) -> dict | None:
    """This run's load.json when `quantdrift command=load` has run (the summary and report read it), judged against the
    workload of ``cfg`` (``make report ARGS="workload=batch"`` re-decides without measuring again)."""
    path = cfg.results_dir / "load.json"
    return rejudge(read_json(path), cfg.workload) if path.is_file() else None


def rejudge(result: dict, wl) -> dict:
    """The sweep's level tables judged against workload ``wl``: every depth's operating point, the depth its targets
    are judged at, throughput_at_slo, the knee and the recommendation. The measurements are untouched."""
    targets = {k: getattr(wl, k) for k in TARGETS}
    for v in result["variants"].values():
        if v.get("status") != "ok":
            continue
        for block in v["depths"].values():
            table = {int(c): f for c, f in block["levels"].items()}
            block["operating_point"] = operating_point(table, targets, result["memory_budget_mb"], result["knee_gain"])
        at = str(slo_depth([int(d) for d in v["depths"]], wl.context_tokens))
        op = v["depths"][at]["operating_point"]
        v.update({"slo_depth": int(at), "throughput_at_slo": op["throughput_at_slo"],
                  "throughput_at_slo_interval": op["throughput_at_slo_interval"],
                  "throughput_at_slo_concurrency": op["throughput_at_slo_concurrency"],
                  "knee_concurrency": op["knee"]["concurrency"], "knee_reached": op["knee"]["reached"],
                  "recommended_concurrency": op["recommended_concurrency"]})
    result["workload"] = dataclasses.asdict(wl)
    return result


def advice(v: dict, bold: str = "") -> str:
    """One variant's served-load verdict in words: its knee, its throughput at the workload's targets and the
    concurrency to run it at (``bold``: the Markdown emphasis around that number, "" for plain text)."""
    knee_txt = (f"knee at {v['knee_concurrency']}" if v["knee_reached"]
                else f"no knee up to {v['knee_concurrency']} (throughput still rising)")
    slo = (f"throughput at the targets {v['throughput_at_slo']:.1f} tok/s at {v['throughput_at_slo_concurrency']} "
           "concurrent" if v["throughput_at_slo"] is not None else "no level meets the targets")
    rec = (f"operate at up to {bold}{v['recommended_concurrency']}{bold} concurrent requests"
           if v["recommended_concurrency"] else "no operating point meets the targets")
    return f"{knee_txt}; {slo}; {rec} (context {v['slo_depth']})"


def numeric_order(table: dict) -> list[tuple[str, object]]:
    """A table keyed by numbers written as text (depths, concurrency levels), in numeric order: load.json is read
    back with its keys sorted as text, which puts 16 before 2."""
    return sorted(table.items(), key=lambda kv: float(kv[0]))


def format_load(result: dict) -> str:
    """The sweep as text: per variant and depth, one line per level; then knee, targets and throughput_at_slo."""
    wl = result["workload"]
    lines = [f"load sweep ({result['profile']}), workload {wl['name']}: {result['output_tokens']} output tokens per "
             f"request, {result['repeats']} interleaved rounds, generator {result['generator']}"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for name, v in result["variants"].items():
        if v["status"] != "ok":
            lines.append(f"{name}: {v['status']}: {v['reason']}")
            continue
        from pipeline.engines import describe

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


def attach_load(variants: dict, sweep: dict | None) -> None:
    """Give each evaluated variant of the summary its served-load figures (``v["load"]``: throughput_at_slo with its
    interval, the concurrency it was reached at, the knee, the recommendation, the workload), or the reason it has
    none, so that the decision can rank by throughput_at_slo."""
    if not sweep:
        return
    for name, v in variants.items():
        if v.get("status") != "ok":
            continue
        lv = sweep["variants"].get(name)
        if lv is None:
            v["load"] = {"status": "skipped", "reason": "not in this run's load sweep", "workload": sweep["workload"]["name"]}
        elif lv["status"] != "ok":
            v["load"] = {"status": lv["status"], "reason": lv["reason"], "workload": sweep["workload"]["name"]}
        else:
            v["load"] = {"status": "ok", "workload": sweep["workload"]["name"], "engine": lv["engine"],
                         **{k: lv[k] for k in ("throughput_at_slo", "throughput_at_slo_interval",
                                               "throughput_at_slo_concurrency", "knee_concurrency", "knee_reached",
                                               "recommended_concurrency", "slo_depth")}}
