# The family matrix: a small random model of each family users bring (Llama 3, Mistral, Qwen 2.5/3, Phi-3, Gemma 2/3,
# Qwen2-MoE, DeepSeek V2), with its real tokenizer and published chat template, through `make compare PROFILE=smoke`;
# the table goes to docs/families.md. Folders and results live under artifacts/families/ (never committed).
#   make families                                   every family, every default variant
#   make families FAMILIES="llama3 qwen3" FAMILY_VARIANTS=original,gguf_f16,gguf_q4_k_m,gptq_w4,gguf_q8_0+kv_q8_0
#   make families-table                             the table again from the runs already made
FAMILIES ?= llama3 mistral qwen2 qwen3 phi3 gemma2 gemma3 qwen2moe deepseek2
FAMILY_VARIANTS ?= $(VARIANTS)
FAMILY_MAKE_ARGS ?= VENV=$(VENV)

.PHONY: families families-vocab families-build families-table

# the vocab files and their reference tokenizations come with `make chat-templates`
families-vocab: chat-templates

families-build: setup families-vocab
	$(PY) -m dev.families_matrix build $(FAMILIES)

# one family after another (each run measures speed: never two at once); a family's failure is in its row
families: compare-deps families-vocab
	@for f in $(FAMILIES); do \
	  $(PY) -m dev.families_matrix run $$f --variants '$(FAMILY_VARIANTS)' \
	    --make-args '$(FAMILY_MAKE_ARGS)' || exit $$?; \
	done
	$(PY) -m dev.families_matrix table --out docs/families.md

families-table:
	$(PY) -m dev.families_matrix table --out docs/families.md
