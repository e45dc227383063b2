"""Before any stage spends time: what would stop every variant of the run, found once, with its way out.

`make compare` runs this first (``quantdrift command=preflight``); `make plan` runs the same checks on a local folder
(``checkpoint_problems``), preparing nothing. It prepares the original (the first stage of every
variant, cached) and checks what every variant job would otherwise fail on one after another:

- a tokenizer without a chat template (a base model), or a template that cannot render a plain conversation;
- a chat template that rewrites earlier turns, when a selected suite has multi-turn conversations;
- each quantizer's own check (``Quantizer.preflight``): for GGUF variants, a tokenizer llama.cpp's converter does
  not recognise (its vocabulary converted alone, a few seconds, into a scratch folder);
- each ``bench:TASK`` of run.suites: a name that is no task, a registry task that cannot be run as one, or whose
  data is not on this machine (``pipeline.stages.lmeval_tasks.bench_problems``).

Each found problem is printed once with the setting that gets past it; the command exits 2 (bad input) before any
stage of the comparison has run.
"""

from __future__ import annotations

import logging

from pipeline.config.schema import Config
from pipeline.infra.errors import ConfigError

log = logging.getLogger(__name__)

PROBE_REPLY, PROBE_FOLLOW_UP = "The total is 12.", "Thank you. And the date?"


def history_problem(renderer, suites: dict) -> str | None:
    """The chat template's answer to a second turn of the first multi-turn conversation, rendered as the
    comparison renders it: None when the history is a prefix of the next prompt."""
    from pipeline.suites.conversation import base_messages

    conv = next((c for convs in suites.values() for c in convs if len(c.turns) > 1), None)
    if conv is None:
        return None
    messages = base_messages(conv) + [{"role": "user", "content": conv.turns[0].user}]
    try:
        renderer.next_prompt(messages, [], [], PROBE_REPLY, conv.turns[1].user or PROBE_FOLLOW_UP)
    except ConfigError as exc:
        return f"{exc} (found on {conv.suite}/{conv.id})"
    return None


def checkpoint_problems(cfg: Config, checkpoint, original=None) -> list[str]:
    """Every problem of this checkpoint that would stop all variants of the run (its chat template) or all
    variants of one quantizer (that quantizer's own check), each once. Without the prepared ``original`` (`make
    plan` on a local folder), suites generated per tokenizer are left out of the history check."""
    from pipeline.compose import load_variant
    from pipeline.quantizers import quantizer_class
    from pipeline.stages.suite_files import load_suites
    from pipeline.suites.conversation import ChatRenderer

    problems = []
    try:
        renderer = ChatRenderer(checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    except ConfigError as exc:
        problems.append(str(exc))
        renderer = None
    if renderer is not None:
        if original is None:
            import dataclasses

            plain = [s.name for s in cfg.selected_suites() if not s.generate]
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, suites=plain))
        problem = history_problem(renderer, load_suites(cfg, original, renderer))
        if problem:
            problems.append(problem)
    by_quantizer: dict[str, list[str]] = {}
    for name in cfg.run.variants:
        by_quantizer.setdefault(load_variant(name).quantizer, []).append(name)
    for quantizer, names in by_quantizer.items():
        problem = quantizer_class(quantizer).preflight(cfg, checkpoint)
        if problem:
            problems.append(f"{', '.join(names)}: {problem}")
    if cfg.run.bench_tasks:
        from pipeline.stages.lmeval_tasks import bench_problems

        problems += bench_problems(cfg)
    return problems


def preflight_problems(cfg: Config) -> list[str]:
    """``checkpoint_problems`` of the prepared original (preparing it: the first stage of every variant)."""
    from pipeline.stages.prepare import prepare

    original = prepare(cfg.model, cfg.model_dir)
    return checkpoint_problems(cfg, original.checkpoint, original)


def refusal(problems: list[str]) -> str:
    return ("the pre-flight found what would stop these variants, before any stage ran (nothing was measured):\n"
            + "\n".join(f"- {p}" for p in problems))


def run_preflight(cfg: Config) -> int:
    problems = preflight_problems(cfg)
    if problems:
        raise ConfigError(refusal(problems))
    named = ", ".join(cfg.run.variants) or "none named (run.variants)"
    print(f"preflight: {cfg.model.name} renders its conversations and every quantizer's check passed; variants: "
          f"{named}")
    return 0
