"""Runtimes load an artifact and (1) generate a reply with timings, (2) score a token sequence; the interface is
documented in ``pipeline.runtimes.base`` and the registry lines are in ``pipeline.backends``. Modules are imported
only when a runtime is loaded, so heavy libraries (torch, llama_cpp) stay out of `import pipeline` and --help."""

from __future__ import annotations

from pipeline.backends import RUNTIMES

__all__ = ["RUNTIMES", "runtime_class", "load_runtime"]


def runtime_class(name: str):
    from pipeline.registry import load_class

    return load_class(RUNTIMES, name, "runtime")


def load_runtime(variant, artifact_path, cfg, **options):
    """``variant``'s runtime loaded on ``artifact_path`` with its options (plus call-site ones such as n_ctx)."""
    opts = {**variant.runtime_options, **options}
    return runtime_class(variant.runtime)(artifact_path, opts, cfg.runtime, cfg.model.trust_remote_code)
