"""Where each stage of a run keeps its manifest: the folders under ``artifacts/<model>`` keyed as the planner keys
its stages (``pipeline.plan.estimate``), read by the run's stage times and peaks (``pipeline.decide.stage_times``) and
by the planner's time model (``pipeline.plan.stage_rates``)."""

from __future__ import annotations

from pathlib import Path

from pipeline.infra.stage_cache import load_manifest


def wall_of(folder: Path) -> float | None:
    m = load_manifest(folder)
    return float(m["wall_s"]) if m and m.get("wall_s") is not None else None


def bench_folder(run_dir: Path, variant: str, task: str) -> Path:
    """The stage folder of benchmark ``task`` on ``variant`` in the run folder ``run_dir``."""
    return run_dir / f"{variant}.bench-{task}"


def evaluation_folders(model_dir: Path, run_name: str, name: str, bench_tasks=()) -> dict[str, Path]:
    """One variant's stage folders of a run: free-running, scoring, checks, the deployment path and each benchmark
    task (``bench:TASK``)."""
    run = model_dir / "runs" / run_name
    return {"free_running": run / name, "scoring": run / f"{name}.scores", "checks": run / f"{name}.checks",
            "deployment": run / f"{name}.served",
            **{f"bench:{task}": bench_folder(run, name, task) for task in bench_tasks}}


def run_folders(model_dir: Path, run_name: str) -> dict[str, Path]:
    """The run-level stage folders: the speed stage and the (short) load sweep."""
    run = model_dir / "runs" / run_name
    return {"speed": run / "speed", "load": run / "load"}


def model_folders(model_dir: Path, name: str) -> dict[str, Path]:
    """The model-level stage folders one variant rests on (shared by every run)."""
    return {"prepare": model_dir / "original", "convert_f16": model_dir / "gguf-f16",
            "quantize": model_dir / "variants" / name.split("+", 1)[0], "parity": model_dir / "parity"}


def reference_folders(model_dir: Path, run_name: str, suite: str) -> list[Path]:
    """A suite's reference stages: the transcripts, the original's log-probs on them and its exact rows."""
    base = model_dir / "reference" / run_name
    return [base / part for part in (suite, f"{suite}-logprobs", f"{suite}-exact_rows")]


def stage_folders(model_dir: Path, run_name: str, names, suites=(), bench_tasks=()) -> dict[tuple, list[Path]]:
    """Every stage folder of a run, keyed as the planner keys its stages: (stage, key) -> the folders whose times
    and peaks it sums (key: a suite, a variant, a base artifact, "-" for a model-level stage, "*" for a run-level
    one)."""
    md, run = model_dir, model_dir / "runs" / run_name
    folders: dict[tuple[str, str], list[Path]] = {(stage, "*"): [f] for stage, f in run_folders(md, run_name).items()}
    for suite in suites:
        folders[("reference", suite)] = reference_folders(md, run_name, suite)
    for name in names:
        model, evaluation = model_folders(md, name), evaluation_folders(md, run_name, name, bench_tasks)
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
    return folders


MODEL_STAGES = ("prepare", "convert_f16", "parity", "quantize", "standin")


def stage_span(m: dict | None) -> tuple[float, float] | None:
    """(start, end) of a stage in Unix seconds, from its manifest ``m`` (written when the stage ended)."""
    if not m or m.get("wall_s") is None or not m.get("created_unix"):
        return None
    return float(m["created_unix"]) - float(m["wall_s"]), float(m["created_unix"])


def _interval(folder: Path) -> tuple[float, float] | None:
    """``stage_span`` of the stage in ``folder``."""
    return stage_span(load_manifest(folder))


def own_seconds(intervals: dict) -> dict:
    """Each stage's seconds less those of the stages built inside it (the first GGUF quantization builds the F16
    conversion it reads; a stage asks for what it needs, and a missing one is built then): only the outermost of
    the stages inside are taken off, so nothing is taken off twice."""
    def inside(a, b) -> bool:       # a within b, and not b itself
        return a != b and b[0] <= a[0] and a[1] <= b[1]

    out = {}
    for key, span in intervals.items():
        inner = [s for k, s in intervals.items() if k != key and inside(s, span)]
        outer = [s for s in inner if not any(inside(s, o) for o in inner)]
        out[key] = max(0.0, span[1] - span[0] - sum(e - s for s, e in outer))
    return out


def stage_walls(model_dir: Path, run_name: str, names) -> dict[tuple, float]:
    """The seconds of the stages a run's summary leaves out or holds with others inside (prepare, the F16
    conversion, parity, each quantization, the dequantized stand-ins, the original's own free-running baseline),
    from their manifests where they are on disk: a model-level stage's own seconds (``own_seconds``)."""
    out, spans = {}, {}
    for (stage, key), paths in stage_folders(model_dir, run_name, names).items():
        if stage in MODEL_STAGES:
            for folder in paths:
                if (span := _interval(folder)) is not None:
                    spans[(stage, key, folder.name)] = span
        elif stage == "baseline":
            walls = [w for w in (wall_of(f) for f in paths) if w is not None]
            if walls:
                out[(stage, key)] = sum(walls)
    for (stage, key, _), seconds in own_seconds(spans).items():
        out[(stage, key)] = out.get((stage, key), 0.0) + seconds
    return out


def model_manifests(model_dir: Path, names) -> dict[tuple, dict]:
    """The manifests of the model-level stages a run's variants rest on (prepare, the F16 conversion, parity, each
    quantization), keyed as the planner keys those stages ((stage, "-"), or ("quantize", the base variant)), where
    on disk: read once for the CPUs, bandwidths, conversion phases and weights per type the planner takes."""
    out = {}
    for name in names:
        for stage, folder in model_folders(model_dir, name).items():
            key = (stage, "-" if stage != "quantize" else name.split("+", 1)[0])
            if key not in out and (m := load_manifest(folder)):
                out[key] = m
    return out


def model_stage_bandwidths(model_dir: Path, manifests: dict[tuple, dict]) -> dict[tuple, float]:
    """The memory bandwidth (bytes/s) this machine recorded nearest in time to each model-level stage of a run's
    model (``manifests``: ``model_manifests``), on the stage's own CPU: the reading (``runs/<run>/_bandwidth``, taken
    at a run's start) of the run that built it, within a day. The stages a run rests on may have been built on
    another day than its summary's run (its artifacts rebuilt after a clean), when the same machine read another
    bandwidth; the planner rescales each wall by its own reading."""
    from pipeline.infra.files import read_json

    readings = []
    for folder in Path(model_dir).glob("runs/*/_bandwidth"):
        m, path = load_manifest(folder), folder / "bandwidth.json"
        if m and m.get("created_unix") and path.is_file():
            bw = read_json(path).get("bytes_per_s")
            if bw:
                readings.append(((m.get("hardware") or {}).get("cpu_key"), float(m["created_unix"]), float(bw)))
    out = {}
    for key, m in manifests.items():
        if (span := stage_span(m)) is None:
            continue
        cpu = (m.get("hardware") or {}).get("cpu_key")
        near = [(abs(t - span[0]), bw) for k, t, bw in readings if k == cpu and abs(t - span[0]) < 86400]
        if near:
            out[key] = min(near)[1]
    return out


def model_stage_cpus(manifests: dict[tuple, dict]) -> dict[tuple, str]:
    """The CPU (hardware.cpu_key) each model-level stage of a run's model was built on (``manifests``:
    ``model_manifests``): the artifacts a run rests on may come from another machine than the run itself (a
    checkout's artifacts folder kept beside a committed summary)."""
    return {key: m["hardware"]["cpu_key"] for key, m in manifests.items() if (m.get("hardware") or {}).get("cpu_key")}
