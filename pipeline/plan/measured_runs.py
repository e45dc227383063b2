"""The finished runs the planner takes its times from: each ``summary.json`` under paths.results read into a
``MeasuredRun`` (its stage walls, peaks, speed figures, token work and where each wall was measured), ranked for
the planned model, and rescaled to this machine by memory bandwidth and, for prompt work, by compute (the short
calibration). The time model on
them is ``pipeline.plan.stage_rates``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# what one speed-probe label costs besides its worker's start: warmup + rounds x repeats generations of
# prompt_tokens read and decode_tokens decoded (summary.speed_protocol; profile.speed, its trials the rounds)
SPEED_PROTOCOL = ("rounds", "warmup", "repeats", "prompt_tokens", "decode_tokens")
# the profile keys that set a run's token counts (config.schema.ProfileConfig), recorded in its summary
WORKLOAD_KEYS = ("max_conversations", "max_new_tokens_cap", "per_suite")


def speed_protocol(speed) -> dict:
    """A profile's speed block (config.schema.SpeedConfig) as the summary records its protocol."""
    return {"rounds": speed.trials, "warmup": speed.warmup, "repeats": speed.repeats,
            "prompt_tokens": speed.prompt_tokens, "decode_tokens": speed.decode_tokens}


@dataclass
class MeasuredRun:
    label: str                      # results/<model>/<run>
    model: str
    run: str
    profile: str
    suites: list[str]
    params: int
    cpu_key: str | None
    cpu: str
    bandwidth_bytes_per_s: float | None
    variants: dict                  # name -> {"bytes", "kind", "runtime", "calibration_tokens"}
    walls: dict = field(default_factory=dict)      # (stage, key) -> seconds
    peaks_mb: dict = field(default_factory=dict)   # (stage, key) -> MB measured
    load_variants: int = 1
    load_cells: int = 1             # load levels one variant ran: repeats x depths x concurrency levels
    reply_budget: dict | None = None                # suite -> budget under its profile (filled by the planner)
    work: dict | None = None        # suite -> its token counts under the run's profile (filled by the planner)
    rates: dict = field(default_factory=dict)       # variant -> {"prefill", "decode": tokens/s, "load_s"}
    scored_tokens: int | None = None                # reply tokens the run scored (its replies' real lengths)
    vocab: int | None = None
    source_kind: str | None = None  # what its prepare stage made the original from (infra.model_source.classify_source)
    bench_samples: dict = field(default_factory=dict)   # (task, variant) -> samples the benchmark stage ran
    speed_protocol: dict | None = None  # the speed stage's rounds, warmup, repeats and token counts per probe
    speed_round: list = field(default_factory=list)     # one round's labels (a variant, or its A/A copy)
    exact_builder: str | None = None   # the variant whose scoring built the original's exact rows (the first compared)
    parity_tokens: int | None = None    # the tokens its parity check read (summary.reference.parity.tokens)
    wall_cpus: dict = field(default_factory=dict)   # (stage, key) -> the CPU a model-level stage ran on, where known
    load_levels: dict = field(default_factory=dict)  # variant -> [{concurrency, depth, requests, wall, ttft, e2e}]
    load_fixed_s: float | None = None   # a served variant's round less its levels (server start, load, guidellm)
    wall_bandwidths: dict = field(default_factory=dict)  # (stage, key) -> bytes/s read nearest a model stage
    convert_phases: dict | None = None  # its F16 conversion's phases (gguf_convert.PHASES, exit), where on disk
    quant_elements: dict = field(default_factory=dict)  # GGUF base variant -> {ggml type: weights in its file}
    compute_flops_per_s: float | None = None  # its compute reading (bandwidth.measure_compute), where it took one
    exactness: set = field(default_factory=set)   # variants whose scoring read the exact-sample transcript again
    workload: dict | None = None    # its profile's WORKLOAD_KEYS as it ran (None: a run from before they were recorded)

    @property
    def speed_labels(self) -> int:
        """Probe labels a round of its speed stage measured (the variants and the A/A copy)."""
        return max(1, len(self.speed_round))

    def cpu_of(self, stage: str, key: str) -> str | None:
        """The CPU a stage's wall was measured on: its manifest's, else the run's."""
        return self.wall_cpus.get((stage, key), self.cpu_key)


def _kind(v: dict) -> str:
    """The weight kind as the planner names it (stage_plan.time_kind): ggml, original, packed:<method>."""
    art = v.get("artifact") or {}
    if art.get("gguf_type"):
        return "ggml"
    if art.get("format") in (None, "hf-safetensors"):
        return "original"
    return f"packed:{(art.get('quantize_settings') or {}).get('method', art.get('format'))}"


def _generated_on_gguf(v: dict) -> bool:
    """Its replies came from a GGUF file (its own, or the dequantized stand-in's)."""
    return bool((v.get("artifact") or {}).get("gguf_type")) or "GGUF" in str((v.get("paths") or {}).get("free_running"))


def source_kind(source: str) -> str | None:
    """What the prepare stage did with a run's source (infra.model_source.PREPARE_WORK: a GGUF file dequantized, a folder used
    in place, a hub id downloaded); None when the source cannot be classified here."""
    from pipeline.infra.errors import ConfigError
    from pipeline.infra.model_source import PREPARE_WORK, classify_source

    try:
        return PREPARE_WORK[classify_source(source)[0]]
    except ConfigError:           # a file no longer here: its suffix says
        return PREPARE_WORK["gguf"] if source.lower().endswith(".gguf") else None


def read_run(summary_path: Path, artifacts: Path) -> MeasuredRun | None:
    from pipeline.infra.files import read_json

    try:
        s = read_json(summary_path)
    except (OSError, ValueError):
        return None
    st = s.get("stage_times") or {}
    if not st or not (s.get("model") or {}).get("params"):
        return None
    model, run = s["model"]["name"], s["run"]["name"]
    variants = {}
    for name, v in (s.get("variants") or {}).items():
        if v.get("status") != "ok":
            continue
        art = v.get("artifact") or {}
        cal = (art.get("quantize_settings") or {}).get("calibration") or {}
        variants[name] = {"bytes": (v.get("memory") or {}).get("artifact_bytes"), "kind": _kind(v),
                          "generates": "ggml" if _generated_on_gguf(v) else _kind(v),
                          "runtime": v.get("runtime"), "base": name.split("+", 1)[0],
                          "calibration_tokens": (cal.get("samples") or 0) * (cal.get("seq_len") or 0) or None}
    mr = MeasuredRun(label=f"{summary_path.parent.parent.name}/{summary_path.parent.name}", model=model, run=run,
                     profile=s["run"].get("profile") or run, suites=list(s["run"].get("suites") or []),
                     params=int(s["model"]["params"]), cpu_key=(s.get("hardware") or {}).get("cpu_key"),
                     cpu=(s.get("hardware") or {}).get("cpu") or "?",
                     bandwidth_bytes_per_s=(s.get("bandwidth") or {}).get("bytes_per_s"), variants=variants,
                     vocab=(s.get("model") or {}).get("vocab_size"),
                     source_kind=source_kind((s.get("model") or {}).get("source") or ""))
    mr.compute_flops_per_s = (((s.get("bandwidth") or {}).get("compute")) or {}).get("flops_per_s")
    mr.workload = s["run"].get("workload")
    for name in variants:
        v = s["variants"][name]
        if elements := (v.get("artifact") or {}).get("type_elements"):
            mr.quant_elements.setdefault(variants[name]["base"], elements)
        sp = v.get("speed") or {}
        if sp.get("prefill_tokens_per_s") and sp.get("decode_tokens_per_s"):
            mr.rates[name] = {"prefill": sp["prefill_tokens_per_s"], "decode": sp["decode_tokens_per_s"],
                              "load_s": sp.get("load_s") or 0.0}
        mr.scored_tokens = mr.scored_tokens or (v.get("drift") or {}).get("scored_tokens")
        if (v.get("drift") or {}).get("kld_stored_exact_ratio") is not None:
            mr.exactness.add(name)        # score.kld_exactness: its runtime read the longest transcript again
            if mr.exact_builder is None:
                mr.exact_builder = name   # variants run in the summary's order; the first compared builds them
        for task, b in (v.get("benchmarks") or {}).items():
            if b.get("samples"):
                mr.bench_samples[(task, name)] = b["samples"]
            if b.get("wall_s") is not None:        # the task's own time, where stage_times has no bench column
                mr.walls.setdefault((f"bench:{task}", name), b["wall_s"])
    for suite, sec in (st.get("references_s") or {}).items():
        mr.walls[("reference", suite)] = sec
    for name, row in (st.get("variants_s") or {}).items():
        if row.get("free_running") is not None:
            mr.walls[("evaluate", name)] = row["free_running"]
        mr.walls[("score", name)] = (row.get("scoring") or 0) + (row.get("checks") or 0) + (row.get("deployment") or 0)
        for key in (k for k in row if k.startswith("bench:")):
            mr.walls[(key, name)] = row[key]
    mr.parity_tokens = ((s.get("reference") or {}).get("parity") or {}).get("tokens")
    order = (s.get("speed_protocol") or {}).get("order") or [[]]
    mr.speed_round = list(order[0])
    if all((s.get("speed_protocol") or {}).get(k) is not None for k in SPEED_PROTOCOL):
        mr.speed_protocol = {k: s["speed_protocol"][k] for k in SPEED_PROTOCOL}
    lc = s.get("load") or {}
    served = [n for n, v in (lc.get("variants") or {}).items() if v.get("status") == "ok"]
    mr.load_variants = max(1, len(served))
    mr.load_cells = max(1, int(lc.get("repeats") or 1) * len(lc.get("depths") or [0])
                        * len(lc.get("concurrency") or [0]))
    _read_load_levels(mr, lc)
    for stage, key in (("speed", "speed"), ("load", "load")):
        if (st.get("run_s") or {}).get(key) is not None:
            mr.walls[(stage, "*")] = st["run_s"][key]
    for name, v in (s.get("variants") or {}).items():
        art, mem = v.get("artifact") or {}, v.get("memory") or {}
        if art.get("quantize_wall_s") is not None:
            mr.walls[("quantize", name.split("+", 1)[0])] = art["quantize_wall_s"]
        if art.get("quantize_peak_rss_mb") is not None:
            mr.peaks_mb[("quantize", name.split("+", 1)[0])] = art["quantize_peak_rss_mb"]
        if mem.get("peak_rss_mb") is not None:
            mr.peaks_mb[("speed", name)] = mem["peak_rss_mb"]
    # every stage's peak host memory (this process and its children), where the run recorded it; a speed
    # probe's own peak (per variant, above) is the probe process alone
    for stage, keys in (st.get("peak_host_mb") or {}).items():
        for key, mb in keys.items():
            mr.peaks_mb.setdefault((stage, key), mb)
    # the stages the summary leaves out, from their manifests where the run's artifacts are still on disk
    from pipeline.infra.stage_folders import model_manifests, model_stage_bandwidths, model_stage_cpus, stage_walls

    model_dir = Path(artifacts) / model
    mr.walls.update(stage_walls(model_dir, run, variants))
    manifests = model_manifests(model_dir, variants)
    mr.wall_cpus = model_stage_cpus(manifests)
    mr.wall_bandwidths = model_stage_bandwidths(model_dir, manifests)
    mr.convert_phases = (manifests.get(("convert_f16", "-")) or {}).get("phases_s") or None
    mr.quant_elements.update({key: m["type_elements"] for (stage, key), m in manifests.items()
                              if stage == "quantize" and m.get("type_elements")})
    return mr


def _read_load_levels(mr: MeasuredRun, lc: dict) -> None:
    """Each served variant's levels (their requests, the seconds they took over all rounds: completed requests over
    requests per second, the median time to first token and end to end) and what a round spent outside its levels
    (the sweep's wall less every level's, per variant and round): the load sweep by component."""
    levels_s, rounds = 0.0, 0
    for name, v in (lc.get("variants") or {}).items():
        if v.get("status") != "ok":
            continue
        rows = []
        for depth, d in (v.get("depths") or {}).items():
            for c, lv in (d.get("levels") or {}).items():
                done, rps = lv.get("completed") or 0, lv.get("requests_per_s") or 0
                if done and rps and lv.get("e2e_p50_s"):
                    rows.append({"concurrency": int(c), "depth": int(depth), "requests": done, "wall": done / rps,
                                 "ttft": lv.get("ttft_p50_s") or 0.0, "e2e": lv["e2e_p50_s"]})
        if rows:
            mr.load_levels[name] = rows
            levels_s += sum(r["wall"] for r in rows)
            rounds += int(v.get("rounds") or lc.get("repeats") or 1)
    if rounds and lc.get("trials_wall_s"):
        mr.load_fixed_s = max(0.0, (lc["trials_wall_s"] - levels_s) / rounds)


def find_runs(results: Path, artifacts: Path, exclude: str | None = None) -> list[MeasuredRun]:
    """Every finished run under ``results`` (results/<model>/<run>/summary.json), ``exclude`` (a label) left out."""
    runs = []
    for path in sorted(Path(results).glob("*/*/summary.json")):
        mr = read_run(path, artifacts)
        if mr and mr.label != exclude:
            runs.append(mr)
    return runs


def rank_runs(runs: list[MeasuredRun], model: str, cpu_key: str | None) -> list[MeasuredRun]:
    """The runs best first: the same model's run, then the run whose speed figures cover the most variants, then
    one on this CPU, then the one whose speed figures rest on the most rounds (a run with its speed protocol cut
    short for time is a worse source of rates), then the most stages (a run of a few variants on this CPU predicts
    the others worse than a complete one from another CPU rescaled by bandwidth)."""
    def rank(r: MeasuredRun):
        return (r.model == model, len(r.rates), r.cpu_key == cpu_key and cpu_key is not None,
                int((r.speed_protocol or {}).get("rounds") or 0), len(r.walls))

    return sorted(runs, key=rank, reverse=True)


def choose_run(runs: list[MeasuredRun], model: str, cpu_key: str | None) -> MeasuredRun | None:
    """The best run to take times from (``rank_runs``)."""
    ranked = rank_runs(runs, model, cpu_key)
    return ranked[0] if ranked else None


def bandwidth_here(threads: int) -> float:
    """This machine's memory bandwidth in bytes/s, measured now in one to two seconds (the short calibration), the
    way every run records its own (``bandwidth.run_bandwidth``: the same buffer and repeats), so that the two
    readings compare (why a shorter copy does not: docs/plan.md, "How the prediction is made")."""
    from pipeline.instruments.bandwidth import measure_bandwidth

    return measure_bandwidth("cpu", threads=threads)["bytes_per_s"]


def compute_here(threads: int) -> float:
    """This machine's compute rate in FLOP/s, measured now the way every run records its own (a third of a second)."""
    from pipeline.instruments.bandwidth import measure_compute

    return measure_compute(threads)["flops_per_s"]


def compute_factor(mr: MeasuredRun, measure=None, recorded_here: float | None = None) -> tuple[float | None, str]:
    """(multiplier for the run's prompt work, what it rests on): the run's compute reading over this machine's,
    measured now (``measure``) or ``recorded_here`` (a compared run's own reading). None where the run took no
    reading (then its prompt work is rescaled by bandwidth like the rest) or a compared run has none."""
    if not mr.compute_flops_per_s or (recorded_here is None and measure is None):
        return None, ""
    here = recorded_here or measure()
    if not here:
        return None, ""
    return mr.compute_flops_per_s / here, (f"its prompt work by its compute reading "
                                           f"({mr.compute_flops_per_s / 1e9:.0f} GFLOP/s) over this machine's "
                                           f"({here / 1e9:.0f} GFLOP/s)")


def calibration_factor(mr: MeasuredRun, cpu_key: str | None, threads: int, measure=None,
                       recorded_here: float | None = None) -> tuple[float, str]:
    """(multiplier, what it rests on): the run's recorded bandwidth over this machine's, measured now or
    ``recorded_here`` (bytes/s this machine recorded earlier: a compared run's own reading). On the run's own CPU
    too: machines with the same instruction-set key differ, and so does one machine between runs (its host's
    memory, what runs beside it; the readings: docs/plan.md, "Every run rescaled by bandwidth, on its own CPU
    too"). 1 where the run
    recorded no bandwidth (on its own CPU as it is; from another, not rescaled)."""
    same = bool(mr.cpu_key) and mr.cpu_key == cpu_key
    where = f"measured here ({mr.label}, same CPU key {cpu_key})" if same else f"{mr.label} ({mr.cpu})"
    if not mr.bandwidth_bytes_per_s:
        return 1.0, (where if same else
                     f"measured on another CPU ({mr.label}: {mr.cpu}), not rescaled (it recorded no bandwidth)")
    here = recorded_here or (measure() if measure is not None else bandwidth_here(threads))
    factor = mr.bandwidth_bytes_per_s / here
    return factor, (f"{'' if same else 'calibration: '}{where} rescaled by its recorded bandwidth "
                    f"({mr.bandwidth_bytes_per_s / 1e9:.1f} GB/s) over this machine's "
                    f"{'as the compared run recorded it' if recorded_here else 'measured now'} ({here / 1e9:.1f} GB/s)")
