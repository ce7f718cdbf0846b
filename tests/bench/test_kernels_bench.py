"""`specrt bench kernels`: a step's wall time split into host work, weight GEMMs, other kernels, gaps and the wait
after, on the CPU (the static engines run eagerly there; a GPU's graphs are profiled by the gpu-session)."""

import json
import shutil

import numpy as np
import pytest

from specrt.bench.kernels import Kernel, step_summary


def test_a_steps_time_is_split_between_host_kernels_gaps_and_the_wait_after():
    # two steps of 100 µs: host 10 µs, kernels a (gemm) 20 µs, gap 5, b 30, gap 5 (b overlaps a copy), wait 30
    kernels = []
    for t0 in (0.0, 1000.0):
        kernels += [Kernel("gemm", t0 + 10, t0 + 30), Kernel("b", t0 + 35, t0 + 65), Kernel("copy", t0 + 40, t0 + 50),
                    Kernel("gemm", t0 + 70, t0 + 70)]
    s = step_summary([(0.0, 100.0), (1000.0, 1100.0)], kernels, {"gemm": 2e6, "b": 1e6}, {"gemm"}, 1e11, top=2)
    assert (s["steps"], s["wall_ms"], s["host_before_ms"], s["weight_gemm_ms"], s["other_kernels_ms"], s["gaps_ms"],
            s["after_ms"]) == (2, 0.1, 0.01, 0.02, 0.03, 0.01, 0.03)
    assert s["kernels_per_step"] == 4 and s["gap_us_median"] == 5.0 and s["outside_weight_gemm_share"] == 0.8
    assert (s["longest_gap_us_mean"], s["longest_gap_before"]) == (5.0, "gemm")  # two of 5 µs: either is the longest
    assert [r["kernel"] for r in s["top"]] == ["b", "gemm"]  # the longest first, `top` of them
    gemm = s["top"][1]
    assert (gemm["weight_gemm"], gemm["calls"], gemm["gb_s"], gemm["of_bandwidth"]) == (True, 2, 100.0, 1.0)
    assert s["weight_gemm_of_bandwidth"] == 1.0  # 2 MB in 20 µs against 100 GB/s
    assert "longest_call" not in s  # no runtime calls given (the CPU has none)


def test_the_hosts_longest_runtime_call_of_each_step_is_named():
    """A gap inside a step where the host was still launching shows as the step's longest runtime call (a CUDA
    graph's launch, if its cost grows with its nodes)."""
    kernels = [Kernel("copy", 1, 2), Kernel("embedding", 40, 45), Kernel("copy", 1001, 1002),
               Kernel("embedding", 1050, 1055)]
    calls = [Kernel("cudaMemcpyAsync", 0, 1), Kernel("cudaGraphLaunch", 2, 39), Kernel("cudaMemcpyAsync", 1000, 1001),
             Kernel("cudaGraphLaunch", 1002, 1049),
             Kernel("cudaGraphLaunch", 5000, 9000)]  # outside the steps
    s = step_summary([(0.0, 100.0), (1000.0, 1100.0)], kernels, {}, set(), 1e11, top=2, calls=calls)
    assert (s["longest_call"], s["longest_call_us_mean"]) == ("cudaGraphLaunch", 42.0)
    assert (s["longest_gap_us_mean"], s["longest_gap_before"]) == (43.0, "embedding")


@pytest.fixture(scope="module")
def small_engines(demo_bundle, tmp_path_factory):
    from specrt.engines.build import BuildConfig, build

    b = tmp_path_factory.mktemp("kernels") / "b"
    shutil.copytree(demo_bundle, b)
    build(BuildConfig(bundle=b, device="cpu", threads=2, slots=1, token_profiles=(1, 8), batch_buckets=(1,),
                      capacity=256, spans=()), progress=False)
    return b


def test_bench_kernels_on_the_cpu_finds_the_weight_gemms_and_their_bytes(small_engines, tmp_path):
    from specrt.bench.kernels import KernelsConfig, run_kernels
    from specrt.runtime.pipeline import Pipeline

    cfg = KernelsConfig(bundle=small_engines, backend="static", threads=2, steps=3, context=64, out=tmp_path,
                        label="t")
    data = run_kernels(cfg)
    assert json.loads((tmp_path / "kernels-t.json").read_text())["rows"] == data["rows"]
    assert (tmp_path / "kernels-t.md").is_file() and (tmp_path / "kernels-t.png").is_file()
    module = Pipeline.load(small_engines, backend="static", threads=2).target.module
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in module.modules()
                       if isinstance(m, __import__("torch").nn.Linear))
    for kind, tokens in (("ar", 1), ("verify", 8)):
        (s,) = [r for r in data["rows"] if r["kind"] == kind]
        assert s["tokens"] == tokens and s["steps"] == 3
        parts = sum(s[p] for p in ("host_before_ms", "weight_gemm_ms", "other_kernels_ms", "gaps_ms", "after_ms"))
        assert parts == pytest.approx(s["wall_ms"], rel=0.01, abs=2e-4)
        top = {r["kernel"]: r for r in s["top"]}
        linear = top["aten::linear"]  # the projections: a weight matrix among their inputs
        assert linear["weight_gemm"] and not any(r["weight_gemm"] for k, r in top.items() if k != "aten::linear")
        # the bytes their operators read: every projection's weights once a step, and the activations beside them
        assert linear_bytes <= linear["mb"] * 2**20 * 1.01 < 1.5 * linear_bytes
        assert np.all(np.diff([r["ms"] for r in s["top"]]) <= 0)
    assert data["roofline_ms"] > 0 and not data["graphs"]
