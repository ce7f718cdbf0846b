"""Packed token rows (graphs/packed_rows.py): a ragged step's holes left out of the token-wise ops, every
other row computed as the step graph computes it."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt import contract
from specrt.bundle.manifest import load_manifest
from specrt.runtime.backends.ort import OrtBackend
from specrt.graphs.packed_rows import PREFIX, pack_rows
from specrt.runtime.kv_cache import KVCache
from specrt.runtime.step_inputs import pack_step


def _packed(model):
    """A packed copy of `model` (pack_rows rewrites in place)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    assert pack_rows(copy)
    return copy


def _session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _ragged_feed(session, counts: list[int], past: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A step of len(counts) sequences, sequence b with counts[b] new tokens after `past` cached ones; holes as
    pack_step makes them. Returns (feed, real [B, T] bool)."""
    rng = np.random.default_rng(seed)
    batch, width = len(counts), max(counts)
    cache = KVCache(np.zeros, 1, batch, 1, 1, 4096, bucket=past)
    cache.reserve(past)
    cache.lengths[:] = past
    rows = [rng.integers(1, 200, n) for n in counts]
    ids, pos, mask = pack_step(cache, rows, [past + np.arange(n) for n in counts])
    kv = next(i for i in session.get_inputs() if i.name == contract.past_key(0))
    feed = {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos, contract.ATTENTION_MASK: mask}
    for i in session.get_inputs():
        if i.name.startswith("past_"):
            feed[i.name] = rng.standard_normal((batch, kv.shape[1], past, kv.shape[3])).astype(np.float32)
    return feed, np.arange(width)[None, :] < np.asarray(counts)[:, None]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_packed_graph_computes_every_real_row_as_the_step_graph_does(demo_bundle, role):
    model = onnx.load(str(demo_bundle / load_manifest(demo_bundle).models[role].onnx))
    packed = _packed(model)
    onnx.checker.check_model(packed)
    plain, fast = _session(model), _session(packed)
    for counts in ([5, 2, 0, 3], [1, 4], [3, 3, 3], [1]):
        feed, real = _ragged_feed(plain, counts, past=7)
        names = [o.name for o in plain.get_outputs()]
        want, got = plain.run(None, feed), fast.run(None, feed)
        for name, w, g in zip(names, want, got):
            if name == contract.LOGITS:  # [B, T, V]
                np.testing.assert_allclose(g[real], w[real], rtol=1e-5, atol=1e-5)
                assert (g[~real] == g[real][:1]).all()  # a hole's logits: the first real row's (never computed)
            else:  # new K/V [B, Hkv, T, D]
                np.testing.assert_allclose(np.moveaxis(g, 2, 1)[real], np.moveaxis(w, 2, 1)[real], rtol=1e-5, atol=1e-5)


def test_packed_graph_runs_the_weight_matmuls_on_the_real_rows_only(demo_bundle):
    entry = load_manifest(demo_bundle).models["target"]
    packed = _packed(onnx.load(str(demo_bundle / entry.onnx)))
    weights = {t.name for t in packed.graph.initializer if len(t.dims) == 2 and min(t.dims) > 1}
    products = [n for n in packed.graph.node if n.op_type == "MatMul" and n.input[1] in weights
                and n.input[1] != "rotate_half"]
    assert len(products) == 7 * entry.num_layers + 1  # q, k, v, o, gate, up, down per layer; the LM head
    assert all(n.input[0].endswith("/packed") for n in products)
    assert not pack_rows(packed)  # packed once


def _toy_graph():
    """ids [B, T] -> embedding [B, T, 4] -> norm-ish Mul -> W [4, 6] -> Reshape to [B, T, 2, 3] -> TopK (an op the
    pass does not know) -> outputs; plus a second output straight from the projection."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "embed"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([0, 0, 2, 3], np.int64), "heads"),
             numpy_helper.from_array(np.array([2], np.int64), "k")]
    nodes = [helper.make_node("Gather", ["embed", contract.INPUT_IDS], ["x"]),
             helper.make_node("Mul", ["x", "scale"], ["normed"]),
             helper.make_node("MatMul", ["normed", "w"], ["proj"]),
             helper.make_node("Reshape", ["proj", "heads"], ["split"]),
             helper.make_node("TopK", ["split", "k"], ["top", "top_index"]),
             helper.make_node("Identity", ["proj"], [contract.LOGITS])]
    bt = ["batch", "num_tokens"]
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, bt)
              for name in (contract.INPUT_IDS, contract.POSITION_IDS)]
    graph = helper.make_graph(nodes, "toy", inputs,
                              [helper.make_tensor_value_info("top", TensorProto.FLOAT, bt + [2, 2]),
                               helper.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, bt + [6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_op_the_pass_does_not_know_gets_its_rows_back_in_place():
    model = _toy_graph()
    packed = _packed(model)
    assert any(n.name.startswith(PREFIX) for n in packed.graph.node)
    ids = np.array([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    pos = np.array([[0, 1, 2], [0, -1, -1], [3, 4, -1]])
    real = pos != contract.HOLE_POSITION
    want = _session(model).run(None, {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos})
    got = _session(packed).run(None, {contract.INPUT_IDS: ids, contract.POSITION_IDS: pos})
    for w, g in zip(want, got):
        assert g.shape == w.shape
        np.testing.assert_allclose(g[real], w[real], rtol=1e-6)
        assert (g[~real] == g[real][:1]).all() and not np.allclose(g[~real], w[~real])  # the first real row's
    no_holes = np.array([[0, 1, 2], [5, 6, 7], [1, 2, 3]])  # every row kept: the same outputs everywhere
    for w, g in zip(_session(model).run(None, {contract.INPUT_IDS: ids, contract.POSITION_IDS: no_holes}),
                    _session(packed).run(None, {contract.INPUT_IDS: ids, contract.POSITION_IDS: no_holes})):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_graph_with_static_rows_is_left_as_it_is():
    model = _toy_graph()
    for i in model.graph.input:  # B and T fixed: [B, T, ...] tensors cannot be told apart by their shapes
        for d, v in zip(i.type.tensor_type.shape.dim, (3, 3)):
            d.dim_value = v
    assert not pack_rows(model)


def test_holes_sit_at_the_hole_position_unless_the_batch_computes_them():
    cache = KVCache(np.zeros, 1, 2, 1, 1, 64)
    rows, positions = [np.array([5, 6, 7]), np.array([8])], [np.arange(3), np.arange(1)]
    _, pos, _ = pack_step(cache, rows, positions)
    assert pos.tolist() == [[0, 1, 2], [0, contract.HOLE_POSITION, contract.HOLE_POSITION]]
    cache.compute_holes = True  # a padded batch (benchmarking only): its holes are computed as real rows
    _, pos, _ = pack_step(cache, rows, positions)
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("external", [False, True])
def test_ort_backend_packs_the_rows_of_the_graphs_it_loads(demo_bundle, tmp_path, external):
    """Also of a graph whose weights are external data (graphs over 2 GiB): the packed graph is handed to ONNX
    Runtime in memory, which reads the weights from beside the file."""
    entry = load_manifest(demo_bundle).models["target"]
    path = demo_bundle / entry.onnx
    if external:
        path = tmp_path / "target.onnx"
        onnx.save_model(onnx.load(str(demo_bundle / entry.onnx)), str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="target.onnx.data", size_threshold=1024)
    backend = OrtBackend(entry, path, threads=1)
    assert backend.packs_rows
    runner = backend.runner()
    cache = runner.new_cache(2)
    rows = [np.array([3, 4, 5, 6]), np.array([7])]
    ids, pos, mask = pack_step(cache, rows, [np.arange(4), np.arange(1)])
    logits, _ = runner.step(ids, pos, mask, cache)
    assert (logits[1, 1:] == logits[0, 0]).all() and not (logits[1, 0] == logits[0, 0]).all()  # holes: not computed
    alone = backend.runner()
    one = alone.new_cache(1)
    solo, _ = alone.step(*pack_step(one, rows[1:], [np.arange(1)]), one)
    np.testing.assert_allclose(logits[1, 0], solo[0, 0], rtol=1e-5, atol=1e-5)  # the real row as it runs alone


def test_a_pipeline_loaded_without_packed_rows_decodes_the_same_tokens_at_its_own_machine(demo_bundle):
    """packed_rows=False (--no-packed-rows) loads the step graph as it is: a ragged batch then computes its holes,
    and every method decodes what the packed pipeline decodes, alone and batched; its latency profile and plan are
    its own (Machine.packed_rows)."""
    from specrt.bundle.machine import Machine
    from specrt.errors import InvalidRequestError
    from specrt.runtime.pipeline import Pipeline

    packed = Pipeline.load(demo_bundle, threads=1)
    plain = Pipeline.load(demo_bundle, threads=1, packed_rows=False)
    assert packed.target.packs_rows and not plain.target.packs_rows and not plain.draft.packs_rows
    prompts = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
    for method, batch in (("autoregressive", 1), ("sd", 3), ("anpd", 3)):
        want = [g.token_ids for g in packed.generate(prompts, method=method, max_new_tokens=24, batch_size=batch)]
        got = [g.token_ids for g in plain.generate(prompts, method=method, max_new_tokens=24, batch_size=batch)]
        assert got == want, method
    assert plain.machine == Machine.here("ort", 1, packed_rows=False) != packed.machine
    assert plain.machine.flags().endswith("--no-packed-rows") and "token rows not packed" in plain.machine.describe()
    with pytest.raises(InvalidRequestError, match="backend 'torch' does not pack them"):
        Pipeline.load(demo_bundle, backend="torch", device="cpu", packed_rows=False)
    with pytest.raises(InvalidRequestError, match="packed_rows must be True or False, got 'no'"):
        Pipeline.load(demo_bundle, packed_rows="no")
