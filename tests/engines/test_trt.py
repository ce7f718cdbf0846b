"""TensorRT engines (`specrt build --backend trt`, backend "trt"). TensorRT does not install on these machines:
the orchestration runs against a recording fake of the tensorrt module (tests/fake_tensorrt.py) whose engines
execute the step ONNX in ONNX Runtime at the raw addresses bound to them, so wrong shapes, addresses,
profiles or cache bindings give wrong tokens. Real-engine tests are marked trt and skip without TensorRT."""

import json
import shutil
import sys
from dataclasses import replace

import numpy as np
import pytest

from specrt.bundle import artifacts
from specrt.bundle.artifacts import TrtEngineSet
from specrt.errors import BundleError, InvalidRequestError, SpecrtError
from tests import fake_tensorrt as fake

TABLE = dict(token_profiles=(1, 4, 8, 16, 32), batch_buckets=(1, 2, 4), capacity=256)


@pytest.fixture
def trt(monkeypatch):
    fake.reset()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    return fake


@pytest.fixture(scope="module")
def trt_bundle(demo_bundle, tmp_path_factory):
    """The demo bundle with fake-TensorRT plans, 2 slots; and what the builder was asked."""
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans

    fake.reset()
    b = tmp_path_factory.mktemp("trt") / "b"
    shutil.copytree(demo_bundle, b)
    cfg = BuildConfig(bundle=b, backend="trt", slots=2, workspace_mib=512, version_compatible=True, **TABLE)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "tensorrt", fake)
        engines = build_plans(fake, cfg, "cpu", progress=False)
    return b, engines, list(fake.CALLS)


def _pipeline(bundle, engines):
    """A Pipeline on TrtBackends on the CPU (Pipeline.load refuses backend trt off CUDA, as it should)."""
    from tokenizers import Tokenizer

    from specrt.bundle.machine import Machine
    from specrt.bundle.manifest import load_manifest
    from specrt.runtime.backends.trt import TrtBackend
    from specrt.runtime.pipeline import Pipeline

    manifest = load_manifest(bundle)
    models = [TrtBackend(manifest.models[r], bundle, "cpu", engines) for r in ("target", "draft")]
    tokenizer = Tokenizer.from_file(str(bundle / manifest.tokenizer / "tokenizer.json"))
    return Pipeline(bundle, manifest, tokenizer, *models, machine=Machine.here("trt", 1, "cpu"))


def test_the_builder_gets_a_strongly_typed_network_a_profile_per_token_range_and_the_flags(trt_bundle):
    b, engines, calls = trt_bundle
    builds = [c for c in calls if c[0] == "build_serialized_network"]
    assert len(builds) == 2  # target and draft
    e = json.loads((b / "manifest.json").read_text())["models"]["target"]
    hkv, d = e["num_kv_heads"], e["head_dim"]
    _, flags, builder_flags, pools, hw, profiles = builds[0]
    assert flags == 1 << int(fake.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    assert builder_flags == [fake.BuilderFlag.VERSION_COMPATIBLE]
    assert pools == {fake.MemoryPoolType.WORKSPACE: 512 << 20}
    assert hw == fake.HardwareCompatibilityLevel.NONE
    assert len(profiles) == 2 * 5  # the table once per slot
    assert profiles[:5] == profiles[5:]
    lows = (1, 2, 5, 9, 17)
    for p, (lo, hi) in enumerate(zip(lows, TABLE["token_profiles"])):
        shapes = profiles[p]
        assert shapes["input_ids"] == shapes["position_ids"] == ((1, lo), (1, hi), (4, hi))
        assert shapes["attention_mask"] == ((1, lo, 1 + lo), (1, hi, 128 + hi), (4, hi, 256 + hi))
        for layer in range(e["num_layers"]):
            for name in (f"past_key.{layer}", f"past_value.{layer}"):
                assert shapes[name] == ((1, hkv, 1, d), (1, hkv, 128, d), (4, hkv, 256, d))
    assert [c[1].endswith(f"{r}.onnx") for c, r in zip([c for c in calls if c[0] == "parse_from_file"],
                                                         ("target", "draft"))] == [True, True]


def test_hardware_compatibility_reaches_the_builder_and_the_artifact_checks_the_gpu(trt, trt_bundle, tmp_path):
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import compile_plan
    from specrt.bundle.manifest import load_manifest

    b, engines, _ = trt_bundle
    entry = load_manifest(b).models["draft"]
    for level in ("ampere_plus", "same_compute_capability"):
        compile_plan(fake, b / entry.onnx, entry, BuildConfig(bundle=b, backend="trt", hardware_compatibility=level,
                                                               **TABLE), progress=False)
        assert fake.CALLS[-1][4] == getattr(fake.HardwareCompatibilityLevel, level.upper())
    # an ampere_plus plan runs on any GPU of compute capability >= 8.0; off a GPU (no capability) it does not
    c = tmp_path / "c"
    shutil.copytree(b, c)
    artifacts.save(c, replace(engines, hardware_compatibility="ampere_plus"))
    with pytest.raises(BundleError, match="built with tensorrt 10.13.0 on the CPU, but this is tensorrt 10.13.0 on"):
        artifacts.load(c, TrtEngineSet)


def test_the_artifact_names_the_plans_and_what_they_depend_on(trt, trt_bundle):
    b, engines, _ = trt_bundle
    e = artifacts.load(b, TrtEngineSet)
    assert e == engines
    assert (e.kind, e.versions, e.device, e.slots, e.hardware_compatibility, e.version_compatible) == (
        "trt", {"tensorrt": "10.13.0"}, "cpu", 2, "none", True)
    assert e.profile_index(1) == 0 and e.profile_index(3) == 1 and e.profile_index(32) == 4
    assert e.profile_index(3, slot=1) == 6
    import hashlib

    for role in ("target", "draft"):
        data = (b / e.plans[role]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (e.plan_bytes[role], e.plan_sha256[role])
        assert e.parity[role] < 1e-4  # checked at build: the engine's step == the eager step
    assert sorted(p.name for p in (b / "trt").iterdir()) == sorted(p.split("/")[1] for p in e.plans.values())


def test_lossless_methods_on_trt_engines_equal_autoregressive_and_switch_profiles(trt, trt_bundle, pipelines,
                                                                                   humaneval):
    b, engines, _ = trt_bundle
    pipe = _pipeline(b, engines)
    assert not pipe.target.static_cache  # the runtime's cache grows per call; the plans' S is dynamic
    prompts = humaneval[:4]  # longer than the largest profile: prefill in 32-token chunks
    ar = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=20)]
    fake.CALLS.clear()
    assert [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=20)] == ar
    for kw in (dict(method="sd"), dict(method="tree"), dict(method="dynamic", num_draft_tokens=6)):
        got = pipe.generate(prompts, max_new_tokens=20, batch_size=3, **kw)
        assert [o.token_ids for o in got] == ar, kw
    # every step ran in the smallest profile that holds its token count, never re-selecting a profile
    runs = [c for c in fake.CALLS if c[0] == "execute_async_v3"]
    assert runs and all(p % 5 == engines.token_profiles.index(engines.for_tokens(s["input_ids"][1]))
                        for _, _, p, s in runs)
    assert {s["input_ids"][1] for *_, s in runs} >= {1, 32}
    assert not [c for c in fake.CALLS if c[0] == "set_optimization_profile_async"]  # set once, at load


@pytest.fixture(scope="module")
def int8_trt(demo_bundle, tmp_path_factory):
    """The demo bundle quantized int8-qdq (symmetric Q/DQ) and static-int8 (uint8), with fake-TensorRT plans of int8-qdq."""
    from specrt.engines.config import BuildConfig
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.engines.trt import build_plans

    fake.reset()
    b = tmp_path_factory.mktemp("trt-int8") / "b"
    shutil.copytree(demo_bundle, b)
    for scheme in ("int8-qdq", "static-int8"):
        quantize(QuantizeConfig(bundle=b, scheme=scheme, calibration_prompts=4, prompt_tokens=64), progress=False)
    cfg = BuildConfig(bundle=b, backend="trt", quant="int8-qdq", **TABLE)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "tensorrt", fake)
        engines = build_plans(fake, cfg, "cpu", progress=False)
    return b, engines, list(fake.CALLS)


def test_int8_plans_are_built_from_symmetric_qdq_graphs_without_precision_flags(trt, int8_trt, humaneval):
    from specrt.runtime.pipeline import Pipeline

    b, engines, calls = int8_trt
    parsed = [c[1] for c in calls if c[0] == "parse_from_file"]
    assert [p.split("/b/")[-1] for p in parsed] == ["quant/int8-qdq/target.onnx", "quant/int8-qdq/draft.onnx"]
    builds = [c for c in calls if c[0] == "build_serialized_network"]
    assert all(flags == 1 << int(fake.NetworkDefinitionCreationFlag.STRONGLY_TYPED) and builder_flags == []
               for _, flags, builder_flags, *_ in builds)  # strongly typed: the Q/DQ nodes say where INT8 runs
    assert engines.quant == "int8-qdq" and artifacts.load(b, TrtEngineSet, here=False).quant == "int8-qdq"
    assert all(err < 1e-4 for err in engines.parity.values())  # against ONNX Runtime running the same graphs
    # lossless against the quantized pair's autoregressive decoding (ONNX Runtime, the same Q/DQ graphs)
    pipe, ort = _pipeline(b, engines), Pipeline.load(b, threads=2, quant="int8-qdq")
    prompts = humaneval[:3]
    ar = [o.token_ids for o in ort.generate(prompts, max_new_tokens=16)]
    assert [o.token_ids for o in pipe.generate(prompts, max_new_tokens=16)] == ar
    for kw in (dict(method="sd"), dict(method="tree")):
        assert [o.token_ids for o in pipe.generate(prompts, max_new_tokens=16, batch_size=2, **kw)] == ar, kw


def test_quantized_plans_are_refused_for_schemes_tensorrt_does_not_import(trt, int8_trt, tmp_path):
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans

    b, _, _ = int8_trt
    with pytest.raises(SpecrtError, match="static-int8 is Q/DQ with uint8 activations and non-zero zero points.*"
                                          "--scheme int8-qdq"):
        build_plans(fake, BuildConfig(bundle=b, backend="trt", quant="static-int8", **TABLE), "cpu", progress=False)
    with pytest.raises(SpecrtError, match="int8-weights is ONNX Runtime's MatMulNBits"):
        build_plans(fake, BuildConfig(bundle=b, backend="trt", quant="int8-weights", **TABLE), "cpu", progress=False)
    with pytest.raises(SpecrtError, match="dynamic-int8 is MatMulInteger on activations quantized as the step runs"):
        build_plans(fake, BuildConfig(bundle=b, backend="trt", quant="dynamic-int8", **TABLE), "cpu", progress=False)
    with pytest.raises(InvalidRequestError, match="--quant int8-qdq: the static engines quantize their projections "
                                                  "with int8-wo or fp8 .*or in TensorRT engines with --backend trt"):
        BuildConfig(bundle=b, backend="static", quant="int8-qdq")
    from specrt.runtime.pipeline import Pipeline

    with pytest.raises(InvalidRequestError, match=r"trt-engines.json was built from the int8-qdq variant: rebuild with "
                                                  r"`specrt build --bundle .* --backend trt --quant static-int8`"):
        Pipeline.load(b, backend="trt", quant="static-int8")  # the plans hold one variant: no other runs on them
    # the fake parser refuses such graphs as TensorRT's would: it is not only the builder's check that stops them
    parser = fake.OnnxParser(fake.INetworkDefinition(0), None)
    assert not parser.parse_from_file(str(b / "quant/static-int8/target.onnx"))
    assert "zeroPt must be all zeros" in parser.get_error(0)


def test_fp8_plans_are_built_from_float8_qdq_graphs_and_refused_below_compute_capability_8_9(trt, int8_trt, humaneval,
                                                                                             monkeypatch, tmp_path):
    from specrt.engines import trt as trt_engines
    from specrt.engines.config import BuildConfig
    from specrt.engines.quantize import QuantizeConfig, quantize
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(int8_trt[0], b)
    quantize(QuantizeConfig(bundle=b, scheme="fp8-qdq", calibration_prompts=4, prompt_tokens=64), progress=False)
    cfg = BuildConfig(bundle=b, backend="trt", quant="fp8-qdq", **TABLE)
    fake.reset()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    engines = trt_engines.build_plans(fake, cfg, "cpu", progress=False)
    parsed = [c[1].split("/b/")[-1] for c in fake.CALLS if c[0] == "parse_from_file"]
    assert parsed == ["quant/fp8-qdq/target.onnx", "quant/fp8-qdq/draft.onnx"]  # float8 zero points of 0: accepted
    assert engines.quant == "fp8-qdq" and all(err < 1e-4 for err in engines.parity.values())
    pipe, ort = _pipeline(b, engines), Pipeline.load(b, threads=2, quant="fp8-qdq")
    ar = [o.token_ids for o in ort.generate(humaneval[:2], max_new_tokens=12)]
    assert [o.token_ids for o in pipe.generate(humaneval[:2], max_new_tokens=12, method="sd", batch_size=2)] == ar
    real = trt_engines.environment
    monkeypatch.setattr(trt_engines, "environment",
                        lambda device, tensorrt=False: {**real(device, tensorrt), "compute_capability": "8.0"})
    with pytest.raises(SpecrtError, match="FP8 plans need a GPU of compute capability >= 8.9 .*cpu is 8.0: build "
                                          "--quant int8-qdq here"):
        trt_engines.build_plans(fake, cfg, "cpu", progress=False)


def test_concurrent_calls_hold_disjoint_contexts_and_profiles(trt, trt_bundle, humaneval):
    from concurrent.futures import ThreadPoolExecutor

    b, engines, _ = trt_bundle
    pipe = _pipeline(b, engines)  # 2 slots: each slot's contexts hold profiles of their own
    assert len(pipe.target._slots) == 2
    held = [[c.profile for c in s.contexts] for s in pipe.target._slots]  # the profile each context holds
    assert held == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # one per token range, and no profile in two slots
    alone = [pipe.generate(p, method="sd", max_new_tokens=12).token_ids for p in humaneval[:3]]
    with ThreadPoolExecutor(3) as ex:  # 3 threads, 2 slots: a call waits for a slot
        together = list(ex.map(lambda p: pipe.generate(p, method="sd", max_new_tokens=12).token_ids, humaneval[:3] * 2))
    assert together == alone * 2
    # a third set of contexts on the same plan cannot take profiles both slots hold (TensorRT's rule, kept by the fake)
    ctx = pipe.target.engine.create_execution_context(fake.ExecutionContextAllocationStrategy.USER_MANAGED)
    assert not ctx.set_optimization_profile_async(0, 0)


@pytest.fixture(scope="module")
def in_graph_trt(inplace_bundle, tmp_path_factory):
    """The demo bundle with `specrt inplace`'s graphs and fake-TensorRT 10.15 plans built from them."""
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans

    b = tmp_path_factory.mktemp("trt-in-graph") / "b"
    shutil.copytree(inplace_bundle, b)
    fake.reset("10.15.1")
    cfg = BuildConfig(bundle=b, backend="trt", kv_update="inplace", **TABLE)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "tensorrt", fake)
        engines = build_plans(fake, cfg, "cpu", progress=False)
    calls = list(fake.CALLS)
    fake.reset()
    return b, engines, calls


def test_in_graph_engines_take_a_static_cache_and_write_it_in_place(trt, in_graph_trt, pipelines, humaneval):
    """The KV-cache route: the plans are built from TensorScatter + Attention graphs with the capacity static, the
    backend binds each present output to its cache input (the fake refuses a step otherwise), and lossless methods
    give autoregressive's tokens."""
    b, engines, calls = in_graph_trt
    fake.reset("10.15.1")
    assert engines.kv_update == "inplace" and artifacts.load(b, TrtEngineSet).kv_update == "inplace"
    assert [c[1] for c in calls if c[0] == "parse_from_file"] == [str(b / "inplace/target.onnx"),
                                                                   str(b / "inplace/draft.onnx")]
    e = json.loads((b / "manifest.json").read_text())["models"]["target"]
    profiles = [c for c in calls if c[0] == "build_serialized_network"][0][5]
    for p, hi in enumerate(TABLE["token_profiles"]):
        shapes = profiles[p]
        assert shapes["attention_mask"] == ((1, (1, 2, 5, 9, 17)[p], 256), (1, hi, 256), (4, hi, 256))
        assert shapes["write_indices"] == ((1,), (1,), (4,))
        assert shapes["past_key.0"] == ((1, e["num_kv_heads"], 256, e["head_dim"]), (1, e["num_kv_heads"], 256,
                                        e["head_dim"]), (4, e["num_kv_heads"], 256, e["head_dim"]))
    assert engines.parity["target"] < 1e-4  # the built engine's step == the eager step (rows past each length)
    pipe = _pipeline(b, engines)
    prompts = humaneval[:4]
    ar = [o.token_ids for o in pipelines["ort"].generate(prompts, method="autoregressive", max_new_tokens=20)]
    for kw in (dict(method="autoregressive"), dict(method="sd"), dict(method="tree"),
               dict(method="dynamic", num_draft_tokens=6)):
        fake.CALLS.clear()
        got = pipe.generate(prompts, max_new_tokens=20, batch_size=3, **kw)
        assert [o.token_ids for o in got] == ar, kw
        # the fourth request joins the running ones prefilled alone, in the static store's next free row (a
        # prefill beside them would step the running sequences as empty rows): one-sequence steps of prompt chunks
        runs = [s["input_ids"] for c, *_, s in fake.CALLS if c == "execute_async_v3"]
        assert runs[0][0] == 3 and (1, 32) in runs, kw
    with pipe.target.runner() as runner:
        assert runner.new_cache(2).is_static  # the engine's static cache, capacity 256
    assert pipe.target.static_cache  # what the batch cost model prices joining requests by


def test_in_graph_engines_need_tensorrt_10_15_and_the_inplace_graphs(trt, demo_bundle, in_graph_trt, tmp_path):
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans

    b, _, _ = in_graph_trt
    fake.reset("10.14.1")
    with pytest.raises(SpecrtError, match="TensorRT 10.14.1 cannot import the in-graph KV update .*>= 10.15"):
        build_plans(fake, BuildConfig(bundle=b, backend="trt", kv_update="inplace", **TABLE), "cpu", progress=False)
    fake.reset("10.15.1")
    with pytest.raises(BundleError, match="no inplace.json in .*: run `specrt inplace --bundle"):
        build_plans(fake, BuildConfig(bundle=demo_bundle, backend="trt", kv_update="inplace", **TABLE), "cpu",
                    progress=False)
    with pytest.raises(InvalidRequestError, match="--kv-update inplace builds TensorRT engines"):
        BuildConfig(bundle=b, kv_update="inplace")


def test_plans_for_another_tensorrt_or_gpu_are_refused_in_one_line(trt, trt_bundle, tmp_path):
    b0, engines, _ = trt_bundle
    b = tmp_path / "b"
    shutil.copytree(b0, b)
    fake.reset("10.14.1")  # version-compatible: a later 10.x runs it
    assert artifacts.load(b, TrtEngineSet).versions == {"tensorrt": "10.13.0"}
    fake.reset("11.0.0")
    with pytest.raises(BundleError, match=r"trt-engines.json was built with tensorrt 10.13.0 on the CPU, but this is "
                                          r"tensorrt 11.0.0 on the CPU \(the ONNX step graphs still run with --backend "
                                          r"ort\): re-run `specrt build --bundle .* --backend trt` here"):
        artifacts.load(b, TrtEngineSet)
    fake.reset("10.13.0")
    artifacts.save(b, replace(engines, version_compatible=False, stamp=engines.stamp))
    fake.reset("10.14.1")
    with pytest.raises(BundleError, match="built with tensorrt 10.13.0"):
        artifacts.load(b, TrtEngineSet)
    # the plan itself also refuses to load in another version (what TensorRT's runtime does)
    from specrt.bundle.manifest import load_manifest
    from specrt.runtime.backends.trt import TrtBackend

    with pytest.raises(BundleError, match=r"TensorRT 10.14.1 cannot load .*target-.*\.plan \(the plan was built with "
                                          r"TensorRT 10.13.0, this is 10.14.1\)"):
        TrtBackend(load_manifest(b).models["target"], b, "cpu", replace(engines, version_compatible=False))
    fake.reset("10.13.0")
    (b / engines.plans["draft"]).write_bytes(b"truncated")
    with pytest.raises(BundleError, match="draft-.*plan is missing or not the plan trt-engines.json describes"):
        TrtBackend(load_manifest(b).models["draft"], b, "cpu", engines)


def test_an_engine_refusing_a_shape_says_so(trt, trt_bundle):
    b, engines, _ = trt_bundle
    pipe = _pipeline(b, engines)
    narrower = replace(engines, token_profiles=(1, 4, 8, 16, 64))  # the plan's last profile stops at 32 tokens
    pipe.target.engines = narrower
    slot = pipe.target._slots.acquire()
    try:
        with pytest.raises(SpecrtError, match="refuses input_ids of shape \\(1, 40\\) in profile 4"):
            pipe.target._run(slot, np.zeros((1, 40), np.int64), np.zeros((1, 40), np.int64),
                             np.ones((1, 40, 168), bool), _grown_cache(pipe.target, slot))
    finally:
        pipe.target._slots.release(slot)


def _grown_cache(backend, slot):
    cache = backend._new_cache(slot, 1, 128)
    cache.reserve(1)
    return cache


def test_trt_without_tensorrt_is_one_line_and_status_2(demo_bundle, monkeypatch, capsys):
    from specrt.cli import main

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt raises ImportError
    assert main(["build", "--bundle", str(demo_bundle), "--backend", "trt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specrt: error: TensorRT's Python package does not import here")
    assert "--backend ort" in err[0]
    assert not (demo_bundle / "trt-engines.json").exists()


def test_old_tensorrt_and_cpu_devices_are_refused(trt, demo_bundle):
    from specrt.runtime.backends import resolve_device
    from specrt.runtime.backends.trt import TensorRTUnavailableError, import_tensorrt

    fake.reset("8.6.1")
    with pytest.raises(TensorRTUnavailableError, match="TensorRT 8.6.1 is older than 10.1"):
        import_tensorrt()
    with pytest.raises(InvalidRequestError, match="TensorRT runs on a CUDA device, not the CPU"):
        resolve_device("trt", "cpu")


def test_a_bundle_without_onnx_cannot_be_built_for_tensorrt(trt, demo_bundle, tmp_path):
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    m = json.loads((b / "manifest.json").read_text())
    for entry in m["models"].values():
        entry["onnx"] = ""
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="no ONNX step graphs .*--no-onnx"):
        build_plans(fake, BuildConfig(bundle=b, backend="trt", **TABLE), "cpu", progress=False)


@pytest.mark.trt
def test_real_tensorrt_engines_equal_autoregressive(demo_bundle, tmp_path, humaneval):
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pytest.skip("TensorRT is not installed here (its PyPI packages download from NVIDIA's index)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: TensorRT needs one")
    from specrt.engines.build import BuildConfig, build
    from specrt.runtime.pipeline import Pipeline

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    build(BuildConfig(bundle=b, backend="trt", device="cuda", **TABLE), progress=False)
    trt_pipe = Pipeline.load(b, backend="trt")
    ref = Pipeline.load(b, backend="torch", device="cuda")
    prompts = humaneval[:4]
    ar = [o.token_ids for o in ref.generate(prompts, method="autoregressive", max_new_tokens=24)]
    for kw in (dict(method="autoregressive"), dict(method="sd"), dict(method="dynamic", num_draft_tokens=6)):
        assert [o.token_ids for o in trt_pipe.generate(prompts, max_new_tokens=24, **kw)] == ar, kw
