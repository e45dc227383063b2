"""Speed and memory measured so that a difference can be trusted: interleaved trials across variants.

After the sweep has evaluated every variant, each round measures every variant once (``pipeline.instruments.probe``: each
label's own process, loaded once for all rounds where memory allows, else a fresh one per trial), in an order
rotated by one place per round, so that drift of the machine over the run (a
neighbour's job, thermal state) spreads over all variants instead of landing on whichever ran last. The A/A
control, the first variant measured a second time each round under another label half a round later, gives the
run's own noise floor: the two must come out tied.

Figures per variant: the median over trials with a distribution-free 95 % interval (order statistics); the
decision compares two variants with a paired sign-flip test over the rounds (``pipeline.figures.stats``). The stage is
cached by every variant's trial spec and resumes trial by trial.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.figures.speed_trials import AA_SUFFIX, WORKERS_FRESH, WORKERS_KEPT, WORKERS_MIXED
from pipeline.infra.stage_cache import Journal, run_stage
from pipeline.infra.files import dir_bytes, read_json, stable_hash, write_json

log = logging.getLogger(__name__)

def trial_order(names: list[str], control: str | None, rounds: int) -> list[list[str]]:
    """Per round, the labels in measuring order: the variants rotated by one place per round; the control's A/A
    copy half a round after the control itself."""
    order = []
    for r in range(rounds):
        k = r % len(names)
        labels = names[k:] + names[:k]
        if control:
            at = (labels.index(control) + math.ceil((len(labels) + 1) / 2)) % (len(labels) + 1)
            labels.insert(at, control + AA_SUFFIX)
        order.append(labels)
    return order


def _control(cfg: Config, names: list[str]) -> str | None:
    sp = cfg.profile.speed
    if not sp.aa or not names:
        return None
    if sp.control == "auto":
        return names[0]
    if sp.control not in names:
        from pipeline.infra.errors import ConfigError

        raise ConfigError(f"profile.speed.control={sp.control!r} is not an evaluated variant of this run: expected "
                          f"auto or one of {', '.join(names)}")
    return sp.control


# A first guess at a loaded probe's resident memory beyond its artifact's bytes, used only until a probe of the same
# runtime has been measured (on the default's 135M model: transformers variants 0.9-1.1 GB for a 0.5 GB checkpoint,
# llama.cpp ones 0.2-0.35 GB)
_WORKER_OVERHEAD_MB = {"hf": 700.0}
_WORKER_OVERHEAD_DEFAULT_MB = 120.0
# of the memory available when a probe is about to be kept loaded, the share the kept probe plus one fresh probe of
# the largest variant may take (the rest is headroom)
_KEEP_SHARE = 0.8


class WorkerPool:
    """The probe processes kept loaded for all rounds, sized from measured memory. Before a label's probe is kept,
    the memory available now (after every probe already kept) must hold it plus a fresh probe of the largest
    variant, with 20 % headroom; what a probe takes is its own load peak measured in an earlier trial of the stage
    (a resumed stage), else its estimate scaled by the largest measured-to-estimated ratio of probes of the same
    runtime. A label refused keeps a fresh process per trial. On a GPU no probe is kept: each probe's device
    memory reading needs the device to hold that variant alone."""

    def __init__(self, cfg: Config, specs: dict[str, dict], labels: list[str]):
        from pipeline.instruments.bandwidth import resolve_device

        self.specs, self.labels = specs, labels
        self.enabled = resolve_device(cfg.runtime.device) == "cpu"
        self.workers: dict = {}
        self.kept: list[str] = []
        self.refused: dict[str, str] = {}
        self.measured_mb: dict[str, float] = {}     # label -> its probe's measured load peak
        self.ratio: dict[str, float] = {}           # runtime -> largest measured / estimated

    def _spec(self, label: str) -> dict:
        return self.specs[label.removesuffix(AA_SUFFIX)]

    def estimate_mb(self, label: str) -> float:
        spec = self._spec(label)
        return 1.2 * dir_bytes(spec["artifact"]) / 2**20 + _WORKER_OVERHEAD_MB.get(
            spec["runtime"], _WORKER_OVERHEAD_DEFAULT_MB)

    def expected_mb(self, label: str) -> float:
        if label in self.measured_mb:
            return self.measured_mb[label]
        return self.estimate_mb(label) * max(1.0, self.ratio.get(self._spec(label)["runtime"], 1.0))

    def record(self, label: str, trial: dict) -> None:
        """Take a trial's measured load peak as what this label's probe takes."""
        peak = trial.get("load_peak_rss_mb")
        if not peak:
            return
        self.measured_mb[label] = max(peak, self.measured_mb.get(label, 0.0))
        runtime = self._spec(label)["runtime"]
        self.ratio[runtime] = max(self.ratio.get(runtime, 0.0), peak / self.estimate_mb(label))

    def worker(self, label: str):
        """The label's kept probe (started now if memory allows), or None for a fresh process per trial."""
        from pipeline.instruments.probe import ProbeWorker

        if not self.enabled or label in self.refused:
            return None
        if label not in self.workers:
            need = self.expected_mb(label)
            largest = max(self.expected_mb(x) for x in self.labels)
            available = _mem_available_mb()
            if need + largest > _KEEP_SHARE * available:
                self.refused[label] = (f"{need:.0f} MB kept + {largest:.0f} MB for a fresh probe > "
                                       f"{_KEEP_SHARE:.0%} of the {available:.0f} MB available")
                log.info("speed: %s gets a fresh probe process per trial (%s)", label, self.refused[label])
                return None
            self.workers[label] = ProbeWorker(self._spec(label), label)
            if label not in self.kept:          # a probe restarted after a failed trial is the same kept label
                self.kept.append(label)
        return self.workers[label]

    def trial(self, label: str, max_cpu_noise: float) -> dict:
        """One trial of ``label`` on its kept probe (or a fresh one), its load peak recorded; a failed probe gives
        ``{"error": ...}`` (the variant is reported without speed, the others go on) and is started afresh next."""
        from pipeline.instruments.probe import run_trial

        try:
            worker = self.worker(label)
            trial = run_trial(self._spec(label), max_cpu_noise, label, worker)
            self.record(label, trial)
            if worker is not None and trial.get("peak_rss_per_trial") is False:
                # the kernel refused to reset the high-water mark: a kept process would report its load's peak in
                # every trial, so every later trial gets a fresh process of its own
                log.warning("speed: this kernel refuses to reset a process's peak RSS (/proc/self/clear_refs): a "
                            "fresh probe process per trial from here on")
                self.stop_keeping()
            return trial
        except Exception as exc:
            log.error("speed trial of %s failed: %s", label, exc)
            self.drop(label)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def drop(self, label: str) -> None:
        """Stop the label's kept probe (a failed trial: the next round starts it afresh)."""
        if label in self.workers:
            self.workers.pop(label).close()

    def stop_keeping(self) -> None:
        self.close()
        self.enabled = False

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()

    def mode(self) -> str:
        if not self.enabled or not self.kept:
            return WORKERS_FRESH
        return WORKERS_MIXED if self.refused else WORKERS_KEPT

    def describe(self) -> str:
        if not self.enabled and not self.kept:
            return "a fresh probe process per trial (the device holds one variant at a time)"
        return (f"{len(self.kept)} of {len(self.labels)} probe processes kept loaded for all rounds "
                f"({', '.join(self.kept) or 'none'}), sized from measured memory"
                + (f"; fresh per trial: {', '.join(f'{k} ({v})' for k, v in self.refused.items())}"
                   if self.refused else ""))


def _mem_available_mb() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**20


def speed_protocol() -> dict:
    """The version of the code a speed trial's figures come from: the probe (what is timed and how), the memory
    readings, and the trial scheme (order, workers). The figures derived from the trials (medians, intervals,
    the A/A floor) are computed when the summary is built, from the trials, never cached."""
    from pipeline.infra.code_version import code_version

    return code_version("pipeline.instruments.probe", "pipeline.instruments.memory", *_PROTOCOL_CODE)


def _stage(cfg: Config, results: dict[str, dict]) -> tuple[dict, Path, dict, list[str]] | None:
    """(probe specs, stage folder, cache key, extra-round labels) of this run's speed stage; None when no variant
    was evaluated."""
    specs = {n: r["probe"] for n, r in results.items() if r.get("status") == "ok" and r.get("probe")}
    if not specs:
        return None
    sp = cfg.profile.speed
    names = list(specs)
    control = _control(cfg, names)
    key = {"specs": {n: stable_hash(s) for n, s in specs.items()}, "trials": sp.trials, "control": control,
           "max_cpu_noise": sp.max_cpu_noise, "protocol": speed_protocol()}
    extra = [n for n in names if specs[n]["runtime"] in (sp.extra_runtimes or [])] if sp.extra_max_rounds else []
    if extra:
        key["extra"] = {"labels": extra, "max_rounds": sp.extra_max_rounds, "max_minutes": sp.extra_max_minutes,
                        "margin": cfg.regress.speed_margin, "target": cfg.regress.detect_target}
    return specs, cfg.model_dir / "runs" / cfg.run.name / "speed", key, extra


def finished_speed(cfg: Config, results: dict[str, dict]) -> tuple[dict | None, str | None]:
    """The speed stage of this run as it finished, measuring nothing: (its trials file's content, None), or
    (None, why there is none) where variants were evaluated but their trials are missing or were measured on
    other artifacts or with other code; (None, None) where no variant was evaluated."""
    from pipeline.infra.stage_cache import load_manifest

    stage = _stage(cfg, results)
    if stage is None:
        return None, None
    _, out_dir, key, _ = stage
    manifest = load_manifest(out_dir)
    if manifest is None or not (out_dir / "trials.json").is_file():
        return None, "the speed trials have not run for this run's variants"
    if manifest.get("key_hash") != stable_hash(key):
        return None, "the speed trials on disk were measured on other artifacts or with other code"
    return read_json(out_dir / "trials.json"), None


def measure_speed(cfg: Config, results: dict[str, dict]) -> dict | None:
    """Run (or resume) the interleaved trials of every evaluated variant; returns the trials file's content:
    {"rounds", "order", "control", "trials": {label: [trial result or {"error": ...}, one per round]}}."""
    stage = _stage(cfg, results)
    if stage is None:
        return None
    specs, out_dir, key, extra = stage
    sp = cfg.profile.speed
    control = key["control"]
    order = trial_order(list(specs), control, sp.trials)

    def build(tmp):
        journal = Journal(out_dir, "trials", key)
        total = sum(len(labels) for labels in order)
        pool = WorkerPool(cfg, specs, order[0])
        for r, labels in enumerate(order):       # a resumed stage: what its probes took is already measured
            for label in labels:
                if f"{r}:{label}" in journal:
                    pool.record(label, journal.get(f"{r}:{label}"))
        done = 0
        try:
            for r, labels in enumerate(order):
                for label in labels:
                    done += 1
                    item = f"{r}:{label}"
                    if item in journal:
                        continue
                    log.info("speed: trial %d/%d (round %d/%d): %s", done, total, r + 1, len(order), label)
                    journal.add(item, pool.trial(label, sp.max_cpu_noise))
            extra_order, stop = _extra_rounds(cfg, journal, order, extra, specs, pool)
        finally:
            pool.close()
        log.info("speed: %s", pool.describe())
        labels = [label for label in order[0]]
        trials = {lab: [journal.get(f"{r}:{lab}") for r in range(len(order))] for lab in labels}
        for r, round_labels in enumerate(extra_order):
            for lab in round_labels:
                trials[lab].append(journal.get(f"x{r}:{lab}"))
        write_json(tmp / "trials.json", {"rounds": len(order), "order": order, "control": control,
                                         "extra_order": extra_order, "extra_stop": stop,
                                         "extra_seconds": sum(journal.get(f"x{r}:_seconds")
                                                              for r in range(len(extra_order))),
                                         "workers": pool.mode(), "kept_workers": pool.kept,
                                         "fresh_workers": pool.refused, "trials": trials})
        return {"rounds": len(order), "control": control, "extra_rounds": len(extra_order)}

    run_stage("speed", out_dir, key, build, force=cfg.force)
    return read_json(out_dir / "trials.json")


def extra_spread(trials: dict[str, list[dict]], labels: list[str]) -> float | None:
    """The widest per-round spread (standard deviation of the log ratio over the rounds both measured, at its upper
    80 % confidence bound) of any two of ``labels``' decode rates: what the nightly gate's control-relative
    interval will be made of, for whichever of them it takes as the control."""
    import statistics

    def rate(t):
        return t.get("decode_tokens_per_s") if t and "error" not in t else None

    from scipy.stats import chi2

    widest = None
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            d = [math.log(x / y) for x, y in zip(map(rate, trials[a]), map(rate, trials[b])) if x and y]
            if len(d) >= 3:
                # an upper 80 % bound, not the sample's own spread: four quiet rounds by luck must not stop the
                # rounds a noisy machine needs
                upper = statistics.stdev(d) * math.sqrt((len(d) - 1) / chi2.ppf(0.2, len(d) - 1))
                widest = max(widest or 0.0, upper)
    return widest


def _extra_rounds(cfg: Config, journal, order: list[list[str]], labels: list[str], specs: dict,
                  pool: "WorkerPool") -> tuple[list[list[str]], str]:
    """After the interleaved rounds, rounds of the cheap runtimes' variants only (``profile.speed.extra_runtimes``,
    each round rotated), until the per-round spread of their ratios to each other lets the nightly gate detect a
    ``regress.detect_target`` regression beyond ``regress.speed_margin`` against a baseline measured alike, or a
    cap is reached (``extra_max_rounds``, ``extra_max_minutes``). Returns the extra rounds' order and why they
    stopped. Deterministic on resume: the need is recomputed from the journal, the time from each round's own
    recorded seconds."""
    import time

    from pipeline.figures.speed_control import rounds_needed

    sp = cfg.profile.speed
    by_runtime: dict[str, list[str]] = {}
    for n in labels:
        by_runtime.setdefault(specs[n]["runtime"], []).append(n)
    groups = [g for g in by_runtime.values() if len(g) >= 2]
    if not groups:
        return [], "no runtime with two variants to compare among the extra runtimes"
    labels = [n for g in groups for n in g]
    trials = {n: [journal.get(f"{r}:{n}") for r in range(len(order))] for n in labels}
    extra_order: list[list[str]] = []
    spent = 0.0
    while True:
        need = 0
        for g in groups:
            sd = extra_spread(trials, g)
            if sd is None:
                return extra_order, "fewer than 3 measured rounds to size the extra rounds from"
            need = max(need, rounds_needed({"sd": sd}, {"sd": sd}, cfg.regress.speed_margin,
                                           cfg.regress.detect_target, "higher") or 0)
        have = len(order) + len(extra_order)
        if have >= need:
            return extra_order, (f"{have} rounds reach a {cfg.regress.detect_target:.0%} detectable regression at "
                                 "this run's spread")
        if len(extra_order) >= sp.extra_max_rounds:
            return extra_order, (f"capped at {sp.extra_max_rounds} extra rounds (profile.speed.extra_max_rounds); "
                                 f"{need} rounds were needed")
        per_round = spent / len(extra_order) if extra_order else 0.0
        if spent + per_round > 60 * sp.extra_max_minutes:
            return extra_order, (f"capped at {sp.extra_max_minutes:g} min of extra rounds "
                                 f"(profile.speed.extra_max_minutes); {need} rounds were needed")
        r = len(extra_order)
        k = r % len(labels)
        round_labels = labels[k:] + labels[:k]
        if f"x{r}:_seconds" not in journal:
            started = time.monotonic()
            for label in round_labels:
                item = f"x{r}:{label}"
                if item in journal:
                    continue
                log.info("speed: extra round %d (need %d rounds in all): %s", r + 1, need, label)
                journal.add(item, pool.trial(label, sp.max_cpu_noise))
            journal.add(f"x{r}:_seconds", time.monotonic() - started)
        spent += journal.get(f"x{r}:_seconds")
        for label in round_labels:
            trials[label].append(journal.get(f"x{r}:{label}"))
        extra_order.append(round_labels)


# the functions and classes whose code the trials' figures come from (speed_protocol), taken as defined here
_PROTOCOL_CODE = (trial_order, WorkerPool, _control, measure_speed, _extra_rounds, extra_spread)
