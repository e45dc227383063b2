"""Every backend's registry line, and nothing else (a leaf module: pure data).

A quantizer turns the original into an artifact; a runtime loads an artifact and generates and scores; a server
serves a runtime's artifacts to concurrent requests in a process of its own. Each line names the class (imported
only when used, by ``pipeline.quantizers``, ``pipeline.runtimes`` and ``pipeline.servers``, so heavy libraries stay
out of `import pipeline` and `--help`) and the libraries whose versions every stage manifest records for it.
Adding a backend: its module, one line here, and its YAML files (see "Extending quantdrift" in the README).
"""

from __future__ import annotations

from typing import NamedTuple

from pipeline.infra.errors import ConfigError


class Backend(NamedTuple):
    target: str                       # "module:Class"
    libraries: tuple[str, ...] = ()   # distributions whose versions change its numbers


QUANTIZERS = {
    "none": Backend("pipeline.quantizers.base:Passthrough"),
    "gguf": Backend("pipeline.quantizers.gguf:GGUFQuantizer", ("gguf", "llama-cpp-python")),
    "gptqmodel": Backend("pipeline.quantizers.gptq:GPTQModelQuantizer", ("gptqmodel", "optimum")),
    # runs in its own environment (`make llmc-env`); the main one only loads its artifacts (compressed-tensors)
    "llmcompressor": Backend("pipeline.quantizers.llmc:LLMCompressorQuantizer", ("compressed-tensors",)),
}

RUNTIMES = {
    "hf": Backend("pipeline.runtimes.hf:HFRuntime", ("torch", "transformers")),
    "llamacpp": Backend("pipeline.runtimes.llamacpp:LlamaCppRuntime", ("llama-cpp-python",)),
}

# variant.runtime -> the server that serves its artifacts (pipeline.servers.base.ServedEngine subclasses)
SERVERS = {
    "llamacpp": Backend("pipeline.servers.llama_server:LlamaServer"),
    "hf": Backend("pipeline.servers.transformers_serve:TransformersServe"),
}


def libraries() -> list[str]:
    """Every backend's libraries, in registry order, once each."""
    out: list[str] = []
    for b in (*RUNTIMES.values(), *QUANTIZERS.values()):
        out += [d for d in b.libraries if d not in out]
    return out


def lookup(table: dict[str, Backend], name: str, kind: str) -> tuple[str, str]:
    """(module, class) of backend ``name``; a name the table lacks fails with the known ones."""
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}: expected one of {', '.join(sorted(table))}")
    module, cls = table[name].target.split(":")
    return module, cls
