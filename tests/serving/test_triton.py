"""`specrt triton`: the model repository's layout and every config.pbtxt parsed by tritonclient's model_config protobuf
(the step-graph and TensorRT models load on a full Triton only; the decode-loop model is served by a real tritonserver
in test_serve.py)."""

import json
import shutil
import sys

import pytest

from specrt.errors import SpecrtError

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason="tritonclient[grpc] (a dev dependency) parses the configs")


def _parse(path):
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def repo(demo_bundle, tmp_path_factory):
    from specrt.serving.triton import TritonConfig, write_repository

    out = tmp_path_factory.mktemp("triton") / "repo"
    write_repository(TritonConfig(bundle=demo_bundle, out=out, method="dynamic", instances=2, threads=2))
    return out


def test_the_repository_has_a_model_per_step_graph_and_the_decode_loop(repo, demo_bundle):
    assert sorted(p.name for p in repo.iterdir()) == ["specrt", "specrt-triton.json", "specrt_draft", "specrt_target"]
    m = json.loads((demo_bundle / "manifest.json").read_text())
    for role in ("target", "draft"):
        c = _parse(repo / f"specrt_{role}" / "config.pbtxt")
        e = m["models"][role]
        assert (c.name, c.platform, c.max_batch_size) == (f"specrt_{role}", "onnxruntime_onnx", 0)
        assert [i.name for i in c.input][:4] == ["input_ids", "position_ids", "attention_mask", "past_key.0"]
        assert len(c.input) == 3 + 2 * e["num_layers"] and len(c.output) == 1 + 2 * e["num_layers"]
        past = c.input[3]
        assert past.data_type == model_config_pb2.TYPE_FP32 and list(past.dims) == [-1, e["num_kv_heads"], -1,
                                                                                    e["head_dim"]]
        assert c.input[2].data_type == model_config_pb2.TYPE_BOOL
        assert list(c.output[0].dims) == [-1, -1, e["vocab_size"]] and c.output[0].data_type == model_config_pb2.TYPE_FP32
        assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
        assert (repo / f"specrt_{role}" / "1" / "model.onnx").read_bytes() == (demo_bundle / f"{role}.onnx").read_bytes()
    c = _parse(repo / "specrt" / "config.pbtxt")
    assert (c.backend, c.model_transaction_policy.decoupled) == ("python", True)
    assert [(i.name, i.optional) for i in c.input] == [("PROMPT", False), ("MAX_NEW_TOKENS", True), ("METHOD", True),
                                                       ("TEMPERATURE", True), ("TOP_K", True), ("TOP_P", True),
                                                       ("SEED", True), ("STREAM", True)]
    assert c.input[0].data_type == model_config_pb2.TYPE_STRING and c.input[-1].data_type == model_config_pb2.TYPE_BOOL
    assert [o.name for o in c.output] == ["TEXT", "TOKEN_IDS", "FINISH_REASON", "PROMPT_TOKENS", "TARGET_STEPS"]
    assert c.instance_group[0].count == 2
    params = {k: v.string_value for k, v in c.parameters.items()}
    # two instances share --threads 2: one thread each
    assert params == {"bundle": str(demo_bundle.resolve()), "backend": "ort", "threads": "1", "kv_update": "runtime",
                      "packed_rows": "true", "verify": "recorded", "method": "dynamic", "max_batch": "8",
                      "stream_interval_ms": "20"}
    assert (repo / "specrt" / "1" / "model.py").is_file()


def test_tensorrt_engines_become_tensorrt_plan_models_with_a_profile_list_per_slot(demo_bundle, tmp_path, monkeypatch):
    from specrt.engines.config import BuildConfig
    from specrt.engines.trt import build_plans
    from specrt.serving.triton import TritonConfig, write_repository
    from tests import fake_tensorrt

    b = tmp_path / "b"
    shutil.copytree(demo_bundle, b)
    fake_tensorrt.reset()
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    engines = build_plans(fake_tensorrt, BuildConfig(bundle=b, backend="trt", slots=2, token_profiles=(1, 8, 32),
                                                     batch_buckets=(1, 2), capacity=128), "cpu", progress=False)
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # the repository is written where TensorRT need not be
    info = write_repository(TritonConfig(bundle=b, out=tmp_path / "repo", backend="trt", device="cuda:0"))
    assert info["models"] == ["specrt_target", "specrt_draft", "specrt_target_trt", "specrt_draft_trt", "specrt"]
    c = _parse(tmp_path / "repo" / "specrt_target_trt" / "config.pbtxt")
    assert (c.platform, c.default_model_filename) == ("tensorrt_plan", "model.plan")
    assert [(g.name, list(g.profile), g.kind) for g in c.instance_group] == [
        ("slot0", ["0", "1", "2"], model_config_pb2.ModelInstanceGroup.KIND_GPU),
        ("slot1", ["3", "4", "5"], model_config_pb2.ModelInstanceGroup.KIND_GPU)]
    plan = tmp_path / "repo" / "specrt_target_trt" / "1" / "model.plan"
    assert plan.read_bytes() == (b / engines.plans["target"]).read_bytes()
    d = _parse(tmp_path / "repo" / "specrt" / "config.pbtxt")
    assert d.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_MODEL


def test_external_data_and_bfloat16_reach_the_repository(tmp_path):
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.serving.triton import TritonConfig, write_repository

    export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", tokenizer=DEMO_DIR / "tokenizer",
                               out=tmp_path / "b", dtype="bfloat16", external_data="always", exporter="torchscript"),
                  progress=False)
    write_repository(TritonConfig(bundle=tmp_path / "b", out=tmp_path / "repo", backend="torch", step_kind="gpu"))
    c = _parse(tmp_path / "repo" / "specrt_draft" / "config.pbtxt")
    assert c.input[3].data_type == model_config_pb2.TYPE_BF16
    assert c.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (tmp_path / "repo" / "specrt_draft" / "1" / "draft.onnx.data").is_file()  # the name the graph refers to


def test_a_directory_specrt_did_not_write_is_never_replaced(demo_bundle, repo, tmp_path):
    from specrt.serving.triton import TritonConfig, write_repository

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(SpecrtError, match="is not a model repository specrt wrote: refusing to replace it"):
        write_repository(TritonConfig(bundle=demo_bundle, out=mine))
    assert (mine / "notes.txt").read_text() == "keep"
    again = tmp_path / "again"
    shutil.copytree(repo, again)
    write_repository(TritonConfig(bundle=demo_bundle, out=again, method="sd"))  # a repository it wrote: replaced
    assert _parse(again / "specrt" / "config.pbtxt").parameters["method"].string_value == "sd"
    with pytest.raises(SpecrtError, match="unknown method 'fast'"):
        write_repository(TritonConfig(bundle=demo_bundle, out=again, method="fast"))


def test_every_load_option_reaches_the_decode_loop_model_and_a_bad_one_is_refused_before_writing(inplace_bundle,
                                                                                                   tmp_path):
    """quant, kv_update, packed_rows and verify are Pipeline.load's options as much as backend and threads: the
    decode-loop model's parameters carry them, read back into the keyword arguments the same options give in process;
    an ort option the bundle cannot run is refused as the repository is written, not in the server's log."""
    from specrt.serving.triton import TritonConfig, pipeline_options, write_repository

    cfg = TritonConfig(bundle=inplace_bundle, out=tmp_path / "repo", threads=2, kv_update="inplace", packed_rows=False,
                       verify="full")
    write_repository(cfg)
    c = _parse(tmp_path / "repo" / "specrt" / "config.pbtxt")
    params = {k: v.string_value for k, v in c.parameters.items()}
    assert (params["kv_update"], params["packed_rows"], params["verify"]) == ("inplace", "false", "full")
    assert pipeline_options(params) == cfg.pipeline_options() == {
        "backend": "ort", "threads": 2, "device": None, "quant": None, "kv_update": "inplace", "packed_rows": False,
        "verify": "full"}
    with pytest.raises(SpecrtError, match="no quant.json in .*: run `specrt quantize"):
        write_repository(TritonConfig(bundle=inplace_bundle, out=tmp_path / "other", quant="int8-weights"))
    assert not (tmp_path / "other").exists()
