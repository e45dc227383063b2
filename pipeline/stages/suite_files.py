"""The run's conversation suites as files: the selected suites validated and cut to the profile, and the ones
generated per model tokenizer (suites.NAME.generate) built once into artifacts/<model>/suites/."""

from __future__ import annotations

from pathlib import Path

from pipeline.config.schema import Config
from pipeline.infra.errors import ConfigError


def load_suites(cfg: Config, original=None, renderer=None) -> dict:
    """The selected suites, validated and cut to the profile. Generated suites (suites.NAME.generate) are built
    once per model tokenizer into artifacts/<model>/suites/ and then read like any other suite file."""
    from pipeline.suites.records import load_suite, select

    out = {}
    for suite in cfg.selected_suites():
        path = suite.path
        if suite.generate:
            if original is None or renderer is None:
                raise ConfigError(f"suite {suite.name!r} is generated per tokenizer: it needs the prepared model")
            path = generated_suite(cfg, suite, original, renderer)
        convs = load_suite(suite.name, path)
        out[suite.name] = select(convs, *cfg.profile.limits(suite.name))
    return out


def generated_suite(cfg: Config, suite, original, renderer) -> Path:
    """Write a generated suite (cached by its settings and the tokenizer it was sized with)."""
    from pipeline.infra.stage_cache import run_stage

    out_dir = cfg.model_dir / "suites" / suite.name
    params = {k: v for k, v in suite.generate.items() if k != "kind"}
    key = {"generate": suite.generate, "original": original.hash, "context": original.facts.get("context_length")}

    def build(tmp: Path) -> dict:
        from pipeline.suites.recall_docs import generate

        records = generate(tmp / "suite.jsonl", renderer.encode, max_context=original.facts.get("context_length"),
                           **params)
        if not records:
            raise ConfigError(f"suite {suite.name!r}: no document length in {params.get('lengths')} fits the model's "
                              f"context of {original.facts.get('context_length')} tokens")
        return {"records": len(records)}

    run_stage(f"suite:{suite.name}", out_dir, key, build, force=cfg.force)
    return out_dir / "suite.jsonl"
