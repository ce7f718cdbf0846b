"""Logits for the rows a step's caller reads (ONNX Runtime): the LM head only over them.

The step contract's logits are [B, T, V]. A prefill reads none of them, and a draft step fed several rows (a round's
accepted tokens) reads each sequence's last. The LM head is about a fifth of a row's arithmetic on SmolLM2-135M (its
49152 x 576 projection): on 2 cores a 256-token prefill chunk took 366 ms with the head on every row, 297 without
(`specrt bench fusions --logit-rows on,off --head discard`, fusions-smollm2-135m-prefill-logit-rows).
`select_logit_rows` rewrites a step graph, as OrtBackend loads it, so that the head runs on the rows
its caller names: the logits are then [B, R, V], R rows of each sequence (every row, in order, for a verification).

ONNX Runtime runs every node of a graph (a selection beside the original head would cost both) and an If adds a
subgraph call to every step, so the chosen rows are inputs the host computes (bound_rows), and the graph gains one
node:
- unpacked, `logit_rows` [B, R, 1] gathers each sequence's rows from [B, T, hidden] before the head;
- packed (packed_rows.py: the head runs on the step's N real rows), `head_rows` [M] gathers the packed rows the head
  runs on, and `logit_rows` [B, R] takes the place of the packing's unpack map, from M rows to [B, R]. Every row of a
  ragged step thus still costs the head once, its holes none.

The head is the chain of nodes from the last weight MatMul to the `logits` output: each elementwise on one step
tensor with constant operands (a soft cap, a scale, a cast), or the packing's unpack Gather. A graph whose tail is
anything else, or whose chain feeds other nodes too, is left as it is (None).
"""

from __future__ import annotations

import numpy as np

from specrt import contract
from specrt.graphs import packed_rows

LOGIT_ROWS = "logit_rows"
HEAD_ROWS = "head_rows"  # a packed graph's: the packed rows the head runs on
PREFIX = "logit_rows/"
TAIL_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Tanh", "Cast", "Identity"})


def _head_chain(graph) -> tuple[list, bool] | None:
    """The head's nodes, the weight MatMul first, and whether its input is packed; None where the tail differs."""
    static = {t.name for t in graph.initializer}
    for node in graph.node:  # constants and what is computed from them alone
        if all(i == "" or i in static for i in node.input):
            static.update(node.output)
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    chain, name, packed = [], contract.LOGITS, False
    source = packed_rows.PREFIX + "source"  # the packing's [B, T] map of each row's packed row
    while (node := producer.get(name)) is not None:
        unpack = node.op_type == "Gather" and node.input[1:] == [source]
        dynamic = node.input[:1] if unpack else [i for i in node.input if i and i not in static]
        if len(dynamic) != 1 or len(node.output) != 1 or (chain and readers.get(node.output[0]) != 1):
            return None
        chain.append(node)
        if node.op_type == "MatMul" and node.input[0] == dynamic[0]:
            return chain[::-1], packed
        if not unpack and node.op_type not in TAIL_OPS:
            return None
        packed |= unpack
        name = dynamic[0]
    return None


def select_logit_rows(model) -> str | None:
    """Rewrite step graph `model` (an onnx ModelProto; external data need not be loaded) in place to take the rows
    whose logits it computes (module docstring); returns which inputs it takes (bound_rows' `form`): "packed" where
    the head's input is packed, else "rows"; None (left as it is) where it has no head this pass knows, or takes
    them already."""
    from onnx import TensorProto, helper

    graph = model.graph
    names = {i.name for i in graph.input}
    if LOGIT_ROWS in names or contract.INPUT_IDS not in names:
        return None
    found = _head_chain(graph)
    if found is None:
        return None
    chain, packed = found
    p, x = PREFIX, chain[0].input[0]
    if packed:  # x: the step's real rows [N, hidden]; logit_rows [B, R]: each logit row's row of head_rows
        nodes = [helper.make_node("Gather", [x, HEAD_ROWS], [p + "hidden"], axis=0)]  # [M, hidden]
        inputs = [(HEAD_ROWS, ["head_rows"]), (LOGIT_ROWS, ["batch", "logit_rows"])]
    else:  # x: [B, T, hidden]; logit_rows [B, R, 1]: each sequence's rows
        nodes = [helper.make_node("GatherND", [x, LOGIT_ROWS], [p + "hidden"], batch_dims=1)]  # [B, R, hidden]
        inputs = [(LOGIT_ROWS, ["batch", "logit_rows", 1])]
    renamed = {x: p + "hidden"}  # each chain tensor -> its counterpart over the chosen rows
    for k, node in enumerate(chain, start=1):
        made = helper.make_node(node.op_type, [renamed.get(i, i) for i in node.input], [p + f"head/{k}"],
                                domain=node.domain)
        made.attribute.extend(node.attribute)
        if node.op_type == "Gather":  # the packing's unpack (_head_chain): to [B, R, ...] by logit_rows instead
            del made.input[1:]
            made.input.append(LOGIT_ROWS)
        nodes.append(made)
        renamed[node.output[0]] = made.output[0]
    nodes[-1].output[0] = contract.LOGITS

    moved = {id(c) for c in chain}
    kept = [c for c in graph.node if id(c) not in moved]
    del graph.node[:]
    graph.node.extend(kept + nodes)
    graph.input.extend(helper.make_tensor_value_info(name, TensorProto.INT64, shape) for name, shape in inputs)
    inner = {o for c in chain for o in c.output}
    values = [v for v in graph.value_info if v.name not in inner]
    del graph.value_info[:]
    graph.value_info.extend(values)
    next(o for o in graph.output if o.name == contract.LOGITS).type.tensor_type.shape.dim[1].dim_param = "logit_rows"
    return "packed" if packed else "rows"


def bound_rows(position_ids: np.ndarray, rows: np.ndarray | None, form: str) -> dict[str, np.ndarray]:
    """The inputs of a rewritten step (select_logit_rows, which said its `form`) for logits of `rows` [B, R] (None:
    every row, in order) in a step of these position_ids."""
    batch, num_tokens = position_ids.shape
    if form != "packed":
        every = np.broadcast_to(np.arange(num_tokens, dtype=np.int64), (batch, num_tokens))
        return {LOGIT_ROWS: np.ascontiguousarray((every if rows is None else rows)[..., None], dtype=np.int64)}
    source, count = packed_rows.packed_source(position_ids)
    if rows is None:  # every real row once, as the packed graph computes them; a hole reads row 0's
        return {HEAD_ROWS: np.arange(count, dtype=np.int64), LOGIT_ROWS: source}
    head, of_row = np.unique(np.take_along_axis(source, np.asarray(rows, dtype=np.int64), axis=1), return_inverse=True)
    return {HEAD_ROWS: head.astype(np.int64), LOGIT_ROWS: of_row.reshape(len(rows), -1).astype(np.int64)}
