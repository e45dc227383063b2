# `make plan [MODEL=...] [VARIANTS=...] [PROFILE=...]`: what the comparison will cost before any work: disk, peak host
# and device memory and time per stage and variant, against this machine's free disk and memory (exit 2 when it does
# not fit). `make plan-compare`: a finished run's plan beside what it measured (RUN= its name, default the profile).
.PHONY: plan plan-compare
# the comparison's own settings (load sweep, budget, tools), as `make compare` passes them
plan: setup
	$(VENV)/bin/quantdrift plan run.variants=[$(VARIANTS)] bench.llama_tools=$(LLAMA_TOOLS)/bin \
	  load=$(COMPARE_LOAD) run.budget=$(BUDGET) $(COMMON) $(LOAD_ARGS)

plan-compare: setup
	$(VENV)/bin/quantdrift plan plan.compare=true run.name=$(or $(RUN),$(PROFILE)) $(COMMON)
