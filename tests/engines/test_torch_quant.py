"""8-bit projections of the PyTorch step (model/quant.py): INT8 weight-only and FP8, on the torch backend and in
the static engines (`specrt build --quant S`). Their kernels run on the CPU too, which is where this is tested;
their speed is a GPU matter (the GPU session's `quant` call, docs/gpu.md)."""

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from specrt.contract import TORCH_QUANT_SCHEMES
from specrt.errors import BundleError, InvalidRequestError
from specrt.runtime.pipeline import Pipeline
from tests.kernels import needs_kernel, quant_schemes

TABLE = dict(token_profiles=(1, 8, 32), batch_buckets=(1, 4), capacity=256)
LOSSLESS = [dict(method="sd"), dict(method="tree"), dict(method="dynamic", num_draft_tokens=6), dict(method="anpd")]


@pytest.mark.parametrize("scheme", quant_schemes())
def test_a_quantized_linear_is_close_and_computes_each_row_on_its_own(scheme):
    from specrt.model.quant import Fp8Linear, Int8WeightLinear

    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = (Int8WeightLinear if scheme == "int8-wo" else Fp8Linear)(linear)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        exact, got = linear(x), q(x)
        rel = ((got - exact).norm() / exact.norm()).item()
        assert 0 < rel < (0.01 if scheme == "int8-wo" else 0.06)  # quantized, and close
        loud = x.clone()
        loud[:, 1:] *= 1000  # the other rows of the step: a shared activation scale would wreck row 0
        assert torch.allclose(q(loud)[:, 0], got[:, 0], rtol=0, atol=1e-5)
        assert torch.allclose(q(x[:, :1]), got[:, :1], rtol=0, atol=1e-5)  # a step of one token
        assert torch.isfinite(q(torch.zeros(2, 64))).all()  # an all-zero row: zeros and the bias, not NaN


@pytest.mark.parametrize("scheme", quant_schemes())
def test_quantize_step_swaps_every_projection_and_shrinks_the_weights(demo_bundle, scheme):
    from specrt.bundle.manifest import load_manifest
    from specrt.model.quant import Fp8Linear, Int8WeightLinear, load_step_module

    entry = load_manifest(demo_bundle).models["target"]
    module, report = load_step_module(demo_bundle / entry.hf_dir, "float32", "cpu", quant=scheme)
    assert report.quantized == 7 * entry.num_layers and report.kept == 0  # q, k, v, o, gate, up, down
    assert report.bytes_after < report.bytes_before
    cls = Int8WeightLinear if scheme == "int8-wo" else Fp8Linear
    assert isinstance(module.hf.model.layers[0].mlp.down_proj, cls)
    assert isinstance(module.hf.lm_head, nn.Linear)  # the head stays in the model's dtype
    with pytest.raises(InvalidRequestError, match="unknown PyTorch quantization scheme 'int4'"):
        load_step_module(demo_bundle / entry.hf_dir, "float32", "cpu", quant="int4")


@pytest.mark.parametrize("scheme", quant_schemes())
def test_lossless_methods_on_quantized_projections_equal_their_autoregressive(demo_bundle, pipelines, humaneval,
                                                                               scheme):
    pipe = Pipeline.load(demo_bundle, backend="torch", device="cpu", threads=2, quant=scheme)
    assert pipe.machine.quant == scheme and pipe.target.quant.scheme == scheme
    prompts = humaneval[:5]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=24)]
    with pipe.target.runner() as runner, pipelines["torch"].target.runner() as float_runner:
        from specrt.runtime.step_inputs import sequence_logits

        ids = np.asarray(pipe.encode(prompts[0])[:40], dtype=np.int64)
        assert not np.array_equal(sequence_logits(runner, ids), sequence_logits(float_runner, ids))  # another model
    for batch_size, kws in ((3, LOSSLESS), (1, LOSSLESS[:2])):  # ragged batches for every method; batch 1 for two
        for kw in kws:
            got = pipe.generate(prompts, max_new_tokens=24, batch_size=batch_size, **kw)
            assert [o.token_ids for o in got] == ar, (batch_size, kw)


@pytest.fixture(scope="module")
def quant_engines(demo_bundle, tmp_path_factory):
    from specrt.engines.build import BuildConfig, build

    needs_kernel("fp8")
    b = tmp_path_factory.mktemp("quant-engines") / "b"
    shutil.copytree(demo_bundle, b)
    build(BuildConfig(bundle=b, device="cpu", threads=2, **TABLE), progress=False)
    build(BuildConfig(bundle=b, device="cpu", threads=2, quant="fp8", **TABLE), progress=False)
    return b


def test_quantized_engines_sit_beside_the_float_engines(quant_engines, humaneval):
    float_engines = json.loads((quant_engines / "engines.json").read_text())
    fp8 = json.loads((quant_engines / "quant/fp8/engines.json").read_text())
    assert (float_engines["quant"], fp8["quant"]) == (None, "fp8")
    assert fp8["weight_bytes"]["target"] < float_engines["weight_bytes"]["target"]
    # the padded static step computes the eager step of the same module, up to activations on a neighbouring fp8 step
    assert max(fp8["parity"].values()) <= 0.05 * 20
    pipe = Pipeline.load(quant_engines, backend="static", threads=2, quant="fp8")
    assert pipe.machine.quant == "fp8" and pipe.target.quant.scheme == "fp8"
    eager = Pipeline.load(quant_engines, backend="torch", device="cpu", threads=2, quant="fp8")
    prompts = humaneval[:4]
    ar = [o.token_ids for o in eager.generate(prompts, method="autoregressive", max_new_tokens=20)]
    assert [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=20)] == ar
    assert [o.token_ids for o in pipe.generate(prompts, method="sd", max_new_tokens=20, batch_size=3)] == ar
    assert Pipeline.load(quant_engines, backend="static", threads=2).machine.quant is None


def test_quantized_projections_are_refused_where_they_cannot_run(quant_engines):
    from specrt.bench.quant import QuantBenchConfig
    from specrt.engines.config import BuildConfig

    with pytest.raises(BundleError, match="no quant/int8-wo/engines.json in .*: run `specrt build --bundle .* --quant "
                                          "int8-wo` first"):
        Pipeline.load(quant_engines, backend="static", quant="int8-wo")
    with pytest.raises(InvalidRequestError, match="quant='fp8' quantizes the PyTorch step .*the ort backend runs "
                                                  "`specrt quantize`'s variants"):
        Pipeline.load(quant_engines, quant="fp8")
    with pytest.raises(InvalidRequestError, match="quant='static-int8': the static backend quantizes its projections"):
        Pipeline.load(quant_engines, backend="static", quant="static-int8")  # before looking for its engines
    with pytest.raises(InvalidRequestError, match="--quant int8-weights: the static engines quantize their projections"):
        BuildConfig(bundle=quant_engines, quant="int8-weights")
    with pytest.raises(InvalidRequestError, match="--quant with --backend trt builds TensorRT engines from a quantized "
                                                  "variant's Q/DQ graphs"):
        BuildConfig(bundle=quant_engines, backend="trt", quant="fp8")
    with pytest.raises(InvalidRequestError, match="--schemes static-int8: the torch backend measures the PyTorch step"):
        QuantBenchConfig(bundle=quant_engines, backend="torch", schemes=("static-int8",))
    assert QuantBenchConfig(bundle=quant_engines, backend="static").schemes == TORCH_QUANT_SCHEMES


def test_bench_quant_measures_the_torch_schemes(demo_bundle, tmp_path):
    from specrt.bench.quant import QuantBenchConfig, markdown, run_quant

    for scheme in TORCH_QUANT_SCHEMES:
        needs_kernel(scheme)
    cfg = QuantBenchConfig(bundle=demo_bundle, backend="torch", device="cpu", out=tmp_path, label="t", num_prompts=1,
                           max_new_tokens=12, runs=1, quality_prompts=2, quality_tokens=12, threads=2,
                           methods=("autoregressive", "sd"))
    data = run_quant(cfg)
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["exported", "int8-wo", "fp8"]
    assert rows["fp8"]["target_mb"] < rows["exported"]["target_mb"]
    assert rows["int8-wo"]["roofline_ms"] < rows["exported"]["roofline_ms"]
    assert all(0 < r["methods"]["autoregressive"]["roofline_fraction"] for r in rows.values())
    assert {d["draft"] for d in data["drafts"]} == {"int8-wo", "fp8"}
    assert "PyTorch eager on cpu" in markdown(data) and (tmp_path / "quant-t.png").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", TORCH_QUANT_SCHEMES)
def test_quantized_engines_capture_as_cuda_graphs(demo_bundle, tmp_path, humaneval, scheme):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: CUDA graphs need one")
    needs_kernel(scheme, "cuda")  # FP8: compute capability >= 8.9; INT8: a CUDA _weight_int8pack_mm
    from specrt.engines.build import BuildConfig, build

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    e = build(BuildConfig(bundle=b, device="cuda", quant=scheme, **TABLE), progress=False)
    assert e.cuda_graphs and e.quant == scheme
    pipe = Pipeline.load(b, backend="static", quant=scheme)
    ar = [o.token_ids for o in pipe.generate(humaneval[:4], method="autoregressive", max_new_tokens=24)]
    for kw in LOSSLESS:
        assert [o.token_ids for o in pipe.generate(humaneval[:4], max_new_tokens=24, **kw)] == ar, kw
