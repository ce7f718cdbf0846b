"""Logits for the rows a step's caller reads (graphs/logit_rows.py): the head over those rows only, each row's logits
as the step graph computes them, packed or not."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt import contract
from specrt.bundle.manifest import load_manifest
from specrt.graphs.logit_rows import HEAD_ROWS, LOGIT_ROWS, bound_rows, select_logit_rows
from specrt.graphs.packed_rows import pack_rows
from specrt.runtime.backends.ort import OrtBackend
from tests.graphs.test_packed_rows import _ragged_feed, _session


def _rewritten(model, packed: bool):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    if packed:
        assert pack_rows(copy)
    assert select_logit_rows(copy) == ("packed" if packed else "rows")
    onnx.checker.check_model(copy)
    return copy


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_head_runs_on_the_rows_asked_and_each_gets_the_step_graphs_logits(demo_bundle, packed):
    model = onnx.load(str(demo_bundle / load_manifest(demo_bundle).models["target"].onnx))
    plain, chosen = _session(model), _session(_rewritten(model, packed))
    names = [o.name for o in plain.get_outputs()]
    for counts in ([5, 2, 3], [1, 4], [3], [0, 2]):
        feed, real = _ragged_feed(plain, counts, past=7)
        want = dict(zip(names, plain.run(None, feed)))
        pos = feed[contract.POSITION_IDS]
        last = np.maximum(np.asarray(counts) - 1, 0)[:, None]
        for rows in (None, last, np.zeros((len(counts), 0), np.int64)):
            got = dict(zip(names, chosen.run(None, {**feed, **bound_rows(pos, rows, "packed" if packed else "rows")})))
            expected = want[contract.LOGITS] if rows is None else np.take_along_axis(
                want[contract.LOGITS], rows[..., None], axis=1)
            shown = real if rows is None else np.take_along_axis(real, rows, axis=1)  # a hole's logits: garbage
            assert got[contract.LOGITS].shape == expected.shape
            np.testing.assert_array_equal(got[contract.LOGITS][shown], expected[shown])
            for name in names[1:]:  # the new K/V [B, heads, T, D] as before
                np.testing.assert_array_equal(got[name].swapaxes(1, 2)[real], want[name].swapaxes(1, 2)[real])


def test_a_packed_step_runs_the_head_once_per_real_row_its_holes_none():
    pos = np.array([[4, 5, 6], [9, contract.HOLE_POSITION, contract.HOLE_POSITION]])
    every = bound_rows(pos, None, "packed")
    np.testing.assert_array_equal(every[HEAD_ROWS], [0, 1, 2, 3])
    np.testing.assert_array_equal(every[LOGIT_ROWS], [[0, 1, 2], [3, 0, 0]])
    last = bound_rows(pos, np.array([[2], [0]]), "packed")  # rows 2 and 3 of the packed four, nothing else
    np.testing.assert_array_equal(last[HEAD_ROWS], [2, 3])
    np.testing.assert_array_equal(last[LOGIT_ROWS], [[0], [1]])
    assert bound_rows(pos, np.array([[1], [0]]), "rows")[LOGIT_ROWS].tolist() == [[[1]], [[0]]]


def _tiny_head(tail: list[str]):
    """A graph: ids -> embedding -> weight MatMul -> `tail` ops (with a constant) -> logits."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["emb", contract.INPUT_IDS], ["h"]),
             helper.make_node("MatMul", ["h", "w"], ["t0"])]
    for k, op in enumerate(tail):
        nodes.append(helper.make_node(op, [f"t{k}"] + (["c"] if op in ("Mul", "Div") else []), [f"t{k + 1}"]))
    nodes[-1].output[0] = contract.LOGITS
    inits = [numpy_helper.from_array(rng.standard_normal((50, 8)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((8, 50)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(3.0, np.float32), "c")]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, ["batch", "tokens", 50])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_soft_capped_head_is_selected_and_a_tail_it_does_not_know_is_left_alone():
    model = _tiny_head(["Div", "Tanh", "Mul"])  # Gemma 2's final soft cap
    ids = np.array([[3, 7, 9], [1, 2, 4]])
    want = _session(model).run(None, {contract.INPUT_IDS: ids})[0]
    rows = np.array([[2], [0]])
    got = _session(_rewritten(model, packed=False)).run(None, {contract.INPUT_IDS: ids,
                                                               **bound_rows(np.zeros_like(ids), rows, "rows")})[0]
    np.testing.assert_array_equal(got, np.take_along_axis(want, rows[..., None], axis=1))
    for tail in (["Softmax"], ["Tanh", "Transpose"]):
        assert select_logit_rows(_tiny_head(tail)) is None


def test_the_ort_backend_prefills_without_a_head_and_picks_rows_as_its_full_step_does(demo_bundle):
    from specrt.runtime.step_inputs import pack_step

    entry = load_manifest(demo_bundle).models["target"]
    path = demo_bundle / entry.onnx
    fast, full = (OrtBackend(entry, path, 1, select_rows=s) for s in (True, False))
    assert fast.selects_rows and not full.selects_rows
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, entry.vocab_size, n) for n in (6, 3)]
    out = {}
    for name, backend in (("fast", fast), ("full", full)):
        runner = backend.runner()
        cache = runner.new_cache(2)
        cache.reserve(6)
        ids, pos, mask = pack_step(cache, rows, [np.arange(len(r)) for r in rows])
        out[name] = runner.step(ids, pos, mask, cache, "logits", [5, 2])[0].copy()
        again = runner.new_cache(2)
        again.reserve(6)
        assert runner.step(ids, pos, mask, again, "discard")[0] is None
    assert out["fast"].shape == (2, entry.vocab_size)
    np.testing.assert_array_equal(out["fast"], out["full"])
