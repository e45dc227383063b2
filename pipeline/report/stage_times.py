"""How long each stage of a run took, read from the stages' own manifests (``wall_s``: the time a stage took when
it was built; a stage this run reused from an earlier one counts that build, so the figures add up to what the
run's results cost, not to this invocation's wall time)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.schema import Config
from pipeline.stages.load import completed_sweeps, sweep_stage
from pipeline.infra.stage_cache import load_manifest
from pipeline.infra.files import read_json


def _wall(folder: Path) -> float | None:
    m = load_manifest(folder)
    return float(m["wall_s"]) if m and m.get("wall_s") is not None else None


def _peak(folder: Path) -> float | None:
    m = load_manifest(folder)
    return ((m or {}).get("host_memory") or {}).get("peak_host_mb")


def _evaluation_folders(cfg: Config, name: str) -> dict[str, Path]:
    """One variant's stage folders of this run: free-running, scoring, checks, the deployment path and each
    benchmark task (``bench:TASK``)."""
    from pipeline.stages.bench import bench_dir

    run = cfg.model_dir / "runs" / cfg.run.name
    return {"free_running": run / name, "scoring": run / f"{name}.scores", "checks": run / f"{name}.checks",
            "deployment": run / f"{name}.served",
            **{f"bench:{task}": bench_dir(cfg, name, task) for task in cfg.run.bench_tasks}}


def _model_folders(cfg: Config, name: str) -> dict[str, Path]:
    """The model-level stage folders one variant rests on (shared by every run)."""
    md = cfg.model_dir
    return {"prepare": md / "original", "convert_f16": md / "gguf-f16",
            "quantize": md / "variants" / name.split("+", 1)[0], "parity": md / "parity"}


def _reference_folders(cfg: Config, suite: str) -> list[Path]:
    """A suite's reference stages: the transcripts, the original's log-probs on them and its exact rows."""
    base = cfg.model_dir / "reference" / cfg.run.name
    return [base / part for part in (suite, f"{suite}-logprobs", f"{suite}-exact_rows")]


def stage_peaks(cfg: Config, names: list[str]) -> dict[str, dict[str, float]]:
    """Each stage's peak host memory in MB (this process and its children, ``host_memory`` in the stage's
    manifest), keyed as the planner keys its stages: stage -> key (a suite, a variant, a base artifact, "-" for a
    model-level stage, "*" for a run-level one). Stages built before manifests carried it are left out."""
    md, run = cfg.model_dir, cfg.model_dir / "runs" / cfg.run.name
    folders: dict[tuple[str, str], list[Path]] = {("speed", "*"): [run / "speed"], ("load", "*"): [run / "load"]}
    for suite in cfg.run.suites:
        folders[("reference", suite)] = _reference_folders(cfg, suite)
    for name in names:
        model, evaluation = _model_folders(cfg, name), _evaluation_folders(cfg, name)
        for stage in ("prepare", "convert_f16", "parity"):
            folders[(stage, "-")] = [model[stage]]
        base = name.split("+", 1)[0]
        folders[("quantize", base)] = [model["quantize"]]
        folders[("standin", base)] = [md / "variants" / f"{base}{s}" for s in (".dequantized", ".dequantized-f16")]
        folders[("evaluate", name)] = [evaluation["free_running"]]
        folders[("score", name)] = [evaluation[k] for k in ("scoring", "checks", "deployment")]
        for key in (k for k in evaluation if k.startswith("bench:")):
            folders[(key, name)] = [evaluation[key]]
    for folder in sorted(run.glob("original@*")):
        folders[("baseline", folder.name.split("@", 1)[1])] = [folder]
    out: dict[str, dict[str, float]] = {}
    for (stage, key), paths in folders.items():
        peaks = [p for p in (_peak(f) for f in paths) if p is not None]
        if peaks:
            out.setdefault(stage, {})[key] = max(peaks)
    return out


def evaluation_stages(cfg: Config, name: str) -> dict[str, float | None]:
    """One variant's stages of this run, in seconds (None: the stage has no manifest, e.g. never ran for it)."""
    return {k: _wall(f) for k, f in _evaluation_folders(cfg, name).items()}


def variant_stages(cfg: Config, name: str) -> dict[str, float | None]:
    """Every stage one variant's result rests on: the model-level ones (shared by every run) and this run's."""
    return {**{k: _wall(f) for k, f in _model_folders(cfg, name).items()}, **evaluation_stages(cfg, name)}


def reference_stages(cfg: Config) -> dict[str, float]:
    """Per suite: the reference transcripts, the original's log-probs on them and its exact rows, in seconds."""
    out = {}
    for suite in cfg.run.suites:
        walls = [w for w in (_wall(f) for f in _reference_folders(cfg, suite)) if w is not None]
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
    shared = {k: w for k, w in (("speed", _wall(run / "speed")), ("load", _wall(run / "load"))) if w is not None}
    references = reference_stages(cfg)
    total = sum(references.values()) + sum(sum(r.values()) for r in variants.values()) + sum(shared.values())
    return {"references_s": references, "variants_s": variants, "run_s": shared, "total_s": total,
            "other_sweeps": other_sweeps(run), "peak_host_mb": stage_peaks(cfg, names)}
