"""Load-time fusions into ONNX Runtime's norm kernels (runtime/backends/ort_fusions.py): the fused step graph
computes what the exported one does, with its RMSNorms as SimplifiedLayerNormalization and the residual adds before
them as SkipSimplifiedLayerNormalization."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specrt import contract
from specrt.bundle.manifest import load_manifest
from specrt.runtime.backends.ort_fusions import fuse_rms_norms, fuse_skip_norms
from specrt.runtime.backends.packed_rows import pack_rows


def _session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feed(session, batch: int = 2, past: int = 9, num_tokens: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    kv = next(i for i in session.get_inputs() if i.name == contract.past_key(0))
    mask = np.tril(np.ones((num_tokens, past + num_tokens), bool), past)
    feed = {contract.INPUT_IDS: rng.integers(1, 200, (batch, num_tokens)),
            contract.POSITION_IDS: past + np.arange(num_tokens)[None].repeat(batch, 0),
            contract.ATTENTION_MASK: mask[None].repeat(batch, 0)}
    for i in session.get_inputs():
        if i.name.startswith("past_"):
            feed[i.name] = rng.standard_normal((batch, kv.shape[1], past, kv.shape[3])).astype(np.float32)
    return feed


def _fused(model, packed: bool):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if packed:
        assert pack_rows(copy)
    norms = fuse_rms_norms(copy)
    return copy, norms, fuse_skip_norms(copy)


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_fused_graph_computes_what_the_step_graph_does(demo_bundle, role, packed):
    entry = load_manifest(demo_bundle).models[role]
    model = onnx.load(str(demo_bundle / entry.onnx))
    fused, norms, skips = _fused(model, packed)
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    # two norms per layer and the final one; every one but the first after a residual add
    assert (norms, skips) == (2 * entry.num_layers + 1, 2 * entry.num_layers)
    assert (ops["SimplifiedLayerNormalization"], ops["SkipSimplifiedLayerNormalization"]) == (1, 2 * entry.num_layers)
    assert ops["Reciprocal"] == ops["Pow"] == 0
    plain, fast = _session(model), _session(fused)
    feed = _feed(plain)
    for name, want, got in zip([o.name for o in plain.get_outputs()], plain.run(None, feed), fast.run(None, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_norm_whose_steps_are_read_elsewhere_is_left_whole(demo_bundle):
    """A graph output taken from inside a norm (its mean of squares) keeps that norm unfused, and correct."""
    model = onnx.load(str(demo_bundle / load_manifest(demo_bundle).models["draft"].onnx))
    mean = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(mean.output[0]))
    before = sum(n.op_type == "Reciprocal" for n in model.graph.node)
    assert fuse_rms_norms(model) == before - 1
    assert sum(n.op_type == "Reciprocal" for n in model.graph.node) == 1
    assert any(n.output[0] == mean.output[0] for n in model.graph.node)
    _session(model)  # still a graph ONNX Runtime loads


def test_float16_norms_are_left_to_the_graph(tmp_path):
    """A float16 step graph casts to float32 for the statistics and back before the weight: not the kernel's
    rounding, so nothing is fused."""
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle

    manifest = export_bundle(ExportConfig(target=DEMO_DIR / "draft", draft=DEMO_DIR / "draft", out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer", dtype="float16"), progress=False)
    model = onnx.load(str(tmp_path / "b" / manifest.models["target"].onnx))
    assert fuse_rms_norms(model) == 0
