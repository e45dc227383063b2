"""Serving engines: a runtime that lives in another process and serves an OpenAI-compatible endpoint with
continuous batching. One module per engine owns its command line, settings translation and request dialect; the
start, health check and stop they share (pipeline.servers.base) run as a context manager, so that no exit path
leaves a server running. Load generation (pipeline.stages.load, guidellm) talks to
the endpoint and knows nothing of the backend.

``pipeline.infra.backends.SERVERS`` maps a runtime (variant.runtime) to the engine that serves its artifacts:
llama.cpp's llama-server for GGUF files, ``transformers serve`` for HF-format checkpoints. An engine that cannot serve
one variant (an integer KV cache, a format it cannot load) says why in its ``check`` or ``plan``; the variant is
reported skipped with that reason, never dropped."""

from __future__ import annotations

from pipeline.infra.errors import Skip

from pipeline.infra.backends import SERVERS

def engine_class(runtime: str):
    """The engine class serving ``runtime``'s artifacts; Skip, naming the format and the reason, where none does."""
    import importlib

    if runtime not in SERVERS:
        raise Skip(f"no serving engine for {runtime!r} artifacts: no engine is registered for it")
    module, cls = SERVERS[runtime].target.split(":")
    return getattr(importlib.import_module(module), cls)


def describe(engine_name: str, settings: dict) -> str:
    """An engine's set-up in a few words, by the engine's name as a load.json records it (sweeps written before
    load.json carried it)."""
    import importlib

    for backend in SERVERS.values():
        module, cls = backend.target.split(":")
        engine = getattr(importlib.import_module(module), cls)
        if engine.name == engine_name:
            return engine.describe(settings)
    return ", ".join(f"{k} {v}" for k, v in settings.items())
