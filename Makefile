# specrt: make demo | test | models | export | inflate | bench
# Everything runs in a local virtualenv (.venv) created on first use.

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# torch is pinned to a CPU-capable build; override with TORCH=torch for your platform's default.
TORCH     ?= torch==2.13.0
DEMO      := specrt/models/demo
TARGET    ?= $(DEMO)/target
DRAFT     ?= $(DEMO)/draft
TOKENIZER ?= $(if $(filter $(DEMO)/%,$(TARGET)),$(DEMO)/tokenizer,)
OUT       ?= build/demo
THREADS   ?= 2
PROMPTS   ?= 30
LABEL     ?= tiny

STAMP := $(VENV)/.installed

.PHONY: demo test models export inflate calibrate profile tune bench bench-tiny bench-inflated bench-trees bench-ngram bench-mtad clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specrt demo --bundle $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not trt"

models: $(STAMP)
	$(BIN)/specrt models train --out build/models

export: $(STAMP)
	$(BIN)/specrt export --target $(TARGET) --draft $(DRAFT) $(if $(TOKENIZER),--tokenizer $(TOKENIZER),) --out $(OUT)

# The demo target inflated to ~150M parameters (same function), paired with the demo draft.
inflate: $(STAMP)
	$(BIN)/specrt models inflate --src $(DEMO)/target --out build/inflated/target
	$(BIN)/specrt export --target build/inflated/target --draft $(DEMO)/draft --tokenizer $(DEMO)/tokenizer --out build/inflated/bundle

# Hardware-aware tree selection for a bundle (OUT=...): acceptance, latency, plan.
calibrate: $(STAMP)
	$(BIN)/specrt calibrate --bundle $(OUT)

profile: $(STAMP)
	$(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS)

tune: $(STAMP)
	$(BIN)/specrt tune --bundle $(OUT)

bench: bench-tiny bench-inflated

bench-tiny: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	test -f $(OUT)/acceptance.json || $(BIN)/specrt calibrate --bundle $(OUT)  # dynamic trees' draft temperature
	test -f $(OUT)/latency.json || $(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS)  # anpd-hw's L(n)
	$(BIN)/specrt bench e2e --bundle $(OUT) --label tiny --num-prompts $(PROMPTS) --threads $(THREADS)

bench-inflated: $(STAMP)
	test -f build/inflated/bundle/manifest.json || $(MAKE) inflate
	test -f build/inflated/bundle/acceptance.json || $(BIN)/specrt calibrate --bundle build/inflated/bundle
	test -f build/inflated/bundle/latency.json || $(BIN)/specrt profile --bundle build/inflated/bundle --threads $(THREADS)
	$(BIN)/specrt bench e2e --bundle build/inflated/bundle --label inflated --num-prompts 5 --threads $(THREADS) \
		--num-draft-tokens 4,6

# Tree sizes measured against the tuner's prediction (calibrates, profiles and tunes first).
bench-trees: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt calibrate --bundle $(OUT)
	$(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS)
	$(BIN)/specrt tune --bundle $(OUT)
	$(BIN)/specrt bench trees --bundle $(OUT) --label $(LABEL) --threads $(THREADS)

# ANPD's N x K ablation and MTAD's speed / perplexity with tau and beam ablations, on OUT.
bench-ngram: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt bench ngram --bundle $(OUT) --label $(LABEL) --threads $(THREADS)

bench-mtad: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt bench mtad --bundle $(OUT) --label $(LABEL) --threads $(THREADS)

clean:
	rm -rf build
