"""Each stage's time, from earlier measured runs scaled to the planned one, or with a short calibration.

A measured run is a ``summary.json`` under paths.results (its stage times: references per suite, per variant
free-running and scoring, the run's speed and load stages, each artifact's quantization) plus, where its
artifacts are still on disk, the stage manifests the summary does not carry (prepare, the F16 conversion, parity,
the dequantized stand-ins, the original's own free-running baseline). A planned stage takes the time of the same
stage of the same variant (else of the measured variant of the same weight kind with the nearest size), scaled by
the ratio of weight bytes (decode reads every weight once per token) and of token budgets (the suites' capped
reply budgets under each run's profile). A run from this CPU (the same instruction-set key) is used as it is; one
from another machine is scaled by the ratio of memory bandwidths, this machine's measured now in about a second:
the short calibration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


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
    speed_labels: int = 1
    load_variants: int = 1
    load_cells: int = 1             # load levels one variant ran: repeats x depths x concurrency levels
    reply_budget: dict | None = None                # suite -> budget under its profile (filled by the planner)
    work: dict | None = None        # suite -> its token counts under the run's profile (filled by the planner)
    rates: dict = field(default_factory=dict)       # variant -> {"prefill", "decode": tokens/s, "load_s"}
    scored_tokens: int | None = None                # reply tokens the run scored (its replies' real lengths)
    vocab: int | None = None
    source_kind: str | None = None  # what its prepare stage made the original from (prepare.classify_source)
    bench_samples: dict = field(default_factory=dict)   # (task, variant) -> samples the benchmark stage ran


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
    """What the prepare stage did with a run's source (prepare.PREPARE_WORK: a GGUF file dequantized, a folder used
    in place, a hub id downloaded); None when the source cannot be classified here."""
    from pipeline.infra.errors import ConfigError
    from pipeline.stages.prepare import PREPARE_WORK, classify_source

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
    for name in variants:
        v = s["variants"][name]
        sp = v.get("speed") or {}
        if sp.get("prefill_tokens_per_s") and sp.get("decode_tokens_per_s"):
            mr.rates[name] = {"prefill": sp["prefill_tokens_per_s"], "decode": sp["decode_tokens_per_s"],
                              "load_s": sp.get("load_s") or 0.0}
        mr.scored_tokens = mr.scored_tokens or (v.get("drift") or {}).get("scored_tokens")
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
    order = (s.get("speed_protocol") or {}).get("order") or [[]]
    mr.speed_labels = max(1, len(order[0]))
    lc = s.get("load") or {}
    served = [n for n, v in (lc.get("variants") or {}).items() if v.get("status") == "ok"]
    mr.load_variants = max(1, len(served))
    mr.load_cells = max(1, int(lc.get("repeats") or 1) * len(lc.get("depths") or [0])
                        * len(lc.get("concurrency") or [0]))
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
    from pipeline.measure.stage_folders import stage_walls

    mr.walls.update(stage_walls(Path(artifacts) / model, run, variants))
    return mr


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
    one on this CPU, then the most stages (a run of a few variants on this CPU predicts the others worse than a
    complete one from another CPU rescaled by bandwidth)."""
    def rank(r: MeasuredRun):
        return (r.model == model, len(r.rates), r.cpu_key == cpu_key and cpu_key is not None, len(r.walls))

    return sorted(runs, key=rank, reverse=True)


def choose_run(runs: list[MeasuredRun], model: str, cpu_key: str | None) -> MeasuredRun | None:
    """The best run to take times from (``rank_runs``)."""
    ranked = rank_runs(runs, model, cpu_key)
    return ranked[0] if ranked else None


def bandwidth_here(threads: int) -> float:
    """This machine's memory bandwidth in bytes/s, measured now in about a second (the short calibration)."""
    from pipeline.measure.bandwidth import measure_bandwidth

    return measure_bandwidth("cpu", mib=128, repeats=3, threads=threads)["bytes_per_s"]


def calibration_factor(mr: MeasuredRun, cpu_key: str | None, threads: int, measure=None,
                       recorded_here: float | None = None) -> tuple[float, str]:
    """(multiplier, what it rests on): 1 on the run's own CPU; else the run's bandwidth / this machine's, measured
    now, or ``recorded_here`` (bytes/s this machine recorded earlier: a compared run's own reading)."""
    if mr.cpu_key and mr.cpu_key == cpu_key:
        return 1.0, f"measured here ({mr.label}, same CPU key {cpu_key})"
    if not mr.bandwidth_bytes_per_s:
        return 1.0, f"measured on another CPU ({mr.label}: {mr.cpu}), not rescaled (it recorded no bandwidth)"
    here = recorded_here or (measure() if measure is not None else bandwidth_here(threads))
    factor = mr.bandwidth_bytes_per_s / here
    return factor, (f"calibration: {mr.label} ({mr.cpu}, {mr.bandwidth_bytes_per_s / 1e9:.1f} GB/s) rescaled by "
                    f"this machine's bandwidth {'as the compared run recorded it' if recorded_here else 'measured now'} "
                    f"({here / 1e9:.1f} GB/s)")


@dataclass
class TimeModel:
    """Scales a measured run's stage times to the planned run."""

    run: MeasuredRun
    factor: float
    basis: str
    plan_budget: dict                     # suite -> reply-token budget of the planned run
    leave_out: bool = False               # never a variant's own measurement (a run compared with itself)
    plan_work: dict | None = None         # suite -> the planned run's token counts (stage_plan.Workload.per_suite)
    plan_params: int | None = None
    plan_vocab: int | None = None

    def _fill(self) -> float:
        """The measured run's replies' real length over their budget (replies stop before it)."""
        budget = sum((self.run.reply_budget or {}).values())
        return min(1.0, self.run.scored_tokens / budget) if budget and self.run.scored_tokens else 1.0

    def _rates(self, measured: str, nbytes: float, params: float) -> dict | None:
        """Seconds per prefill token, per decoded token and to load, for a variant of ``nbytes`` bytes and
        ``params`` parameters, from the measured variant's speed figures: prefill is compute (per token it grows
        with the parameters); a decoded token reads every weight once (bytes over the run's measured bandwidth) on
        top of a fixed cost per token (the measured time per token less that read, which dominates a small model);
        loading is the measured load (mostly fixed costs on a small model: the runtime's start, a transformers
        model's construction) plus one pass over the added bytes."""
        r, v = self.run.rates.get(measured), self.run.variants.get(measured) or {}
        if not r or not v.get("bytes"):
            return None
        bw, mbytes = self.run.bandwidth_bytes_per_s, v["bytes"]
        per_token, load = 1.0 / r["decode"], r["load_s"]
        if bw:
            per_token = max(0.0, per_token - mbytes / bw) + nbytes / bw
            load += max(0.0, nbytes - mbytes) / bw
        else:
            per_token *= nbytes / mbytes
        return {"prefill": params / self.run.params / r["prefill"], "decode": per_token, "load": load}

    def _rate_pair(self, measured: str, nbytes: float, params: int | None) -> tuple[dict | None, dict | None]:
        """The measured variant's rates at its own size and at the planned one (``_rates``)."""
        run = self.run
        mbytes = (run.variants.get(measured) or {}).get("bytes") or 0
        return (self._rates(measured, mbytes, run.params),
                self._rates(measured, nbytes, params or self.plan_params or run.params))

    def _cost(self, stage: str, rates: dict, work: dict, vocab: float, fill: float, per_row: float) -> float:
        """A stage's seconds by component: loading, prompt tokens read (each text once: the history's prefix is
        reused), reply tokens decoded (free-running and the reference) or read (teacher-forced scoring), and the
        work per scored row of the vocabulary (log-probs, KLD, top-K: ``per_row`` seconds per entry)."""
        prefill = sum(w.get("prefill_tokens", w["prompt_tokens"]) for w in work.values())
        replies = sum(w["reply_tokens"] for w in work.values()) * fill
        cost = rates["load"] + prefill * rates["prefill"]
        if stage == "score":
            return cost + replies * rates["prefill"] + replies * vocab * per_row
        cost += replies * rates["decode"]
        if stage == "reference":        # the replies generated, then read again teacher-forced for their log-probs
            cost += (prefill + replies) * rates["prefill"] + replies * vocab * per_row
        return cost

    def by_component(self, stage: str, measured: str, wall: float, nbytes: float, suites: list[str] | None,
                     params: int | None, measured_suites: list[str] | None = None) -> float | None:
        """The measured stage's wall carried to the planned one by the ratio of their component costs (each at its
        own size, token counts and vocabulary); scoring's and the reference's cost per vocabulary entry is what the
        measured wall leaves after its tokens. None without speed figures or token counts to rest on."""
        run = self.run
        if not (self.plan_work and run.work and run.vocab and self.plan_vocab):
            return None
        mrates, prates = self._rate_pair(measured, nbytes, params)
        if mrates is None or prates is None:
            return None
        pwork = {s: w for s, w in self.plan_work.items() if s in (suites or self.plan_work)}
        # the measured wall covers the measured run's suites (one suite for a reference)
        mwork = {s: w for s, w in run.work.items() if s in (measured_suites or run.work)}
        fill = self._fill()
        base = self._cost(stage, mrates, mwork, run.vocab, fill, 0.0)
        rows = sum(w["reply_tokens"] for w in mwork.values()) * fill * run.vocab
        per_row = max(0.0, wall - base) / rows if stage in ("score", "reference") and rows else 0.0
        measured_cost = self._cost(stage, mrates, mwork, run.vocab, fill, per_row)
        if measured_cost <= 0 or not pwork or not mwork:
            return None
        return wall * self._cost(stage, prates, pwork, self.plan_vocab, fill, per_row) / measured_cost

    def _tokens(self, suites: list[str] | None = None) -> float:
        """Planned reply-token budget over the measured run's (a suite it did not have: against all it had)."""
        mb = self.run.reply_budget or {}
        suites = suites or list(self.plan_budget)
        plan = sum(self.plan_budget.get(s, 0) for s in suites)
        meas = sum(mb[s] for s in suites if s in mb) or sum(mb.values())
        return plan / meas if meas else 1.0

    def _match(self, stage: str, name: str, kind: str, nbytes: float) -> tuple[str, float] | None:
        """(measured variant, its wall) for this stage: the same variant, else the same kind with the nearest
        size (then the time scales by the byte ratio). Free-running matches on where the replies come from."""
        field_ = "generates" if stage == "evaluate" else "kind"
        if (stage, name) in self.run.walls and not self.leave_out:
            return name, self.run.walls[(stage, name)]
        # a variant that reused the reference (0 s) says nothing about generating
        usable = {n: v for n, v in self.run.variants.items() if (stage, n) in self.run.walls and v["bytes"]
                  and self.run.walls[(stage, n)] and not (self.leave_out and n in (name, name.split("+")[0]))}
        same = [(abs(v["bytes"] - nbytes), n) for n, v in usable.items() if v[field_] == kind]
        if not same:
            same = [(abs(v["bytes"] - nbytes), n) for n, v in usable.items()]
        if not same:
            return None
        n = min(same)[1]
        return n, self.run.walls[(stage, n)]

    def estimate(self, stage: str, name: str, kind: str, nbytes: float, suites: list[str] | None = None,
                 params: int | None = None, extra: float = 1.0, load_levels: tuple[int, float] | None = None,
                 source: str | None = None) -> tuple[float | None, str]:
        """(seconds, basis) of ``stage`` for the planned variant ``name``. ``load_levels``: the planned load sweep's
        levels per variant and the seconds one level may last (load.max_seconds_per_level): a level's measured time
        scales with the bytes up to that cap, then the levels add up."""
        run = self.run
        if stage == "prepare" and source and run.source_kind and source != run.source_kind:
            return None, (f"not comparable: {run.label}'s source was {run.source_kind}, this one is {source}")
        if stage in ("prepare", "convert_f16", "parity", "standin", "baseline"):
            # shared stages, and those of one variant with nothing comparable beside them: their own measurement
            walls = [w for (s, k), w in run.walls.items() if s == stage and k in ("-", name)] or \
                [w for (s, _), w in run.walls.items() if s == stage]
            if not walls:
                return None, f"no {stage} stage measured in {run.label}"
            if stage == "baseline" and "original" in run.rates:
                t = self.by_component("evaluate", "original", walls[0], nbytes, None, params)
                if t is not None:
                    return t * self.factor, f"{run.label} by component (original's speeds)"
            ratio = (params or run.params) / run.params * (self._tokens() if stage == "baseline" else 1.0)
            return walls[0] * ratio * self.factor, f"{run.label} x{ratio:.2g} (params{' x tokens' * (stage == 'baseline')})"
        if stage == "reference":
            own = (stage, suites[0]) in run.walls
            walls = [run.walls[(stage, suites[0])]] if own else [w for (s, _), w in run.walls.items()
                                                                 if s == "reference"]
            if not walls:
                return None, f"no reference stage in {run.label}"
            producer = "gguf_f16" if "gguf_f16" in run.rates else (self._match("score", name, kind, nbytes) or [""])[0]
            t = self.by_component(stage, producer, sum(walls), nbytes, suites, params,
                                  [suites[0]] if own else [s for (st, s) in run.walls if st == "reference"])
            if t is not None:
                return t * self.factor, f"{run.label} by component ({producer}'s speeds)"
            mb = run.reply_budget or {}
            meas = mb.get(suites[0]) if own else sum(mb.values())
            ratio = (params or run.params) / run.params * (self.plan_budget.get(suites[0], 0) / meas if meas else 1.0)
            return sum(walls) * ratio * self.factor, f"{run.label} x{ratio:.2g} (params x tokens)"
        if stage in ("speed", "load"):
            if (stage, "*") not in run.walls:
                return None, f"no {stage} stage in {run.label}"
            per = run.walls[(stage, "*")] / (run.speed_labels if stage == "speed" else run.load_variants)
            ref = self._match("score", name, kind, nbytes)
            ratio = nbytes / (run.variants[ref[0]]["bytes"] or nbytes) if ref else 1.0
            if stage == "load" and load_levels:
                # a served level decodes: it grows with the time per decoded token (bytes read plus fixed costs)
                mrates, prates = self._rate_pair(ref[0], nbytes, params) if ref else (None, None)
                if mrates and prates:
                    ratio = prates["decode"] / mrates["decode"]
                levels, cap = load_levels
                level = per / run.load_cells * ratio * self.factor
                capped = " (capped: load.max_seconds_per_level)" if level > cap else ""
                return (min(level, cap) * levels, f"{run.label} per load level x{ratio:.2g} "
                        f"({'time per decoded token' if mrates and prates else 'bytes'}) x {levels} levels{capped}")
            return per * ratio * extra * self.factor, f"{run.label} per variant x{ratio * extra:.2g} (bytes)"
        if stage.startswith("bench:"):
            return self._bench(stage, name, kind, nbytes, params, extra)
        found = self._match(stage, name, kind, nbytes)
        if found is None:
            return None, f"no {stage} stage of a comparable variant in {run.label}"
        other, wall = found
        via = "" if other == name else f" via {other}"
        if stage in ("evaluate", "score"):
            t = self.by_component(stage, other, wall, nbytes, None, params)
            if t is not None:
                return t * extra * self.factor, f"{run.label}{via} by component"
        ratio = nbytes / (run.variants.get(other, {}).get("bytes") or nbytes)
        if stage in ("evaluate", "score", "baseline"):
            ratio *= self._tokens()
        ratio *= extra
        return wall * ratio * self.factor, f"{run.label}{via} x{ratio:.2g}"

    def _bench(self, stage: str, name: str, kind: str, nbytes: float, params: int | None,
               samples: float) -> tuple[float | None, str]:
        """A benchmark task's stage: the same task on the nearest measured variant, per sample, carried by the time
        per decoded token (a task that generates) or per prompt token (log-likelihoods), times ``samples``."""
        run, task = self.run, stage.split(":", 1)[1]
        found = self._match(stage, name, kind, nbytes)
        if found is None or not run.bench_samples.get((task, found[0])):
            return None, f"no {stage} stage in {run.label}"
        other, wall = found
        mrates, prates = self._rate_pair(other, nbytes, params)
        from pipeline.suites.lmeval.tasks import get_task

        rate = "decode" if get_task(task).generates else "prefill"
        ratio = prates[rate] / mrates[rate] if mrates and prates else nbytes / run.variants[other]["bytes"]
        ratio *= samples / run.bench_samples[(task, other)]
        via = "" if other == name else f" via {other}"
        return wall * ratio * self.factor, f"{run.label}{via} x{ratio:.2g} (samples x time per {rate} token)"
