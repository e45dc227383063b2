"""What a run will cost, before any work: ``quantdrift plan`` and the check at the start of every run.

From the model's shapes alone (``pipeline.runtimes.model_inventory``) and the run's variants, suites and profile:
each stage's disk, peak host and device memory (``pipeline.plan.stage_plan``) and time (``pipeline.plan.plan_times``:
``pipeline.plan.stage_rates`` on the runs of ``pipeline.plan.measured_runs``), then the totals against this
machine's free disk (the artifacts folder's filesystem) and memory (MemAvailable, or the cgroup's limit when
lower) with ``capacity.headroom`` kept free. A run that does not fit is refused naming the numbers (exit 2);
``plan.check=false`` runs it anyway.
``plan.compare=true`` sets a finished run's plan beside what it measured instead (``pipeline.plan.compare``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.figures.footprint import MIB, Footprint

log = logging.getLogger(__name__)

GB = 1e9


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory the cgroup still allows (limit - usage), v2 then v1; None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                continue
            return int(limit) - int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def machine_free(cfg, on_device: bool) -> dict:
    """This machine's free disk under paths.artifacts, available host memory and (on a GPU) free device memory."""
    probe = Path(cfg.paths.artifacts)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    mem, cg = _meminfo_available(), _cgroup_free()
    memory, source = mem, "MemAvailable"
    if cg is not None and (mem is None or cg < mem):
        memory, source = cg, "the cgroup's memory limit less its usage"
    free = {"disk_bytes": shutil.disk_usage(probe).free, "disk_path": str(probe), "memory_bytes": memory,
            "memory_source": source, "device_bytes": None}
    if on_device and cfg.runtime.gpus != 1:
        from pipeline.runtimes.placement import visible_devices

        free["devices"] = visible_devices()
        free["gpus"], free["gpu_headroom"] = cfg.runtime.gpus, cfg.runtime.gpu_headroom
    elif on_device:
        import torch

        from pipeline.runtimes.placement import device_index

        free["device_bytes"] = torch.cuda.mem_get_info(device_index(cfg.runtime.device))[0]
    return free


def _on_device(cfg) -> bool:
    """Whether the run's transformers stages use a GPU; a CUDA device torch cannot see is named here, before any
    work (the runtime's own check)."""
    from pipeline.runtimes.hf import resolve_device

    return cfg.runtime.device != "cpu" and resolve_device(cfg.runtime.device).startswith("cuda")


def plan_variants(cfg) -> list:
    from pipeline.compose import variant_of

    return [variant_of(cfg, name) for name in (cfg.run.variants or [cfg.variant.name])]


def _built(folder: Path) -> bool:
    from pipeline.infra.stage_cache import load_manifest

    return load_manifest(folder) is not None


def build_plan(cfg, variants: list | None = None, with_times: bool = True, exclude_run: str | None = None,
               inventory=None, workload=None, leave_out: bool = False,
               bandwidth_here: float | None = None, compute_here: float | None = None) -> dict:
    """The stages of a run (every variant of ``variants``, default the run's) with their footprints and the
    totals of what is still to be built. ``exclude_run``: a measured run not to take times from; ``leave_out``:
    never take a variant's time from its own measurement (a run compared with itself); ``bandwidth_here``,
    ``compute_here``: this machine's readings as a compared run recorded them (``plan_times.add_times``)."""
    from pipeline.runtimes.model_inventory import model_inventory
    from pipeline.plan.plan_times import add_times
    from pipeline.plan.stage_plan import StagePlanner, Workload, time_kind, weight_kind
    from pipeline.infra.model_source import PREPARE_WORK, classify_source
    from pipeline.stages.reference import f16_variant
    from pipeline.stages.lmeval_tasks import bench_dir
    from pipeline.stages.score import scores_exactness

    variants = variants if variants is not None else plan_variants(cfg)
    inv = inventory or model_inventory(cfg)
    work = workload or Workload.of(cfg)
    on_device = _on_device(cfg)
    sp = StagePlanner(cfg, inv, work, on_device)
    md, run = cfg.model_dir, cfg.model_dir / "runs" / cfg.run.name
    original = next((v for v in variants if weight_kind(v) == "original" and not v.runtime_options.get("kv_cache")),
                    None) or plan_original(cfg)
    f16 = f16_variant()
    producer = f16 if cfg.reference.runtime in ("auto", "gguf_f16") else original
    rows: list[Footprint] = []

    def add(fp: Footprint, folder: Path | None, kind: str = "", nbytes: float = 0.0, **time_args) -> None:
        fp.exists = bool(folder is not None and _built(folder))
        fp.time_args = {"kind": kind, "nbytes": nbytes, **time_args}
        rows.append(fp)

    params = inv.params
    source = classify_source(cfg.model.source)[0]
    add(sp.prepare(source), md / "original", "original", sp.original_bytes(), params=params,
        source=PREPARE_WORK[source])
    add(sp.convert_f16(), md / "gguf-f16", "ggml", sp.gguf("F16")["bytes"], params=params)
    add(sp.parity(original, f16), md / "parity", "original", sp.original_bytes(), params=params,
        f16_bytes=sp.gguf("F16")["bytes"])
    for suite in work.per_suite:
        add(sp.reference(suite, producer, original), md / "reference" / cfg.run.name / f"{suite}-logprobs",
            "ggml", sp.gguf("F16")["bytes"], suites=[suite], params=params)
    baseline_needed = False
    exact_pending = True        # the first scoring stage that needs the original's exact rows builds them
    bases_done: set[str] = set()
    bench_samples = {task: _bench_samples(cfg, task) for task in cfg.run.bench_tasks}
    speed = cfg.profile.speed       # the A/A control's probe runs twice a round (stages.speed._control)
    control = (variants[0].name if speed.control == "auto" else speed.control) if speed.aa and variants else None
    for v in variants:
        kind = weight_kind(v)
        nbytes = sp.artifact_bytes(v)
        # a GGUF file's weights per ggml type: its prompt work is carried by them (stage_rates._type_factor)
        types = sp.gguf(v.quantize["type"].upper())["type_elements"] if kind == "ggml" else None
        if kind != "original" and v.base not in bases_done:
            bases_done.add(v.base)
            # a GGUF type without an importance matrix: its time by the weights of each ggml type it writes (F16 is
            # a link to the conversion: nothing quantized, nothing read)
            by_type = kind == "ggml" and not v.quantize.get("imatrix") and v.quantize["type"].upper() != "F16"
            ggml = sp.gguf(v.quantize["type"].upper()) if by_type else {}
            add(sp.quantize(v), md / "variants" / v.base, time_kind(v), nbytes, extra=_calibration_ratio(v),
                params=params, type_elements=ggml.get("type_elements"), f16_bytes=sp.gguf("F16")["bytes"])
            if sp.standin(v):
                add(sp.standin_stage(v), md / "variants" / f"{v.base}.dequantized", kind, nbytes, params=params)
        reuses = (v.name == original.name and not v.runtime_options.get("kv_cache")) or v.name == producer.name
        generated_on = producer.runtime if (reuses or sp.standin(v)) else v.runtime
        baseline_needed |= generated_on != producer.runtime
        add(sp.evaluate(v, reuses_reference=reuses), run / v.name, time_kind(v, "evaluate"), nbytes,
            type_elements=types)
        exact = scores_exactness(v, original_weights=v.base == original.base)
        exact_here = exact_pending and exact
        exact_pending &= not exact_here
        add(sp.score(v, original if exact_here else None, exactness=exact), run / f"{v.name}.scores", time_kind(v),
            nbytes, builds_exact=exact_here, type_elements=types)
        for task, samples in bench_samples.items():
            fp = sp.evaluate(v, reuses_reference=False)
            fp.stage = f"bench:{task}"
            add(fp, bench_dir(cfg, v.name, task), time_kind(v, "evaluate"), nbytes, extra=samples,
                type_elements=types)
        add(sp.speed(v), None, time_kind(v), nbytes, extra=_probe_ratio(cfg), params=params,
            labels=2 if v.name == control else 1, type_elements=types)
        if v.runtime in cfg.load.runtimes and not v.runtime_options.get("kv_cache"):
            add(sp.load(v), None, time_kind(v), nbytes, load_levels=_load_levels(cfg), type_elements=types)
    if baseline_needed and original.runtime != producer.runtime:
        fp = sp.evaluate(original, name=f"original@{original.runtime}")
        fp.stage = "baseline"
        add(fp, run / f"original@{original.runtime}", "original", sp.original_bytes(), key=original.runtime,
            params=params)
    plan = {"model": cfg.model.name, "source": inv.source, "params": params, "facts": inv.facts, "run": cfg.run.name,
            "variants": [v.name for v in variants], "on_device": on_device, "workload": work.__dict__,
            "rows": rows, "time_basis": None}
    if with_times:
        add_times(cfg, plan, sp, exclude_run, leave_out, bandwidth_here, compute_here)
    plan["totals"] = totals(rows)
    if on_device and cfg.runtime.gpus != 1:
        plan["device_blocks"] = device_blocks(inv, rows)
    return plan


def device_blocks(inv, rows: list[Footprint]) -> list:
    """The model's chain of blocks (pipeline.runtimes.placement) at the stage that needs the most device memory:
    what a run with runtime.gpus must place across its devices."""
    from pipeline.runtimes.placement import model_blocks

    todo = [r for r in rows if not r.exists and r.device_bytes] or [r for r in rows if r.device_bytes]
    if not todo:
        return []
    parts = max(todo, key=lambda r: r.device_bytes).parts
    return model_blocks(inv, parts.get("weights", 0.0), parts.get("kv_cache", 0.0), parts.get("logits", 0.0))


def plan_original(cfg):
    from pipeline.compose import load_variant

    return load_variant("original")


def _calibration_ratio(v) -> float:
    """A GPTQ/AWQ quantization's calibration tokens against the default recipe's 64 x 256 (its time grows with
    them); 1 for other quantizers."""
    cal = (v.quantize or {}).get("calibration") or {}
    if not (v.quantize or {}).get("bits"):
        return 1.0
    return (int(cal.get("samples", 64)) * int(cal.get("seq_len", 256))) / (64 * 256)


def _bench_samples(cfg, task: str) -> int:
    """The samples a benchmark task runs under the profile (its first profile.bench_limit(s), else all)."""
    from pipeline.suites.lmeval.tasks import sample_count

    total = sample_count(task)
    limit = cfg.profile.bench_limit_for(task)
    return min(limit, total) if limit else total


def _load_levels(cfg):
    """The load sweep of one served variant (speed_rates.PlannedSweep: repeats, depths, each concurrency level's
    requests, a level past the knee counted too, and the seconds a level may last)."""
    from pipeline.instruments.loadgen import level_requests
    from pipeline.plan.speed_rates import PlannedSweep

    lc = cfg.load
    return PlannedSweep(rounds=lc.repeats, depths=tuple(lc.sweep_depths(cfg.workload.context_tokens)),
                        requests=level_requests(list(lc.concurrency), lc.min_requests, lc.requests_per_stream),
                        cap=float(lc.max_seconds_per_level))


def _probe_ratio(cfg) -> float:
    """The speed stage's work per variant against the quick profile's (10 trials of 256 + 64 tokens)."""
    s = cfg.profile.speed
    return (s.trials * s.repeats * (s.prompt_tokens / 8 + s.decode_tokens)) / (10 * (256 / 8 + 64))


def totals(rows: list[Footprint]) -> dict:
    """What is still to be built: disk summed, memory at the largest stage (stages run one at a time), time summed."""
    todo = [r for r in rows if not r.exists]
    host = max(todo, key=lambda r: r.host_bytes, default=None)
    device = max(todo, key=lambda r: r.device_bytes, default=None)
    times = [r.time_s for r in todo if r.time_s is not None]
    return {"disk_bytes": sum(r.disk_bytes for r in todo), "host_bytes": host.host_bytes if host else 0.0,
            "host_stage": f"{host.stage} {host.variant}" if host else None,
            "device_bytes": device.device_bytes if device else 0.0,
            "device_stage": f"{device.stage} {device.variant}" if device else None,
            "time_s": sum(times), "timed_stages": len(times), "stages": len(todo), "built": len(rows) - len(todo)}


def fit_problems(plan: dict, free: dict, headroom: float) -> list[str]:
    """Each resource the run needs more of than this machine has free, with ``headroom`` of it kept free."""
    t, keep = plan["totals"], 1 - headroom
    out = []
    if t["disk_bytes"] > keep * free["disk_bytes"]:
        out.append(f"disk: the artifacts still to write need {t['disk_bytes'] / GB:.2f} GB in {free['disk_path']}, "
                   f"and {free['disk_bytes'] / GB:.2f} GB are free, of which {keep:.0%} ({keep * free['disk_bytes'] / GB:.2f} "
                   f"GB) may be used")
    if free["memory_bytes"] is not None and t["host_bytes"] > keep * free["memory_bytes"]:
        out.append(f"host memory: the largest stage ({t['host_stage']}) needs {t['host_bytes'] / GB:.2f} GB, and "
                   f"{free['memory_bytes'] / GB:.2f} GB are available ({free['memory_source']}), of which "
                   f"{keep:.0%} ({keep * free['memory_bytes'] / GB:.2f} GB) may be used")
    if free.get("devices") is not None and plan.get("device_blocks"):
        from pipeline.runtimes.placement import place

        try:
            # each device keeps runtime.gpu_headroom free, as the runtimes place it
            place(plan["device_blocks"], free["devices"], free["gpus"], free["gpu_headroom"],
                  what=f"the largest stage ({t['device_stage']})")
        except ConfigError as exc:
            out.append(f"device memory: {exc}")
    if free.get("device_bytes") is not None and t["device_bytes"] > keep * free["device_bytes"]:
        out.append(f"device memory: the largest stage ({t['device_stage']}) needs {t['device_bytes'] / GB:.2f} GB, "
                   f"and {free['device_bytes'] / GB:.2f} GB are free on the device, of which {keep:.0%} "
                   f"({keep * free['device_bytes'] / GB:.2f} GB) may be used")
    return out


def refusal(plan: dict, problems: list[str], headroom: float) -> str:
    return (f"this run does not fit this machine ({plan['model']}, {plan['params'] / 1e9:.2f} B parameters, "
            f"variants {', '.join(plan['variants'])}; {headroom:.0%} kept free, capacity.headroom): "
            + "; ".join(problems) + ". Nothing was computed. Free space, pick fewer or smaller variants "
            "(run.variants=[...]), move paths.artifacts to a larger disk, or override with plan.check=false")


def refuse_unless_fits(cfg) -> None:
    """The check at the start of a run, before any work: raises ConfigError naming the numbers when the run's
    disk or memory does not fit (plan.check=false skips it)."""
    from pipeline.runtimes.model_inventory import NotLocal

    if not cfg.plan.check:
        return
    try:
        plan = build_plan(cfg, variants=[cfg.variant], with_times=False)
    except NotLocal as exc:       # the download itself is checked for space (prepare); the rest is unknown yet
        log.warning("no plan before the download: %s", exc)
        return
    problems = fit_problems(plan, machine_free(cfg, plan["on_device"]), cfg.capacity.headroom)
    if problems:
        raise ConfigError(refusal(plan, problems, cfg.capacity.headroom))


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def format_plan(plan: dict, free: dict, headroom: float) -> str:
    w = plan["workload"]
    lines = [f"plan: {plan['model']} ({plan['params'] / 1e9:.3f} B parameters; shapes from {plan['source']}), "
             f"run {plan['run']}: {w['conversations']} conversations, at most {w['reply_tokens']} reply tokens, "
             f"contexts up to {w['context_tokens']} tokens",
             f"times: {plan['time_basis']}" if plan.get("time_basis") else "times: not estimated", "",
             "| stage | variant | disk MB | peak host MB | peak device MB | time | time from |",
             "|---|---|---|---|---|---|---|"]
    for r in plan["rows"]:
        mark = " (built)" if r.exists else ""
        lines.append(f"| {r.stage}{mark} | {r.variant} | {r.disk_bytes / MIB:,.0f} | {r.host_bytes / MIB:,.0f} | "
                     f"{r.device_bytes / MIB:,.0f} | {_fmt_time(r.time_s)} | {r.time_basis} |")
    t = plan["totals"]
    keep = 1 - headroom
    lines += ["", f"still to run: {t['stages']} stages ({t['built']} already built), time {_fmt_time(t['time_s'])} "
                  f"({t['timed_stages']} of them timed)",
              f"disk: {t['disk_bytes'] / GB:.2f} GB to write; {free['disk_bytes'] / GB:.2f} GB free in "
              f"{free['disk_path']} ({keep:.0%} usable: {keep * free['disk_bytes'] / GB:.2f} GB)"]
    if free["memory_bytes"] is not None:
        lines.append(f"host memory: {t['host_bytes'] / GB:.2f} GB at the largest stage ({t['host_stage']}); "
                     f"{free['memory_bytes'] / GB:.2f} GB available ({free['memory_source']}; {keep:.0%} usable: "
                     f"{keep * free['memory_bytes'] / GB:.2f} GB)")
    if free.get("device_bytes") is not None:
        lines.append(f"device memory: {t['device_bytes'] / GB:.2f} GB at the largest stage ({t['device_stage']}); "
                     f"{free['device_bytes'] / GB:.2f} GB free")
    if free.get("devices") is not None and plan.get("device_blocks"):
        from pipeline.runtimes.placement import place

        try:
            p = place(plan["device_blocks"], free["devices"], free["gpus"], free["gpu_headroom"])
            lines.append(f"device memory: {t['device_bytes'] / GB:.2f} GB at the largest stage ({t['device_stage']}) "
                         f"on {', '.join(f'cuda:{d} ({n} layers, {b / GB:.2f} GB)' for d, n, b in zip(p.devices, p.layers, p.planned))}: "
                         f"{p.why}")
        except ConfigError:
            pass                # fit_problems names it
    return "\n".join(lines)


def run_plan(cfg) -> int:
    """``quantdrift plan``: print the table and the totals; exit 2 when the run does not fit."""
    plan = build_plan(cfg)
    free = machine_free(cfg, plan["on_device"])
    print(format_plan(plan, free, cfg.capacity.headroom))
    problems = fit_problems(plan, free, cfg.capacity.headroom)
    if problems:
        raise ConfigError(refusal(plan, problems, cfg.capacity.headroom))
    print("fits: yes")
    from pipeline.infra.model_source import classify_source

    kind, location = classify_source(cfg.model.source)
    if kind == "folder":      # a folder is read in place: what would stop every variant is found now, not hours in
        from pipeline.stages import preflight

        found = preflight.checkpoint_problems(cfg, Path(location))
        if found:
            raise ConfigError(preflight.refusal(found))
        print("pre-flight: the chat template renders the run's conversations and every quantizer's check passed")
    else:
        print(f"pre-flight: runs at the start of `make compare` (a {kind} source is read once it is prepared)")
    return 0
