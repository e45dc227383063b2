"""A model's business_mc accuracy per category, measured by the comparison's own bench stage
(``pipeline.stages.lmeval_tasks.bench_task``: lm-eval on the variant's runtime, plain greedy, the bench context,
every question under the quick profile) and split per category as the summary splits it
(``pipeline.decide.bench_summary.sample_categories``, ``flips.by_category``); prompts/bench/README.md states the
embedded model's figures from it.

    python -m dev.business_mc_accuracy paths.artifacts=/tmp/qd-artifacts      # the embedded model's original

Hydra overrides pick another model or variant (``variant=gguf_q4_0``, ``model.source=...``). Prints a Markdown table:
per category the samples, acc and acc_norm (right answers and share), then the whole task and the stage's time. The
stage is cached under ``paths.artifacts`` like any run's."""

from __future__ import annotations

import sys


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipeline.compose import from_omegaconf, register_resolvers
    from pipeline.config.schema import PROJECT_ROOT

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return from_omegaconf(compose("config", overrides=["profile=quick", "variant=original",
                                                           "run.name=business-mc-accuracy",
                                                           "run.suites=[smoke,bench:business_mc]", *overrides]))


def measure(overrides: list[str]) -> tuple[list[dict], dict]:
    """(the stage's per-sample rows, its manifest) for business_mc on the configured variant."""
    from pathlib import Path

    from pipeline.infra.files import read_jsonl
    from pipeline.stages.lmeval_tasks import bench_task
    from pipeline.stages.prepare import prepare
    from pipeline.stages.quantize import build_artifact
    from pipeline.suites.conversation import ChatRenderer

    cfg = _config(overrides)
    original = prepare(cfg.model, cfg.model_dir)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    artifact = build_artifact(cfg.variant, original, cfg)
    manifest = bench_task(cfg, original, renderer, artifact, "business_mc")
    return read_jsonl(Path(manifest["dir"]) / "samples.jsonl"), manifest


def table(samples: list[dict]) -> str:
    from pipeline.decide.bench_summary import sample_categories
    from pipeline.suites.lmeval import flips

    _, categories = sample_categories("business_mc")
    acc = {s["id"]: s["metrics"]["acc"] >= 0.5 for s in samples}
    norm = flips.outcomes(samples)
    per_acc, per_norm = flips.by_category(categories, acc), flips.by_category(categories, norm)
    lines = ["| category | samples | acc | acc_norm |", "|---|---|---|---|"]
    for cat, c in per_norm.items():
        a = per_acc[cat]
        lines.append(f"| {cat} | {c['samples']} | {a['correct']} ({a['accuracy']:.0%}) | "
                     f"{c['correct']} ({c['accuracy']:.0%}) |")
    n = len(samples)
    lines.append(f"| all | {n} | {sum(acc.values())} ({sum(acc.values()) / n:.1%}) | "
                 f"{sum(norm.values())} ({sum(norm.values()) / n:.1%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    samples, manifest = measure(list(sys.argv[1:] if argv is None else argv))
    print(table(samples))
    print(f"\nstage {manifest['dir']}: {len(samples)} samples, {manifest.get('wall_s') or 0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
