"""Before any stage spends time: what would stop every variant of the run, found once, with its way out.

`make compare` runs this first (``quantdrift command=preflight``). It prepares the original (the first stage of every
variant, cached) and checks what every variant job would otherwise fail on one after another:

- a tokenizer without a chat template (a base model), or a template that cannot render a plain conversation;
- a chat template that rewrites earlier turns, when a selected suite has multi-turn conversations;
- for GGUF variants, a tokenizer llama.cpp's converter does not recognise (its vocabulary is converted alone, a few
  seconds, into a scratch folder).

Each found problem is printed once with the setting that gets past it; the command exits 2 (bad input) before any
stage of the comparison has run.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
from pathlib import Path

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


def converter_problem(cfg: Config, checkpoint: Path) -> str | None:
    """llama.cpp's converter on the checkpoint's vocabulary alone: None when it converts, else its cause in words
    (with ``model.gguf_pre_tokenizer`` when that gets past it)."""
    from pipeline.infra.child_processes import child_options
    from pipeline.quantizers.gguf import converter_command, converter_dir
    from pipeline.quantizers.gguf_convert import conversion_failure

    src = converter_dir(cfg)
    if not (src / "convert_hf_to_gguf.py").is_file():
        return None             # the GGUF variants report the missing converter themselves (`make converter`)
    with tempfile.TemporaryDirectory(prefix="quantdrift-preflight-") as tmp:
        cmd, env = converter_command(src, cfg.model.gguf_pre_tokenizer, checkpoint, Path(tmp) / "vocab.gguf",
                                     "--vocab-only")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **child_options())
    if proc.returncode == 0:
        return None
    return "GGUF variants: " + conversion_failure(proc.stderr + proc.stdout, proc.returncode)


def _is_gguf(name: str) -> bool:
    from pipeline.config.compose import load_variant

    return load_variant(name).quantizer == "gguf"


def preflight_problems(cfg: Config) -> list[str]:
    """Every problem that would stop all variants (or all GGUF variants) of this run, each once."""
    from pipeline.stages.prepare import prepare
    from pipeline.stages.variant_job import load_suites
    from pipeline.suites.conversation import ChatRenderer

    original = prepare(cfg.model, cfg.model_dir)
    problems = []
    try:
        renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    except ConfigError as exc:
        problems.append(str(exc))
        renderer = None
    if renderer is not None:
        suites = load_suites(cfg, original, renderer)
        problem = history_problem(renderer, suites)
        if problem:
            problems.append(problem)
    if any(_is_gguf(name) for name in cfg.run.variants):
        problem = converter_problem(cfg, original.checkpoint)
        if problem:
            problems.append(problem)
    return problems


def run_preflight(cfg: Config) -> int:
    problems = preflight_problems(cfg)
    if problems:
        raise ConfigError("this run would fail for every variant it names, so nothing was measured:\n"
                          + "\n".join(f"- {p}" for p in problems))
    named = ", ".join(cfg.run.variants) or "none named (run.variants)"
    print(f"preflight: {cfg.model.name} renders its conversations"
          + (" and converts to GGUF" if any(_is_gguf(n) for n in cfg.run.variants) else "")
          + f"; variants: {named}")
    return 0
