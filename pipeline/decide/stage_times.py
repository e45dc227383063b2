"""How long each stage of a run took, read from the stages' own manifests (``wall_s``: the time a stage took when
it was built; a stage this run reused from an earlier one counts that build, so the figures add up to what the
run's results cost, not to this invocation's wall time)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.schema import Config
from pipeline.stages.load import completed_sweeps, sweep_stage
from pipeline.infra.stage_cache import load_manifest
from pipeline.infra.stage_folders import (evaluation_folders, model_folders, reference_folders, run_folders,
                                            stage_folders, wall_of)
from pipeline.infra.files import read_json


def _peak(folder: Path) -> float | None:
    m = load_manifest(folder)
    return ((m or {}).get("host_memory") or {}).get("peak_host_mb")


def stage_peaks(cfg: Config, names: list[str]) -> dict[str, dict[str, float]]:
    """Each stage's peak host memory in MB (this process and its children, ``host_memory`` in the stage's
    manifest), keyed as the planner keys its stages (``stage_folders``). Stages built before manifests carried it
    are left out."""
    out: dict[str, dict[str, float]] = {}
    for (stage, key), paths in stage_folders(cfg.model_dir, cfg.run.name, names, cfg.run.suites,
                                             cfg.run.bench_tasks).items():
        peaks = [p for p in (_peak(f) for f in paths) if p is not None]
        if peaks:
            out.setdefault(stage, {})[key] = max(peaks)
    return out


def evaluation_stages(cfg: Config, name: str) -> dict[str, float | None]:
    """One variant's stages of this run, in seconds (None: the stage has no manifest, e.g. never ran for it)."""
    return {k: wall_of(f) for k, f in evaluation_folders(cfg.model_dir, cfg.run.name, name,
                                                         cfg.run.bench_tasks).items()}


def variant_stages(cfg: Config, name: str) -> dict[str, float | None]:
    """Every stage one variant's result rests on: the model-level ones (shared by every run) and this run's."""
    return {**{k: wall_of(f) for k, f in model_folders(cfg.model_dir, name).items()}, **evaluation_stages(cfg, name)}


def reference_stages(cfg: Config) -> dict[str, float]:
    """Per suite: the reference transcripts, the original's log-probs on them and its exact rows, in seconds."""
    out = {}
    for suite in cfg.run.suites:
        walls = [w for w in (wall_of(f) for f in reference_folders(cfg.model_dir, cfg.run.name, suite))
                 if w is not None]
        if walls:
            out[suite] = sum(walls)
    return out


def other_sweeps(run: Path) -> dict[str, dict]:
    """The run's load sweeps beside ``make compare``'s short one (``make load``'s full sweep, which the report then
    shows in its place), per sweep profile: seconds, and what they cover: ``trials`` (every trial's own time, over
    every sitting of a resumed sweep) or ``last sitting`` (the stage's wall time, from a sweep that kept no trial
    times)."""
    out = {}
    for stage, m in completed_sweeps(run):
        if stage.name == sweep_stage("short"):
            continue
        sweep = read_json(stage / "load.json")
        trials = sweep.get("trials_wall_s")
        out[sweep.get("profile") or stage.name] = ({"s": float(trials), "covers": "trials"} if trials else
                                                   {"s": m.get("wall_s"), "covers": "last sitting"})
    return out


def run_stages(cfg: Config, names: list[str]) -> dict:
    """The run's stages in seconds: the references per suite, per variant its free-running, scoring and
    deployment-path stages, the run-level speed and (short) load stages, and their total (quantizing is left out:
    it is once per model, not per run); beside them, not in the total, the run's other load sweeps; and every
    stage's peak host memory (``stage_peaks``, the model-level stages included)."""
    run = cfg.model_dir / "runs" / cfg.run.name
    variants = {}
    for name in names:
        row = {k: w for k, w in evaluation_stages(cfg, name).items() if w is not None}
        if row:
            variants[name] = row
    shared = {k: w for k, f in run_folders(cfg.model_dir, cfg.run.name).items() if (w := wall_of(f)) is not None}
    references = reference_stages(cfg)
    total = sum(references.values()) + sum(sum(r.values()) for r in variants.values()) + sum(shared.values())
    return {"references_s": references, "variants_s": variants, "run_s": shared, "total_s": total,
            "other_sweeps": other_sweeps(run), "peak_host_mb": stage_peaks(cfg, names)}
