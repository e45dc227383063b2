"""Serving engines: a runtime that lives in another process and serves an OpenAI-compatible endpoint with
continuous batching. One module per engine owns its command line, settings translation and request dialect; the
start, health check and stop they share (pipeline.engines.server) run as a context manager, so that no exit path
leaves a server running. Load generation (pipeline.load, guidellm) talks to
the endpoint and knows nothing of the backend.

``ENGINES`` maps a runtime (variant.runtime) to the engine that serves its artifacts: llama.cpp's llama-server for
GGUF files, ``transformers serve`` for HF-format checkpoints. An engine that cannot serve one variant (an integer
KV cache, a format it cannot load) says why in its ``check`` or ``plan``; the variant is reported skipped with that
reason, never dropped."""

from __future__ import annotations

from pipeline.errors import Skip

# variant.runtime -> engine module:class serving its artifacts (pipeline.engines.server.ServedEngine subclasses)
ENGINES = {"llamacpp": "pipeline.engines.llama_server:LlamaServer",
           "hf": "pipeline.engines.transformers_serve:TransformersServe"}

def engine_class(runtime: str):
    """The engine class serving ``runtime``'s artifacts; Skip, naming the format and the reason, where none does."""
    import importlib

    if runtime not in ENGINES:
        raise Skip(f"no serving engine for {runtime!r} artifacts: no engine is registered for it")
    module, cls = ENGINES[runtime].split(":")
    return getattr(importlib.import_module(module), cls)


def describe(engine_name: str, settings: dict) -> str:
    """An engine's set-up in a few words, by the engine's name as a load.json records it (sweeps written before
    load.json carried it)."""
    import importlib

    for target in ENGINES.values():
        module, cls = target.split(":")
        engine = getattr(importlib.import_module(module), cls)
        if engine.name == engine_name:
            return engine.describe(settings)
    return ", ".join(f"{k} {v}" for k, v in settings.items())
