"""quantdrift: compare an LLM against its quantized variants on drift, speed and memory.

Importing this package is cheap: torch, transformers, llama_cpp and gptqmodel are imported only inside the
modules that need them (runtimes, quantizers, prepare), so `import pipeline` and `quantdrift --help` stay fast.
"""

__version__ = "0.1.0"
