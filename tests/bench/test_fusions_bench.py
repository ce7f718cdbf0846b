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
