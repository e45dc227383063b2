"""The benchmark tasks of a run in summary.json: per task, the task's identity (its key: version, data hash,
lm-eval's version, a generating task's reply cap), the metric that counts a sample right, the sample limit and the decoding; per variant, the task's metrics, its accuracy with a 95 %
bootstrap interval and, against the original's answers to the same samples, recovery (accuracy ÷ the original's)
with its paired interval, the flips each way, the exact McNemar p-value and its family-wise adjusted value over the
task's variants (``pipeline.suites.lmeval.flips``). Read from the bench stages' rows (``pipeline.stages.lmeval_tasks``).

A task whose documents carry a ``category`` (business_mc) also has, per variant, ``by_category``: each category's
samples, right answers, accuracy and flips against the original; the category is joined by sample id from the
task's data file, and only onto a stage that ran on that very file (its sha256 in the stage's task key)."""

from __future__ import annotations

import functools
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.infra.files import read_json, read_jsonl
from pipeline.figures.stats import NO_SIGNAL_PASS_RATE
from pipeline.suites.lmeval import flips
from pipeline.suites.lmeval.tasks import get_task, load_docs

REFERENCE = "original"


def _stage(result: dict, task: str) -> dict | None:
    return ((result or {}).get("benchmarks") or {}).get(task)


def _spec(task: str) -> dict:
    """The task's key and right/wrong metric where no stage recorded them (a run whose stages predate the record,
    or where no variant ran the task): resolved now; a registry task that cannot be resolved here is named with
    why, never fails the summary."""
    try:
        spec = get_task(task)
    except ConfigError as exc:
        return {"key": {"task": task}, "metric": "unknown", "note": f"bench:{task} not resolved here: {exc}"}
    return {"key": spec.key(), "metric": spec.correct}


def sample_categories(task: str) -> tuple[str, dict[str, str]] | None:
    """(the data file's sha256, sample id -> category in the file's order) for a task whose every document names
    its category; None otherwise (or where the task's data cannot be read here)."""
    try:
        spec = get_task(task)
        docs = load_docs(task)
        sha = spec.data_sha256
    except (ConfigError, OSError):
        return None
    if not docs or not all(d.get("category") for d in docs):
        return None
    return sha, {str(d[spec.sample_id]): str(d["category"]) for d in docs}


def attach_categories(task: str, rows: dict[str, dict], answers: dict[str, dict[str, bool]],
                      reference: str | None) -> None:
    """Each ok row's ``by_category`` (``flips.by_category``) where its stage ran on the task's current data file;
    the flips against ``reference`` (whose answers the caller has paired with every row's) where it did too."""
    known = sample_categories(task)
    if known is None:
        return
    sha, categories = known
    same = {n for n in answers if (rows[n].get("task_key") or {}).get("data_sha256") == sha}
    ref = answers[reference] if reference in same else None
    for name in same:
        rows[name]["by_category"] = flips.by_category(categories, answers[name], None if name == reference else ref)


def task_summary(task: str, results: dict[str, dict], seed: int = 0, method: str = "holm") -> tuple[dict, dict]:
    """(the task's entry of ``summary["benchmarks"]``, {variant: its row}) for one task over the run's results
    (variant name -> result file). A variant without a result, or whose bench stage was skipped, has a row with
    ``status`` and ``reason``; without the original's answers, rows carry accuracy alone."""
    rows: dict[str, dict] = {}
    answers: dict[str, dict[str, bool]] = {}
    facts: dict = {}
    resolved = functools.cache(functools.partial(_spec, task))     # resolved once, only where a stage lacks it
    for name, r in results.items():
        stage = _stage(r, task) if r.get("status") == "ok" else None
        if stage is None:
            rows[name] = {"status": "skipped", "reason": r.get("reason") if r.get("status") != "ok"
                          else f"bench:{task} was not run for this variant (not in its run.suites)"}
            continue
        if stage.get("status") != "ok":
            rows[name] = {"status": "skipped", "reason": stage.get("reason")}
            continue
        folder = Path(stage["dir"])
        metrics = read_json(folder / "metrics.json")
        answers[name] = flips.outcomes(read_jsonl(folder / "samples.jsonl"))
        facts = facts or metrics
        rows[name] = {"status": "ok", "metric": metrics.get("metric") or resolved()["metric"],
                      "metrics": metrics["metrics"],
                      "samples": len(answers[name]), "accuracy": flips.accuracy(answers[name], seed),
                      "recovery": None, "correct_to_wrong": None, "wrong_to_correct": None, "flip_rate": None,
                      "mcnemar_p": None, "mcnemar_p_adjusted": None, "no_signal_for_flips": None,
                      "limit": metrics["limit"], "task_key": metrics["task"], "decoding": metrics["decoding"],
                      "sandbox": metrics.get("sandbox"), "wall_s": stage.get("wall_s")}
    spec = resolved() if not facts or not facts.get("metric") else {}
    entry = {"task": facts["task"] if facts else spec["key"], "metric": facts.get("metric") or spec["metric"],
             "limit": facts.get("limit"), "decoding": facts.get("decoding"), "reference": None,
             "reference_accuracy": None, "no_signal_for_flips": None, "multiple_comparisons": method,
             "note": spec.get("note")}
    if REFERENCE not in answers:
        entry["note"] = entry["note"] or (f"no answers of {REFERENCE!r} to bench:{task} in this run: accuracy "
                                          "only, no recovery or flips")
        attach_categories(task, rows, answers, None)
        return entry, rows
    others = {n: a for n, a in answers.items() if n != REFERENCE}
    try:
        compared = flips.compare_variants(answers[REFERENCE], others, seed, method)
    except ValueError as exc:        # the variants answered other samples (another limit or data file)
        entry["note"] = f"no flips: {exc}"
        attach_categories(task, rows, answers, None)
        return entry, rows
    attach_categories(task, rows, answers, REFERENCE)
    entry.update(reference=REFERENCE, reference_accuracy=rows[REFERENCE]["accuracy"],
                 no_signal_for_flips=bool(rows[REFERENCE]["accuracy"]["estimate"] < NO_SIGNAL_PASS_RATE))
    # the original against itself: recovery 1 [1, 1], no flips; never in the family of tests (it is the reference)
    compared[REFERENCE] = {**flips.compare(answers[REFERENCE], answers[REFERENCE], seed), "mcnemar_p_adjusted": None}
    for name, c in compared.items():
        rows[name].update({k: c[k] for k in ("recovery", "correct_to_wrong", "wrong_to_correct", "flip_rate",
                                             "mcnemar_p", "mcnemar_p_adjusted", "no_signal_for_flips")})
    return entry, rows


def attach_benchmarks(variants: dict[str, dict], results: dict[str, dict], tasks: list[str], seed: int = 0,
                      method: str = "holm") -> dict:
    """Each ok variant's ``benchmarks`` (task -> its row; the decision's ``min_recovery`` reads them) and the
    summary's ``benchmarks`` (task -> the task's entry, with the variants in run order)."""
    out = {}
    for task in tasks:
        entry, rows = task_summary(task, results, seed, method)
        out[task] = {**entry, "variants": list(rows)}
        for name, row in rows.items():
            if variants.get(name, {}).get("status") == "ok":
                variants[name].setdefault("benchmarks", {})[task] = row
    return out
