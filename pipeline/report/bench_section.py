"""The report's benchmark section: per ``bench:TASK`` of the run, one table of the variants (the task's metric,
accuracy and recovery with their 95 % intervals, the flips each way, the exact McNemar p and its family-wise
adjusted value), the task's identity, limit, decoding and reply cap (a generating task), how HumanEval's
model-written code was confined, and for a task whose rows carry ``by_category`` (business_mc) a table of each
category's accuracy and flips per variant.
Read from ``summary["benchmarks"]`` and each variant's ``benchmarks`` rows (``pipeline.decide.bench_summary``)."""

from __future__ import annotations

from pipeline.figures.stats import NO_SIGNAL_PASS_RATE
from pipeline.report.cells import _ci, _fmt


def _decoding(d: dict | None) -> str:
    if not d:
        return "–"
    if d.get("repeat_penalty", 1.0) == 1.0:
        return "greedy (argmax, no repetition penalty), one sample per item"
    return f"greedy with repetition penalty {d['repeat_penalty']:g}"


def _sandbox_line(name: str, sb: dict) -> str:
    return (f"`{name}`: HumanEval completions checked in a child process, {sb.get('confinement')}"
            + (f" (network interfaces seen: {', '.join(sb['network_interfaces']) or 'none'})"
               if sb.get("network_interfaces") is not None else "")
            + f", memory limit {sb.get('memory_mb')} MB, time limit {sb.get('timeout_s')} s per problem"
            + ("" if sb.get("sandboxed") else "; NOT confined (bench.allow_unconfined=true)") + ".")


def _category_cell(c: dict | None, samples: int | None) -> str:
    if c is None:
        return "–"
    cell = f"{c['accuracy']:.0%}" if c["samples"] == samples else f"{c['correct']}/{c['samples']}"
    if c.get("correct_to_wrong") is not None:
        cell += f" ({c['correct_to_wrong']} / {c['wrong_to_correct']})"
    return cell


def category_blocks(task: str, entry: dict, variants: dict) -> list:
    """A row per category (in the data file's order), a column per variant with its ``by_category``; nothing when
    no row has one (a task without categories, a summary written before them)."""
    per = {n: row["by_category"] for n in entry.get("variants") or []
           if (row := (variants.get(n, {}).get("benchmarks") or {}).get(task) or {}).get("by_category")}
    if not per:
        return []
    ref = entry.get("reference")
    head = ["category", "samples", *(n + (" (reference)" if n == ref else "") for n in per)]
    rows = []
    for cat in dict.fromkeys(c for cats in per.values() for c in cats):
        samples = (per.get(ref, {}).get(cat) or next(p[cat] for p in per.values() if cat in p))["samples"]
        rows.append([cat, str(samples), *(_category_cell(p.get(cat), samples) for p in per.values())])
    return [f"Per category: the share answered right by `{entry.get('metric')}`, and in brackets the flips against "
            "the original (correct→wrong / wrong→correct). A category holds few samples (at 32, a share's 95 % "
            "interval spans about ±17 points): it shows where answers were lost, not a test of its own.",
            (head, rows)]


def task_blocks(task: str, entry: dict, variants: dict) -> list:
    key = entry.get("task") or {}
    method = entry.get("multiple_comparisons") or "holm"
    metric = entry.get("metric")
    head = ["variant", f"{metric} accuracy [CI]", "recovery [CI]", "correct→wrong", "wrong→correct", "McNemar p",
            f"{method}-adjusted p", "samples", "seconds"]
    rows, notes = [], []
    for name in entry.get("variants") or []:
        row = (variants.get(name, {}).get("benchmarks") or {}).get(task)
        if row is None:
            continue
        if row.get("status") != "ok":
            rows.append([name, "–", "–", "–", "–", "–", "–", "–", "–"])
            notes.append(f"`{name}`: bench:{task} not run: {row.get('reason')}")
            continue
        is_ref = name == entry.get("reference")
        rows.append([name + (" (reference)" if is_ref else ""), _ci(row.get("accuracy"), ".1%"),
                     _ci(row.get("recovery"), ".0%"), _fmt(row.get("correct_to_wrong"), "d"),
                     _fmt(row.get("wrong_to_correct"), "d"), "–" if is_ref else _fmt(row.get("mcnemar_p"), ".3f"),
                     _fmt(row.get("mcnemar_p_adjusted"), ".3f"), str(row["samples"]),
                     _fmt(row.get("wall_s"), ".0f")])
        if row.get("sandbox"):
            notes.append(_sandbox_line(name, row["sandbox"]))
    limit = entry.get("limit")
    source = (f" from lm-eval's registry (dataset {key['dataset']}; a sample is its doc_id)"
              if key.get("source") == "lm-eval registry" else "")
    blocks: list = [
        f"Task `{key.get('task', task)}` version {key.get('version')}{source}, data sha256 "
        f"`{str(key.get('data_sha256', ''))[:16]}`, lm-eval {key.get('lm_eval')}; "
        + (f"the first {limit} samples (`profile.bench_limit`)" if limit else "every sample")
        + f"; decoding: {_decoding(entry.get('decoding'))}"
        + (f", replies capped at {key['max_gen_toks']} tokens" if key.get("max_gen_toks") else "")
        + f"; a sample counts as correct by `{metric}`. Each variant "
        "ran the task on its own runtime (its kernel, settings and KV cache).",
        (head, rows)]
    ref_acc = (entry.get("reference_accuracy") or {}).get("estimate")
    if entry.get("no_signal_for_flips") and ref_acc is not None:
        blocks.append(f"⚠ no signal for flips: the original answers {ref_acc:.0%} of the samples right, under "
                      f"{NO_SIGNAL_PASS_RATE:.0%}: flips are then mostly lucky answers, not damage.")
    if entry.get("note"):
        blocks.append(entry["note"] + ".")
    if notes:
        blocks.append(notes)
    return blocks + category_blocks(task, entry, variants)


def bench_section(summary: dict) -> tuple | None:
    """("benchmarks", title, blocks) for a run with bench:TASK entries, else None."""
    tasks = summary.get("benchmarks") or {}
    if not tasks:
        return None
    blocks: list = [
        "Accuracy: share of the task's samples answered right, with its 95 % bootstrap interval (samples "
        "resampled, 2,000 replicates, fixed seed). Recovery: the variant's accuracy ÷ the original's on the same "
        "samples, its interval paired (both resampled with the same draw). Flips: samples the original answered "
        "right and the variant wrong (correct→wrong) and the reverse, tested with the exact McNemar test, adjusted "
        "across the task's variants."]
    for task, entry in tasks.items():
        blocks += [f"**bench:{task}**", *task_blocks(task, entry, summary["variants"])]
    return ("benchmarks", "Benchmarks (lm-evaluation-harness, each variant's own runtime)", blocks)
