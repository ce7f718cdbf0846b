"""Real-model export paths: the dynamo and TorchScript exporters, bfloat16, ONNX external data."""

import json

import numpy as np
import pytest

from specrt.checkpoints import DEMO_DIR
from specrt.errors import BundleError, SpecrtError


def _export(out, **kw):
    from specrt.export.onnx_export import ExportConfig, export_bundle

    return export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", out=out,
                                      tokenizer=DEMO_DIR / "tokenizer", **kw), progress=False)


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory):
    """bfloat16 weights, K/V and activations; weights as external data (forced: the demo pair is small)."""
    out = tmp_path_factory.mktemp("bf16") / "b"
    _export(out, dtype="bfloat16", external_data="always")
    return out


def test_the_default_export_is_the_dynamo_exporter_and_matches_torchscript(demo_bundle, tmp_path, humaneval):
    from specrt.runtime.pipeline import Pipeline

    m = json.loads((demo_bundle / "manifest.json").read_text())
    assert {r: (e["exporter"], e["opset"], e["external_data"]) for r, e in m["export"].items()} == {
        "target": ("dynamo", 18, False), "draft": ("dynamo", 18, False)}
    ts = _export(tmp_path / "ts", exporter="torchscript")
    assert ts.export["target"]["exporter"] == "torchscript" and "fallback" not in ts.export["target"]
    prompts = humaneval[:4]
    dyn = Pipeline.load(demo_bundle, threads=2).generate(prompts, method="autoregressive", max_new_tokens=24)
    old = Pipeline.load(tmp_path / "ts", threads=2).generate(prompts, method="autoregressive", max_new_tokens=24)
    assert [o.token_ids for o in dyn] == [o.token_ids for o in old]


def test_auto_keeps_the_weights_of_large_models_beside_the_graph_and_they_decode_alike(demo_bundle, tmp_path, monkeypatch,
                                                                                       humaneval):
    """external_data auto: a model over EXTERNAL_DATA_BYTES of weights gets a .data file (loading then skips
    parsing and re-writing its weights), a smaller one stays one file; both decode as the one-file export."""
    from specrt.export import onnx_export
    from specrt.runtime.pipeline import Pipeline

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 8 << 20)  # between the draft's 5 MB and the target's 14 MB
    m = _export(tmp_path / "b", exporter="torchscript")
    assert {r: e["external_data"] for r, e in m.export.items()} == {"target": True, "draft": False}
    assert (tmp_path / "b" / "target.onnx.data").is_file() and not (tmp_path / "b" / "draft.onnx.data").exists()
    prompts = humaneval[:2]
    ours = Pipeline.load(tmp_path / "b", threads=2)
    assert ours.target.packs_rows  # the graph packed without its weights in memory
    got = ours.generate(prompts, method="sd", max_new_tokens=16, batch_size=2)
    want = Pipeline.load(demo_bundle, threads=2).generate(prompts, method="sd", max_new_tokens=16, batch_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_auto_falls_back_to_torchscript_and_says_why(tmp_path, monkeypatch):
    from specrt.export import onnx_export

    def broken(*args, **kwargs):
        raise RuntimeError("data-dependent control flow\nmore lines")

    monkeypatch.setattr(onnx_export, "_export_dynamo", broken)
    m = _export(tmp_path / "a")
    assert m.export["draft"]["exporter"] == "torchscript"
    assert m.export["draft"]["fallback"] == "data-dependent control flow"
    assert m.parity["draft"]["max_logit_err"] < 1e-4
    with pytest.raises(SpecrtError, match="the dynamo exporter cannot export the llama step module: data-dependent "
                                          "control flow \\(try --exporter torchscript\\)"):
        _export(tmp_path / "b", exporter="dynamo")
    assert not (tmp_path / "b").exists()  # the failed export left nothing behind


def test_a_bfloat16_bundle_keeps_weights_beside_the_graphs_and_passes_parity(bf16_bundle):
    import onnx

    m = json.loads((bf16_bundle / "manifest.json").read_text())
    for role in ("target", "draft"):
        graph, data = bf16_bundle / f"{role}.onnx", bf16_bundle / f"{role}.onnx.data"
        assert data.stat().st_size > 20 * graph.stat().st_size  # the weights are in the data file
        assert f"{role}.onnx.data" in m["files"]  # hashed: a changed weight is caught
        model = onnx.load(str(graph), load_external_data=False)
        assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past_")} == {
            onnx.TensorProto.BFLOAT16}
        big = [t for t in model.graph.initializer if 2 * int(np.prod(t.dims)) >= 1024]  # >= 1 KiB of bfloat16
        assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
        # checked as its float32 copy in ONNX Runtime, against the module in float32 on the same weights
        p = m["parity"][role]
        assert p["computed_in"] == "float32" and p["max_logit_err"] < 1e-4 and p["cases"] == 6
    assert m["models"]["target"]["dtype"] == "bfloat16"
    assert (bf16_bundle / "target.onnx.data").stat().st_mode & 0o777 == (bf16_bundle / "target.onnx").stat().st_mode & 0o777
    from specrt.bundle.manifest import VERIFIED

    # no float32 copy or raw export left behind: the one hidden file is the record of the hashes export computed
    assert [p.name for p in bf16_bundle.glob(".*")] == [VERIFIED]


def test_a_bfloat16_bundle_decodes_losslessly_on_torch_and_is_refused_by_onnx_runtime(bf16_bundle, humaneval):
    from specrt.runtime.pipeline import Pipeline

    with pytest.raises(BundleError, match="bfloat16 step graphs, which ONNX Runtime cannot run on the CPU"):
        Pipeline.load(bf16_bundle, threads=2)
    pipe = Pipeline.load(bf16_bundle, backend="torch", device="cpu", threads=2)
    prompts = humaneval[:3]
    ar = [o.token_ids for o in pipe.generate(prompts, method="autoregressive", max_new_tokens=16)]
    assert [o.token_ids for o in pipe.generate(prompts, method="sd", max_new_tokens=16)] == ar


def test_a_corrupted_data_file_is_caught_by_the_manifest(bf16_bundle, tmp_path):
    import shutil

    from specrt.bundle.manifest import load_manifest

    b = tmp_path / "b"
    shutil.copytree(bf16_bundle, b)
    with open(b / "draft.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x7f")
    with pytest.raises(BundleError, match="draft.onnx.data"):
        load_manifest(b, verify=True)


@pytest.mark.slow
def test_a_1b_class_target_exports_in_bfloat16_with_external_data(tmp_path):
    """On the CPU: a 1B-class inflated target (hidden 2048, 22 layers) in bfloat16, its 2.1 GB
    of weights as external data, parity in ONNX Runtime. About 5 minutes and 11 GB of memory on 2 cores here."""
    from specrt.checkpoints.inflate import InflateConfig, inflate

    inflate(InflateConfig(preset="1b", out=tmp_path / "t1b", device="cpu"))
    from specrt.export.onnx_export import ExportConfig, export_bundle

    m = export_bundle(ExportConfig(target=tmp_path / "t1b", draft=DEMO_DIR / "draft", tokenizer=DEMO_DIR / "tokenizer",
                                   out=tmp_path / "b", dtype="bfloat16"), progress=False)
    assert m.export["target"]["external_data"] and (tmp_path / "b" / "target.onnx.data").stat().st_size > 2e9
    assert m.parity["target"]["max_logit_err"] < 1e-4
