"""Static-shape engines (`specrt build`, backend "static"): the profile table, padding that changes no real
row, a static KV cache, slots, and refusal of engines built elsewhere. On the CPU the static steps run
eagerly; CUDA-graph capture is tested only where a GPU exists (marker gpu)."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import EngineSet
from specrt.errors import BundleError, InvalidRequestError
from specrt.runtime.pipeline import Pipeline

TABLE = dict(token_profiles=(1, 4, 8, 16, 32), batch_buckets=(1, 2, 4), capacity=256, spans=(64, 128))


@pytest.fixture(scope="module")
def engine_bundle(demo_bundle, tmp_path_factory):
    from specrt.engines.build import BuildConfig, build

    b = tmp_path_factory.mktemp("engines") / "b"
    shutil.copytree(demo_bundle, b)
    build(BuildConfig(bundle=b, device="cpu", threads=2, slots=2, **TABLE), progress=False)
    return b


@pytest.fixture(scope="module")
def graphs(engine_bundle):
    return Pipeline.load(engine_bundle, backend="static", threads=2)


def test_the_profile_table_picks_the_smallest_fit(engine_bundle):
    e = artifacts.load(engine_bundle, EngineSet)
    assert (e.kind, e.token_profiles, e.batch_buckets, e.capacity, e.spans, e.device, e.cuda_graphs) == (
        "static", (1, 4, 8, 16, 32), (1, 2, 4), 256, (64, 128, 256), "cpu", False)
    assert [e.for_context(n) for n in (0, 64, 65, 128, 200, 256)] == [64, 64, 128, 128, 256, 256]
    assert [e.for_tokens(n) for n in (1, 2, 4, 5, 17, 32)] == [1, 4, 4, 8, 32, 32]
    assert [e.for_batch(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(InvalidRequestError, match="33 new tokens exceeds the engines' largest profile \\(32\\)"):
        e.for_tokens(33)
    with pytest.raises(InvalidRequestError, match="batch of 5 exceeds the engines' largest batch bucket \\(4\\)"):
        e.for_batch(5)
    assert all(err <= 1e-4 for err in e.parity.values())  # checked at build: static step == eager step
    assert e.projections == "all"  # the default: q, k, v and gate, up merged, as the engines load them


def test_the_engines_run_their_projections_merged(graphs):
    for backend in (graphs.target, graphs.draft):
        module = backend.module
        assert len(module.merged_projections()) == 2 * module.num_layers


def test_padded_rows_and_sequences_change_nothing(graphs, demo_bundle):
    """Steps of every (batch, tokens) between the buckets and profiles give the eager step's logits."""
    from specrt.engines.static import check_engine_step
    from specrt.graphs.parity import text_tokens
    from specrt.model.checkpoint import load_tokenizer

    shapes = [(1, 1), (1, 3), (2, 5), (3, 7), (3, 32), (4, 17)]  # padded to profiles 4, 8, 32 and bucket 4
    tokens = text_tokens(load_tokenizer(demo_bundle / "tokenizer"), graphs.target.entry.vocab_size)
    report = check_engine_step(graphs.target, np.random.default_rng(1), shapes, tokens)
    assert report.ok() and report.max_logit_err < 1e-4 and report.logit_scale > 1  # absolute, on real logits
    assert report.top1_agreement == 1.0


LOSSLESS = [dict(method="sd"), dict(method="tree"), dict(method="dynamic", num_draft_tokens=6),
            dict(method="anpd"), dict(method="dynamic", num_draft_tokens=4, ngram_tokens=5)]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lossless_methods_equal_autoregressive_on_static_steps(graphs, pipelines, humaneval, batch_size):
    prompts = humaneval[:6]  # longer than the largest profile: prefill goes in 32-token chunks
    ar = [o.token_ids for o in graphs.generate(prompts, method="autoregressive", max_new_tokens=24)]
    assert ar == [o.token_ids for o in pipelines["torch"].generate(prompts, method="autoregressive", max_new_tokens=24)]
    for kw in LOSSLESS:  # batch 3 runs at bucket 4, and sequences leave the static cache as they finish
        got = graphs.generate(prompts, max_new_tokens=24, batch_size=batch_size, **kw)
        assert [o.token_ids for o in got] == ar, kw
    assert got[0].stats.target_calls - got[0].stats.rounds >= 2  # chunked prefill took several steps


def test_compiled_layers_give_the_eager_steps_tokens_with_one_graph_per_shape(demo_bundle, tmp_path, pipelines,
                                                                             humaneval, monkeypatch):
    """`specrt build --compile default`: each decoder layer goes through torch.compile (inductor's C++ on the CPU),
    one graph per step shape serving every layer of a model (not one per layer), all compiled when the backend
    loads; checked against the eager step at build; decoding is token-identical to AR; a layer torch.compile cannot
    compile whole is one clear line."""
    import os

    import torch
    from torch._dynamo.utils import counters

    from specrt.engines.build import BuildConfig, build

    if not (shutil.which("g++") or shutil.which("c++")) and os.environ.get("SPECRT_REQUIRE_COMPILER") != "1":
        pytest.skip("no C++ compiler: torch.compile builds its CPU kernels with one (.ci/run installs g++)")
    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    table = dict(token_profiles=(1, 32), batch_buckets=(1, 2), capacity=256)
    with pytest.raises(InvalidRequestError, match="--backend trt takes no --compile"):
        BuildConfig(bundle=b, backend="trt", compile="default")
    torch._dynamo.reset()
    graphs0 = counters["stats"]["unique_graphs"]
    e = build(BuildConfig(bundle=b, device="cpu", threads=2, compile="default", **table), progress=False)
    assert e.compile == "default" and all(err <= 1e-4 for err in e.parity.values())
    assert artifacts.load(b, EngineSet).compile == "default"
    # 4 shapes (batch 1 and 2, 1 and 32 tokens) per model, the admission cache's among them; each model has >= 2 layers
    assert counters["stats"]["unique_graphs"] - graphs0 == 2 * 4
    pipe = Pipeline.load(b, backend="static", threads=2)
    assert all(backend.module.compiled for backend in (pipe.target, pipe.draft))
    prompts = humaneval[:3]
    ar = [o.token_ids for o in pipelines["torch"].generate(prompts, method="autoregressive", max_new_tokens=16)]
    for kw in (dict(method="autoregressive"), dict(method="sd"), dict(method="tree")):
        assert [o.token_ids for o in pipe.generate(prompts, max_new_tokens=16, batch_size=2, **kw)] == ar, kw
    # loading them compiled nothing more: dynamo's graphs guard on shapes, not on which module's parameters they take
    assert counters["stats"]["unique_graphs"] - graphs0 == 2 * 4
    from specrt.errors import SpecrtError
    from specrt.model.step import StepLayer

    torch._dynamo.reset()
    end = StepLayer.end
    monkeypatch.setattr(StepLayer, "end", lambda self, x, out: (torch._dynamo.graph_break(), end(self, x, out))[1])
    with pytest.raises(SpecrtError, match="torch.compile could not compile the target's decoder layers .*: rebuild the "
                                          "engines without --compile"):
        Pipeline.load(b, backend="static", threads=2)
    torch._dynamo.reset()


def test_half_precision_engines_attend_in_place_and_stay_lossless(fp16_bundle, tmp_path, humaneval):
    """A float16 step writes its new rows into the static cache past the span and attends over the cache and them
    where they lie (no copy of the cache), the query heads that share a KV head as rows of one product: the padded
    static steps give the eager step's tokens (which joins a copy), and every lossless method gives AR's."""
    from specrt.engines.build import BuildConfig, build

    b = tmp_path / "b"
    shutil.copytree(fp16_bundle, b)
    build(BuildConfig(bundle=b, device="cpu", threads=2, token_profiles=(1, 8, 32), batch_buckets=(1, 4), capacity=256,
                      spans=(64,)), progress=False)
    static = Pipeline.load(b, backend="static", threads=2)
    eager = Pipeline.load(b, backend="torch", threads=2)
    prompts = humaneval[:4]
    ar = [o.token_ids for o in static.generate(prompts, method="autoregressive", max_new_tokens=40)]
    assert ar == [o.token_ids for o in eager.generate(prompts, method="autoregressive", max_new_tokens=40)]
    for kw in LOSSLESS[:4]:
        got = static.generate(prompts, max_new_tokens=40, batch_size=3, **kw)
        assert [o.token_ids for o in got] == ar, kw


def test_a_request_joining_a_running_batch_is_prefilled_alone(graphs, humaneval, monkeypatch):
    """Continuous batching on the engines: a joining request's prompt is prefilled in the slot's admission cache,
    one sequence wide, never beside the running sequences as empty rows (a step as wide as the batch)."""
    from specrt.runtime.backends.static import StaticTorchBackend

    steps = []  # (model, batch rows, tokens, on the admission cache)
    run = StaticTorchBackend._run

    def spy(self, slot, input_ids, position_ids, attention_mask, cache):
        steps.append((self.entry.role, *input_ids.shape, cache.store is slot.admission))
        return run(self, slot, input_ids, position_ids, attention_mask, cache)

    monkeypatch.setattr(StaticTorchBackend, "_run", spy)
    prompts = humaneval[6:11]  # 2 running, 3 joining as others finish
    ar = [o.token_ids for o in graphs.generate(prompts, method="autoregressive", max_new_tokens=12)]
    for method in ("autoregressive", "sd"):
        steps.clear()
        out = graphs.generate(prompts, method=method, max_new_tokens=[4, 12, 8, 12, 6], batch_size=2)
        assert [o.token_ids for o in out] == [a[:n] for a, n in zip(ar, [4, 12, 8, 12, 6])]
        for role in ("target", "draft") if method == "sd" else ("target",):
            alone = [s for s in steps if s[0] == role and s[3]]
            assert {b for _, b, _, _ in alone} == {1}
            # each joining prompt (all but its last token) in chunks of the largest profile, and nothing else
            assert len(alone) == sum(-(-(len(graphs.encode(p)) - 1) // 32) for p in prompts[2:]), role
            wide = [s for s in steps if s[0] == role and not s[3] and s[2] > 8]  # prefill-sized steps in the batch
            assert len(wide) == -(-max(len(graphs.encode(p)) - 1 for p in prompts[:2]) // 32), role  # the first two


def test_a_step_attends_over_the_span_its_contexts_need(graphs, pipelines, humaneval, monkeypatch, engine_bundle):
    """Attention spans: a step reads the static cache's first 64, 128 or 256 slots, the smallest that holds every
    sequence's cached rows, so its cost follows the context as it grows (prefill chunks, then decoding past 128);
    ragged batches take their longest sequence's span; the tokens are AR's. Spans are checked at build (the padded
    rows test covers them too: its random contexts reach each) and refused where they make no sense."""
    from specrt.engines.config import BuildConfig
    from specrt.runtime.backends.static import _Shape

    used = []  # (role, span, longest cached context of the step)
    run = _Shape.run

    def spy(self):
        used.append((self.backend.entry.role, self.span))
        return run(self)

    monkeypatch.setattr(_Shape, "run", spy)
    prompts = [p for p in humaneval if 100 < len(graphs.encode(p)) < 120][:2]
    ar = [o.token_ids for o in pipelines["torch"].generate(prompts, method="autoregressive", max_new_tokens=40)]
    assert len(prompts) == 2
    for kw in (dict(method="autoregressive"), dict(method="sd"), dict(method="tree")):
        used.clear()
        assert [o.token_ids for o in graphs.generate(prompts, max_new_tokens=40, batch_size=2, **kw)] == ar, kw
        spans = [s for role, s in used if role == "target"]
        assert spans[0] == spans[1] == 64 and spans[-1] == 256 and set(spans) == {64, 128, 256}, kw  # as it grows
    # by default powers of two from 512 below the capacity; '' none; TensorRT's profiles span the cache anyway
    assert BuildConfig(capacity=2048).attention_spans() == (512, 1024, 2048)
    assert BuildConfig(capacity=4096, spans=(256,)).attention_spans() == (256, 4096)
    assert BuildConfig(capacity=2048, spans=()).attention_spans() == (2048,)
    assert BuildConfig(capacity=512).attention_spans() == (512,)
    assert BuildConfig(capacity=2048, backend="trt").attention_spans() == (2048,)
    for bad, why in ((dict(spans=(128, 64)), "ascending"), (dict(spans=(256,)), "below the capacity"),
                     (dict(spans=(64,), backend="trt"), "takes no --spans")):
        with pytest.raises(InvalidRequestError, match=why):
            BuildConfig(bundle=engine_bundle, **{**TABLE, **bad})


def test_contexts_beyond_the_static_capacity_are_refused_up_front(graphs):
    assert graphs.max_context == 256
    with pytest.raises(InvalidRequestError, match="more than the context of 256"):
        graphs.generate([[1] * 250], max_new_tokens=10)
    with pytest.raises(InvalidRequestError, match="batch of 5 exceeds the engines' largest batch bucket"):
        graphs.generate([[1, 2]] * 5, max_new_tokens=2, batch_size=5)


def test_slots_serve_concurrent_calls_and_refuse_what_would_deadlock(graphs, humaneval, tmp_path, engine_bundle):
    from concurrent.futures import ThreadPoolExecutor

    alone = [o.token_ids for o in graphs.generate(humaneval[:4], method="sd", max_new_tokens=16)]
    with ThreadPoolExecutor(4) as ex:  # 2 slots, 4 threads: calls wait for a slot
        together = list(ex.map(lambda p: graphs.generate(p, method="sd", max_new_tokens=16).token_ids, humaneval[:4] * 2))
    assert together == alone * 2
    # one slot, and a model drafting for itself needs two runners of one backend at once
    b = tmp_path / "one-slot"
    shutil.copytree(engine_bundle, b)
    e = artifacts.load(b, EngineSet)
    artifacts.save(b, replace(e, slots=1))
    one = Pipeline.load(b, backend="static", threads=2)
    one.draft = one.target
    with pytest.raises(InvalidRequestError, match="have 1 slot\\(s\\) and this call holds them all.*--slots 2"):
        one.generate("def f():", method="sd", max_new_tokens=4)
    assert one.generate("def f():", method="autoregressive", max_new_tokens=4).token_ids  # the slot was given back


def test_engines_built_elsewhere_are_refused_in_one_line(engine_bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(engine_bundle, b)
    data = json.loads((b / "engines.json").read_text())
    data["versions"] = {"torch": "0.0.1"}
    (b / "engines.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="engines.json was built with torch 0.0.1 on the CPU, but this is torch .* on "
                                          "the CPU: re-run `specrt build --bundle .*` here"):
        Pipeline.load(b, backend="static")
    (b / "engines.json").unlink()
    with pytest.raises(BundleError, match="no engines.json in .*: run `specrt build --bundle .*` first"):
        Pipeline.load(b, backend="static")
    with pytest.raises(InvalidRequestError, match="was built for cpu, not cuda:0"):
        Pipeline.load(engine_bundle, backend="static", device="cuda:0")


def test_build_options_are_checked():
    from specrt.engines.config import BuildConfig

    with pytest.raises(InvalidRequestError, match="token_profiles must be distinct integers >= 1 in ascending order"):
        BuildConfig(token_profiles=(8, 4))
    with pytest.raises(InvalidRequestError, match="batch_buckets"):
        BuildConfig(batch_buckets=())
    with pytest.raises(InvalidRequestError, match="--backend trt takes no --projections"):
        BuildConfig(backend="trt", projections="qkv")


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", [None, "default", "tuned"])
def test_cuda_graphs_replay_the_eager_step(demo_bundle, tmp_path, humaneval, compile_mode):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: CUDA graphs need one")
    from specrt.engines.build import BuildConfig, build

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    # compiled: a smaller table (each shape compiles Triton kernels), what the runs below need
    table = TABLE if compile_mode is None else dict(token_profiles=(1, 32), batch_buckets=(1, 2), capacity=256,
                                                    spans=(128,))
    e = build(BuildConfig(bundle=b, device="cuda", compile=compile_mode, **table), progress=False)
    assert e.cuda_graphs and e.device_name and all(err <= 1e-4 for err in e.parity.values())
    assert e.compile == compile_mode
    graphs = Pipeline.load(b, backend="static")
    ar = [o.token_ids for o in graphs.generate(humaneval[:4], method="autoregressive", max_new_tokens=24)]
    for kw in LOSSLESS:
        assert [o.token_ids for o in graphs.generate(humaneval[:4], max_new_tokens=24, **kw)] == ar, kw
        # two running, two joining: prefilled alone in the admission cache's captured graphs
        assert [o.token_ids for o in graphs.generate(humaneval[:4], max_new_tokens=24, batch_size=2, **kw)] == ar, kw


@pytest.mark.gpu
def test_captured_graphs_survive_inductor_cuda_graphs_in_the_same_process(demo_bundle, tmp_path, humaneval):
    """Inductor's CUDA graphs (torch.compile(mode="reduce-overhead"), which HF generate's static-cache compile uses)
    clear cuBLAS's workspaces at each recording. A graph of ours captured over a workspace made outside its pool
    then writes into freed memory: on an H200 the next replay failed with "illegal memory access". Ours keep their
    workspace in their own pool: they give the same tokens after such a compile, and write into no one else's
    tensors."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: CUDA graphs need one")
    from specrt.engines.build import BuildConfig, build

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    build(BuildConfig(bundle=b, device="cuda", token_profiles=(1, 8), batch_buckets=(1,), capacity=256, spans=(128,)),
          progress=False)
    graphs = Pipeline.load(b, backend="static")
    ar = [o.token_ids for o in graphs.generate(humaneval[:2], method="autoregressive", max_new_tokens=24)]

    x = torch.randn(512, 512, device="cuda")
    mm = torch.compile(lambda a: (a @ a).relu() @ a, mode="reduce-overhead")
    for _ in range(3):
        mm(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # tensors of many sizes over whatever the workspaces left free, to see whether a replay writes into them
    sentinels = [torch.full((n,), 7.0, device="cuda") for n in (1 << k for k in range(10, 24)) for _ in range(2)]
    again = [o.token_ids for o in graphs.generate(humaneval[:2], method="autoregressive", max_new_tokens=24)]
    sd = [o.token_ids for o in graphs.generate(humaneval[:2], method="sd", max_new_tokens=24)]
    torch.cuda.synchronize()
    assert again == ar and sd == ar
    assert all(bool((t == 7.0).all()) for t in sentinels)


def test_calibrate_profile_and_tune_run_on_the_engines(engine_bundle, tmp_path):
    """What the GPU session's `batch` call runs, at toy sizes: teacher-forced sequences longer than the largest profile go in
    chunks, and the runners the profiler times are given back before it decodes (one slot per model)."""
    from specrt.calibration.acceptance import CalibrationConfig, calibrate
    from specrt.calibration.latency import ProfileConfig, profile
    from specrt.calibration.tune import TuneConfig, tune

    b = tmp_path / "b"
    shutil.copytree(engine_bundle, b)
    artifacts.save(b, replace(artifacts.load(b, EngineSet), slots=1))
    acc = calibrate(CalibrationConfig(bundle=b, backend="static", threads=2, num_prompts=2, new_tokens=12, max_depth=3,
                                      max_rank=3, max_nodes=6, dynamic_sizes=(4,), merged_sizes=()), progress=False)
    assert acc.num_positions == 2 * 12
    lat = profile(ProfileConfig(bundle=b, backend="static", threads=2, batch_sizes=(1, 2), contexts=(64,),
                                num_tokens=(1, 2, 4, 8), repeats=1, warmup=0, passes=1), progress=False)[None]
    assert lat.stamp.machine.backend == "static" and set(lat.host_ms) == {"tree", "dynamic", "merged", "ngram"}
    assert lat.cache_bucket == artifacts.load(b, EngineSet).capacity  # a static cache: one bucket, its capacity
    assert lat.cache_spans == (64, 128, 256)  # whose attention spans price a context
    plan = tune(TuneConfig(bundle=b, batch_sizes=(1, 2)))
    pipe = Pipeline.load(b, backend="static", threads=2)
    assert pipe.evidence.plan() == plan  # stamped with the static backend's machine, so it loads here
    # a request joining a running batch is prefilled beside it: bench batch prices those rows (test_batch_bench)
    assert pipe.target.static_cache and pipe.draft.static_cache
