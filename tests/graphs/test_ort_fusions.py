"""Load-time fusions (graphs/ort_fusions.py): the fused step graph computes what the exported one does,
with its RMSNorms as SimplifiedLayerNormalization, the residual adds before them as SkipSimplifiedLayerNormalization,
and the projections that read one input merged into one MatMul."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specrt import contract
from specrt.bundle.manifest import load_manifest
from specrt.graphs.parity import PARITY_TOL
from specrt.graphs.ort_fusions import fuse_projections, fuse_rms_norms, fuse_skip_norms
from specrt.graphs.packed_rows import pack_rows


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


def _fused(model, packed: bool, weights_dir):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if packed:
        assert pack_rows(copy)
    norms = fuse_rms_norms(copy)
    skips = fuse_skip_norms(copy)
    merged, arrays = fuse_projections(copy, weights_dir, inline=True)
    assert arrays == {}
    return copy, norms, skips, merged


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_fused_graph_computes_what_the_step_graph_does(demo_bundle, role, packed):
    entry = load_manifest(demo_bundle).models[role]
    model = onnx.load(str(demo_bundle / entry.onnx))
    fused, norms, skips, merged = _fused(model, packed, demo_bundle)
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    # two norms per layer and the final one; every one but the first after a residual add
    assert (norms, skips) == (2 * entry.num_layers + 1, 2 * entry.num_layers)
    assert (ops["SimplifiedLayerNormalization"], ops["SkipSimplifiedLayerNormalization"]) == (1, 2 * entry.num_layers)
    assert ops["Reciprocal"] == ops["Pow"] == 0
    assert merged == 2 * entry.num_layers  # q, k, v into one; a float MLP's gate and up stay apart
    assert ops["Split"] == entry.num_layers
    plain, fast = _session(model), _session(fused)
    feed = _feed(plain)
    for name, want, got in zip([o.name for o in plain.get_outputs()], plain.run(None, feed), fast.run(None, feed)):
        # the merged MatMuls sum in another order: float32 rounding, within export's parity tolerance
        np.testing.assert_allclose(got, want, rtol=0, atol=PARITY_TOL["float32"], err_msg=name)


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


def test_merged_weights_of_an_external_data_graph_are_given_to_the_session(tmp_path, demo_bundle):
    """Weights in a .data file: the merged ones are handed to the session in memory (the graph is not reserialized
    with them), and the loaded pipeline decodes as the inline-weights bundle does."""
    from specrt.checkpoints import DEMO_DIR
    from specrt.export.onnx_export import ExportConfig, export_bundle
    from specrt.runtime.pipeline import Pipeline

    manifest = export_bundle(ExportConfig(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", out=tmp_path / "b",
                                          tokenizer=DEMO_DIR / "tokenizer", external_data="always"), progress=False)
    entry = manifest.models["target"]
    model = onnx.load(str(tmp_path / "b" / entry.onnx), load_external_data=False)
    merged, arrays = fuse_projections(model, tmp_path / "b", inline=False)
    assert merged == 2 * entry.num_layers and len(arrays) == entry.num_layers
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if t.name in arrays)
    external = Pipeline.load(tmp_path / "b", threads=1)
    assert external.target.merged_matmuls == 2 * entry.num_layers
    inline = Pipeline.load(demo_bundle, threads=1)
    prompts = [[5, 9, 200, 31, 7] * 4, [11, 12, 13]]
    want = [o.token_ids for o in inline.generate(prompts, method="autoregressive", max_new_tokens=16)]
    assert [o.token_ids for o in external.generate(prompts, method="autoregressive", max_new_tokens=16)] == want


@pytest.mark.parametrize("with_bias", [False, True])
def test_projections_merge_with_their_biases_and_a_pair_stays_apart(with_bias):
    """Three MatMuls reading one input merge into one, their biases (added right after, as Qwen2's q, k and v) into
    one Add before the Split; a pair reading another input (an MLP's gate and up) stays two MatMuls."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    widths, inits, nodes, outs = (8, 4, 4), [], [], []
    for i, n in enumerate(widths + (6, 6)):
        x, w = ("x" if i < 3 else "h"), f"w{i}"
        inits.append(numpy_helper.from_array(rng.standard_normal((5, n)).astype(np.float32), w))
        nodes.append(helper.make_node("MatMul", [x, w], [f"m{i}"]))
        out = f"m{i}"
        if with_bias and i < 3:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [f"b{i}", out] if i == 1 else [out, f"b{i}"], [f"y{i}"]))
            out = f"y{i}"
        outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [None, 5]) for x in ("x", "h")]
    model = helper.make_model(helper.make_graph(nodes, "projections", inputs, outs, inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    assert fuse_projections(merged, None, inline=True) == (2, {})
    ops = collections.Counter(n.op_type for n in merged.graph.node)
    assert (ops["MatMul"], ops["Split"], ops["Add"]) == (3, 1, int(with_bias))
    feed = {"x": rng.standard_normal((7, 5)).astype(np.float32), "h": rng.standard_normal((7, 5)).astype(np.float32)}
    for want, got in zip(_session(model).run(None, feed), _session(merged).run(None, feed)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
