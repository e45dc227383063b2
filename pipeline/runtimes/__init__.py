"""Runtimes load an artifact and (1) generate a reply with timings, (2) score a token sequence.

The table maps a runtime name to its class; modules are imported only when a runtime is loaded, so heavy
libraries (torch, llama_cpp) stay out of `import pipeline` and the CLI's --help.
"""

from __future__ import annotations

RUNTIMES = {
    "hf": "pipeline.runtimes.hf:HFRuntime",
    "llamacpp": "pipeline.runtimes.llamacpp:LlamaCppRuntime",
}


def runtime_class(name: str):
    from pipeline.registry import load_class

    return load_class(RUNTIMES, name, "runtime")
