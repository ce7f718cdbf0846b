"""`specrt bench fusions`: the target's step under each projections setting of the ort backend, interleaved in one
run, each row against the first setting's."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrt.bench.peers import llama_cpp_missing
from specrt.errors import InvalidRequestError, SpecrtError

LLAMA_CPP = Path("build/peers/llama.cpp")  # `make peers`: CI leaves llama.cpp's build out
LLAMA_MISSING = llama_cpp_missing(LLAMA_CPP)


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
        ratios = sorted(a / b for a, b in zip(r["runs_ms"], first["runs_ms"]))  # within each run, then the median
        assert r["vs_first"] == pytest.approx((ratios[0] + ratios[1]) / 2, rel=1e-2)  # of rounded ms
    assert data["graph"] == load_manifest(demo_bundle).models["target"].onnx
    md = (tmp_path / "fusions-t.md").read_text()
    assert md.startswith("### fusions `t`: the target's step") and "| none | 0 | 3 |" in md
    assert (tmp_path / "fusions-t.json").is_file()
    assert headline("fusions", data).startswith("all ") and "qkv's step at T=3" in headline("fusions", data)
    with pytest.raises(InvalidRequestError, match="each setting once"):
        FusionsConfig(bundle=demo_bundle, projections=("qkv", "qkv"))


def test_bench_fusions_times_a_prefill_chunk_with_and_without_the_head_on_every_row(demo_bundle, tmp_path):
    from specrt.bench.fusions import FusionsConfig, run_fusions

    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="rows", tokens=(16,), context=0, repeats=2, runs=2,
                        threads=1, projections=("qkv",), logit_rows=("on", "off"), head="discard")
    rows = run_fusions(cfg)["rows"]
    assert [r["logit_rows"] for r in rows] == ["on", "off"] and rows[0]["vs_first"] == 1.0
    md = (tmp_path / "fusions-rows.md").read_text()
    assert "| qkv, head on every row | " in md and "the LM head runs on no row" in md
    with pytest.raises(InvalidRequestError, match="each setting once"):
        FusionsConfig(bundle=demo_bundle, logit_rows=())


@pytest.mark.skipif(LLAMA_MISSING is not None, reason=str(LLAMA_MISSING))
def test_llama_cpps_step_is_timed_beside_ours_in_the_same_runs(demo_bundle, tmp_path):
    from specrt.bench.fusions import FusionsConfig, run_fusions

    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="peer", tokens=(1, 3), context=20, repeats=2, runs=2,
                        threads=1, projections=("qkv",), peers=("llama-cpp",), peer_cache=tmp_path / "cache",
                        llama_cpp_source=LLAMA_CPP.resolve())
    rows = run_fusions(cfg)["rows"]
    peer = [r for r in rows if r.get("peer") == "llama.cpp (f32)"]
    assert [r["tokens"] for r in peer] == [1, 3]
    for r in peer:
        ours = next(o for o in rows if "peer" not in o and o["tokens"] == r["tokens"])
        assert len(r["runs_ms"]) == 2 and all(v > 0 for v in r["runs_ms"])
        ratios = sorted(a / b for a, b in zip(r["runs_ms"], ours["runs_ms"]))
        assert r["vs_first"] == pytest.approx((ratios[0] + ratios[1]) / 2, rel=1e-2)  # of rounded ms
    assert "| llama.cpp (f32) | - | 3 |" in (tmp_path / "fusions-peer.md").read_text()


def test_llama_cpps_step_rolls_its_cache_back_to_the_context_after_each_step(demo_bundle, tmp_path):
    from specrt.bench.peers import LlamaCppStep, llama_cpp_model

    if LLAMA_MISSING is not None:
        pytest.skip(LLAMA_MISSING)
    gguf = llama_cpp_model(demo_bundle, tmp_path, LLAMA_CPP.resolve(), "f32", progress=False)
    step = LlamaCppStep(gguf, threads=1, context=12, max_tokens=4, vocab_size=64)
    assert step.llm.n_tokens == 12
    times = step.times(4, repeats=3, warmup=1)
    assert len(times) == 3 and step.llm.n_tokens == 12 + 4  # not 12 + 16: each step began at the context
    step.llm.n_tokens = 12
    step.llm.eval([5, 6, 7, 8])
    first = step.llm.scores[12:16].copy()
    step.llm.n_tokens = 12
    step.llm.eval([5, 6, 7, 8])  # the same rows at the same positions over the same cache: the same logits
    assert (step.llm.scores[12:16] == first).all()


def test_a_peer_step_that_cannot_run_is_refused_saying_why_before_anything_is_timed(demo_bundle, tmp_path,
                                                                                   monkeypatch):
    import specrt.bench.peers as peers
    from specrt.bench.fusions import FusionsConfig, run_fusions

    monkeypatch.setattr(peers, "llama_cpp_missing", lambda source: "llama-cpp-python is not installed: `make peers`")
    cfg = FusionsConfig(bundle=demo_bundle, out=tmp_path, label="p", tokens=(1,), projections=("qkv",),
                        peers=("llama-cpp",), threads=1)
    with pytest.raises(SpecrtError, match="llama-cpp-python is not installed"):
        run_fusions(cfg)
    assert not list(tmp_path.glob("fusions-p*"))
    with pytest.raises(InvalidRequestError):
        FusionsConfig(bundle=demo_bundle, peers=("ort-genai",))


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
                        repeats=2, runs=1, threads=1, packing=("packed", "unpacked"), ops=True,
                        logit_rows=("off",))  # (the head's own GatherND where its rows are chosen)
    data = run_fusions(cfg)
    assert [(r["projections"], r["packing"]) for r in data["rows"]] == [("qkv", "packed"), ("qkv", "unpacked")]
    assert [(r["projections"], r["packing"]) for r in data["ops"]] == [("qkv", "packed"), ("qkv", "unpacked")]
    packed, unpacked = (r["ops_ms"] for r in data["ops"])
    assert "GatherND" in packed and "GatherND" not in unpacked  # the packing's gathers, and only there
    md = (tmp_path / "fusions-p.md").read_text()
    assert "| qkv, unpacked, head on every row | " in md
    assert headline("fusions", data).startswith("qkv, unpacked, head on every row ")
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
