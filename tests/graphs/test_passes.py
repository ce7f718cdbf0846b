"""graphs/passes.graph_bytes: the weights a graph reads, wherever their bytes are stored."""

from __future__ import annotations

import numpy as np


def _two_weight_graph(path):
    """input_ids -> Gather(table) -> MatMul(w): both weights in path's external data file."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.ones((10, 64), dtype=np.float32)
    w = np.ones((64, 256), dtype=np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "w"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 256])],
                              [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return table, w


def test_graph_bytes_counts_the_data_file_a_graph_shares_with_another(tmp_path):
    """PPD's copy of the target keeps its embedding table (with the prompt rows) itself and reads the rest from
    target.onnx.data: its weights are both, not its own file alone (the roofline of a bench running PPD read 0.115 GB
    for SmolLM2's 0.54)."""
    from specrt.graphs.passes import add_prompt_embeddings, graph_bytes

    src = tmp_path / "target.onnx"
    table, w = _two_weight_graph(src)
    assert graph_bytes(src) == src.stat().st_size + (tmp_path / "target.onnx.data").stat().st_size
    dest = tmp_path / "target-ppd.onnx"
    add_prompt_embeddings(src, dest, np.zeros((2, 64), dtype=np.float32))
    assert dest.stat().st_size < w.nbytes  # the shared MatMul weight is not in the graph's own file
    assert graph_bytes(dest) == dest.stat().st_size + w.nbytes
    assert graph_bytes(dest) > w.nbytes + 12 * 64 * 4
    # what a step reads: the tables only looked up (Gather), the twin's with its prompt rows as the source's, are not
    assert graph_bytes(src, streamed=True) == src.stat().st_size + w.nbytes
    assert graph_bytes(dest, streamed=True) == dest.stat().st_size - 12 * 64 * 4 + w.nbytes


def test_module_bytes_streamed_leaves_out_an_untied_embedding_only():
    import torch

    from specrt.model.quant import module_bytes

    class LM(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    table = 100 * 8 * 4
    assert module_bytes(LM(False)) == 2 * table and module_bytes(LM(False), streamed=True) == table
    assert module_bytes(LM(True)) == module_bytes(LM(True), streamed=True) == table  # the head reads it whole
