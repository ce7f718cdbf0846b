"""`specrt bench fusions`: the target's step under each projections setting of the ort backend, interleaved in one
run, each row against the first setting's."""

from __future__ import annotations

import pytest

from specrt.errors import InvalidRequestError


def test_bench_fusions_times_each_projections_setting_against_the_first(demo_bundle, tmp_path):
    from specrt.bench.catalog import headline
    from specrt.bench.fusions import FusionsConfig, run_fusions
    from specrt.bundle.manifest import load_manifest

    layers = load_manifest(demo_bundle).models["target"].num_layers
    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="t", tokens=(1, 3), context=20, repeats=2, runs=2,
                        threads=1)
    data = run_fusions(cfg)
    assert [(r["projections"], r["tokens"]) for r in data["rows"]] == [
        (p, t) for p in ("qkv", "all", "none") for t in (1, 3)]
    merged = {r["projections"]: r["merged_matmuls"] for r in data["rows"]}
    assert merged == {"qkv": 2 * layers, "all": 3 * layers, "none": 0}  # q, k, v into one; gate, up too; nothing
    for r in data["rows"]:
        assert len(r["runs_ms"]) == 2 and all(v > 0 for v in r["runs_ms"])
        first = next(f for f in data["rows"] if f["projections"] == "qkv" and f["tokens"] == r["tokens"])
        assert r["vs_first"] == pytest.approx(r["step_ms"] / first["step_ms"], rel=1e-2)
    assert data["graph"] == load_manifest(demo_bundle).models["target"].onnx
    md = (tmp_path / "fusions-t.md").read_text()
    assert md.startswith("### fusions `t`: the target's step") and "| none | 0 | 3 |" in md
    assert (tmp_path / "fusions-t.json").is_file()
    assert headline("fusions", data).startswith("all ") and "qkv's step at T=3" in headline("fusions", data)
    with pytest.raises(InvalidRequestError, match="each setting once"):
        FusionsConfig(bundle=demo_bundle, projections=("qkv", "qkv"))


def test_the_ort_backend_refuses_an_unknown_projections_setting(demo_bundle):
    from specrt.bundle.manifest import load_manifest
    from specrt.runtime.backends.ort import OrtBackend

    entry = load_manifest(demo_bundle).models["target"]
    with pytest.raises(InvalidRequestError, match="projections must be one of qkv, all, none, got 'gate'"):
        OrtBackend(entry, demo_bundle / entry.onnx, threads=1, projections="gate")


def test_op_times_assigns_each_kernel_to_the_run_it_ran_in():
    from specrt.bench.fusions import op_times

    trace = [{"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 50},
             {"cat": "Node", "name": "init_kernel_time", "ts": 10, "dur": 5, "args": {"op_name": "Cast"}},
             {"cat": "Session", "name": "model_run", "ts": 100, "dur": 1000},
             {"cat": "Node", "name": "mm_fence_before", "ts": 110, "dur": 0, "args": {"op_name": "MatMul"}},
             {"cat": "Node", "name": "mm_kernel_time", "ts": 110, "dur": 600, "args": {"op_name": "MatMul"}},
             {"cat": "Node", "name": "sm_kernel_time", "ts": 720, "dur": 100, "args": {"op_name": "Softmax"}},
             {"cat": "Session", "name": "model_run", "ts": 2000, "dur": 500},
             {"cat": "Node", "name": "mm_kernel_time", "ts": 2010, "dur": 200, "args": {"op_name": "MatMul"}},
             {"cat": "Node", "name": "mm2_kernel_time", "ts": 2300, "dur": 100, "args": {"op_name": "MatMul"}}]
    assert op_times(trace) == [(1.0, {"MatMul": 0.6, "Softmax": 0.1}), (0.5, {"MatMul": 0.3})]


def test_bench_fusions_splits_each_step_by_operator_type(demo_bundle, tmp_path):
    from specrt.bench.fusions import FusionsConfig, run_fusions

    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="ops", projections=("qkv", "none"), tokens=(1, 3),
                        context=20, repeats=3, runs=1, threads=1, ops=True)
    ops = run_fusions(cfg)["ops"]
    assert [(r["projections"], r["tokens"]) for r in ops] == [(p, t) for p in ("qkv", "none") for t in (1, 3)]
    for r in ops:
        kernels = sum(r["ops_ms"].values())
        assert 0 < kernels <= r["run_ms"] * 1.01, r  # the kernels ran inside the run
        assert r["ops_ms"]["MatMul"] > 0 and list(r["ops_ms"].values()) == sorted(r["ops_ms"].values(), reverse=True)
    md = (tmp_path / "fusions-ops.md").read_text()
    table = md[md.index("by operator type"):]
    assert "| MatMul |" in table.splitlines()[2]  # the header row names the operator types
    assert "| none | 3 |" in table and "outside kernels" in table


def test_a_backend_loaded_without_a_profile_folder_has_no_profile(demo_bundle):
    from specrt.bundle.manifest import load_manifest
    from specrt.runtime.backends.ort import OrtBackend

    entry = load_manifest(demo_bundle).models["target"]
    with pytest.raises(InvalidRequestError, match="without profile="):
        OrtBackend(entry, demo_bundle / entry.onnx, threads=1).end_profiling()


def test_bench_fusions_times_each_setting_with_and_without_packed_rows(demo_bundle, tmp_path):
    from specrt.bench.catalog import headline
    from specrt.bench.fusions import FusionsConfig, run_fusions

    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="p", projections=("qkv",), tokens=(1,), context=20,
                        repeats=2, runs=1, threads=1, packing=("packed", "unpacked"), ops=True)
    data = run_fusions(cfg)
    assert [(r["projections"], r["packing"]) for r in data["rows"]] == [("qkv", "packed"), ("qkv", "unpacked")]
    assert [(r["projections"], r["packing"]) for r in data["ops"]] == [("qkv", "packed"), ("qkv", "unpacked")]
    packed, unpacked = (r["ops_ms"] for r in data["ops"])
    assert "GatherND" in packed and "GatherND" not in unpacked  # the packing's gathers, and only there
    md = (tmp_path / "fusions-p.md").read_text()
    assert "| qkv, unpacked | " in md and headline("fusions", data).startswith("qkv, unpacked ")
    with pytest.raises(InvalidRequestError, match="--packing takes each setting once"):
        FusionsConfig(bundle=demo_bundle, packing=("unpacked", "unpacked"))


def test_bench_fusions_times_the_step_with_and_without_huge_pages(demo_bundle, tmp_path):
    """--huge-pages on,off: each setting loaded twice, its weights' memory collapsed into huge pages or left as loaded
    (which of the two the tables name, and what was collapsed)."""
    from specrt.bench.fusions import FusionsConfig, run_fusions

    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="h", projections=("qkv",), tokens=(1,), context=20,
                        repeats=2, runs=1, threads=1, huge_pages=("on", "off"))
    data = run_fusions(cfg)
    assert [(r["projections"], r["huge_pages"]) for r in data["rows"]] == [("qkv", "on"), ("qkv", "off")]
    assert data["rows"][1]["huge_page_mib"] == 0
    md = (tmp_path / "fusions-h.md").read_text()
    assert "| qkv | " in md and "| qkv, huge pages off | " in md
    with pytest.raises(InvalidRequestError, match="--huge-pages takes each setting once"):
        FusionsConfig(bundle=demo_bundle, huge_pages=())
