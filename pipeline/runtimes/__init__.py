"""Runtimes load an artifact and (1) generate a reply with timings, (2) score a token sequence; the interface is
documented in ``pipeline.runtimes.base`` and the registry lines are in ``pipeline.infra.backends``. Modules are
imported only when a runtime is loaded, so heavy libraries (torch, llama_cpp) stay out of `import pipeline` and
--help."""

from __future__ import annotations

from pipeline.infra.backends import RUNTIMES

__all__ = ["RUNTIMES", "runtime_class", "load_runtime", "runtime_key", "runtime_code"]


def runtime_class(name: str):
    import importlib

    from pipeline.infra.backends import lookup

    module, cls = lookup(RUNTIMES, name, "runtime")
    return getattr(importlib.import_module(module), cls)


def load_runtime(variant, artifact_path, cfg, **options):
    """``variant``'s runtime loaded on ``artifact_path`` with its options (plus call-site ones such as n_ctx). A
    runtime class with ``own_process`` (llama.cpp's) is loaded in a worker process of its own wherever this process
    has imported torch (``pipeline.runtimes.worker``): llama.cpp never shares a process with torch."""
    import sys

    opts = {**variant.runtime_options, **options}
    cls = runtime_class(variant.runtime)
    args = (artifact_path, opts, cfg.runtime, cfg.model.trust_remote_code)
    if getattr(cls, "own_process", False) and "torch" in sys.modules:
        from pipeline.runtimes.worker import WorkerRuntime

        return WorkerRuntime(cls, *args)
    return cls(*args)


def runtime_key(cfg, artifact) -> dict:
    """What any stage that runs cfg.variant on its artifact depends on (free-running, scoring, the deployment path):
    the weights, the runtime and its options, threads, device, the runtime's own settings and the decoding rule."""
    from pipeline.runtimes.base import decoding_key

    variant = cfg.variant
    return {"variant": variant.name, "artifact": artifact.hash, "runtime": variant.runtime,
            "runtime_options": variant.runtime_options, "threads": cfg.runtime.n_threads, "device": cfg.runtime.device,
            "runtime_settings": runtime_class(variant.runtime).key_settings(cfg.runtime), **decoding_key(cfg.runtime),
            "code": runtime_code(variant.runtime)}


def runtime_code(name: str) -> dict:
    """The version of runtime ``name``'s code (its class's module and the modules of the runtime classes it is built
    from, such as a scoring part of its own) and of the interface code every runtime shares (greedy choice,
    repetition penalty): what its generated tokens and scores depend on besides weights and settings."""
    from pipeline.infra.code_version import code_version

    cls = runtime_class(name)
    parts = [c.__module__ for c in cls.__mro__ if c.__module__.startswith("pipeline.runtimes.")]
    return code_version("pipeline.runtimes.base", *dict.fromkeys(parts))
