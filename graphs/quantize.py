"""The weight rewrites of `specrt quantize` (engines/quantize.py runs them, and ONNX Runtime's own quantizers): which
MatMuls multiply by a weight and which of those stay float, and dynamic-int8's rewrite of each into MatMulInteger of
activations quantized per row as the step runs (rows stay independent of each other, which lossless verification
needs)."""

from __future__ import annotations

import numpy as np

ZERO_POINT = 128  # dynamic-int8: the uint8 activation that stands for 0
WEIGHT_LEVELS = 63  # dynamic-int8: weights in -63..63 (7 bits: engines/quantize.py says why)


def role_of(dims, hidden: int, intermediate: int, vocab: int) -> str | None:
    """"down" or "head" for a Llama-family weight MatMul of these [K, N] dims (the only ones of those shapes), else
    None."""
    if tuple(dims) == (intermediate, hidden):
        return "down"
    return "head" if dims[-1] == vocab else None


def weight_matmuls(model) -> tuple[list[str], list[str]]:
    """(names of the MatMul nodes that multiply by a weight initializer, names of those left in float: the
    rotary rotate-half products, whose weight is a signed permutation matrix)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    quantize, keep = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        permutation = (w.ndim == 2 and w.shape[0] == w.shape[1] and np.isin(w, (-1, 0, 1)).all()
                       and (np.abs(w).sum(axis=1) == 1).all())
        (keep if permutation else quantize).append(node.name)
    return quantize, keep


def quantize_rows(model, nodes: list[str]) -> None:
    """dynamic-int8, in place: each MatMul in `nodes` (X · W, W an initializer) becomes MatMulInteger of X quantized
    per row when the step runs and W quantized per output column here, its int32 result rescaled by both scales.
    An input several MatMuls share (q/k/v, gate/up) is quantized once; each row's result depends on that row
    alone, which lossless verification needs."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    const = {"zero_point": np.array(ZERO_POINT, np.uint8), "offset": np.array(ZERO_POINT, np.float32),
             "levels": np.array(127, np.float32), "tiny": np.array(1e-30, np.float32),
             "last": np.array([-1], np.int64)}
    name = {k: f"dynamic_int8/{k}" for k in const}
    targets, body, rows, weights = set(nodes), [], {}, {}
    for node in graph.node:
        if node.name not in targets:
            body.append(node)
            continue
        x, w = node.input
        if w not in weights:  # per output column: scale = max |w| / 63
            wf = numpy_helper.to_array(inits[w]).astype(np.float32)
            scale = np.maximum(np.abs(wf).max(axis=0), const["tiny"]) / WEIGHT_LEVELS
            q = np.clip(np.round(wf / scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
            weights[w] = (numpy_helper.from_array(q, f"{w}/int8"), numpy_helper.from_array(scale, f"{w}/scale"))
        if x not in rows:  # per row: scale = max |x| / 127 over the last axis, x / scale rounded, + 128
            p = f"dynamic_int8/{len(rows)}/"
            reduce = (helper.make_node("ReduceMax", [p + "abs", name["last"]], [p + "max"], keepdims=1) if opset >= 18
                      else helper.make_node("ReduceMax", [p + "abs"], [p + "max"], axes=[-1], keepdims=1))
            body += [helper.make_node("Abs", [x], [p + "abs"]), reduce,
                     helper.make_node("Max", [p + "max", name["tiny"]], [p + "nonzero"]),  # a row of zeros: scale tiny
                     helper.make_node("Div", [p + "nonzero", name["levels"]], [p + "scale"]),
                     helper.make_node("Div", [x, p + "scale"], [p + "scaled"]),
                     helper.make_node("Round", [p + "scaled"], [p + "rounded"]),
                     helper.make_node("Add", [p + "rounded", name["offset"]], [p + "shifted"]),
                     helper.make_node("Cast", [p + "shifted"], [p + "uint8"], to=TensorProto.UINT8)]
            rows[x] = (p + "uint8", p + "scale")
        xq, xs = rows[x]
        wq, ws = (t.name for t in weights[w])
        out = node.output[0]
        p = f"{out}/dynamic_int8/"  # output names are unique in a graph; node names need not be
        body += [helper.make_node("MatMulInteger", [xq, wq, name["zero_point"]], [p + "int32"]),
                 helper.make_node("Cast", [p + "int32"], [p + "float"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", [p + "float", ws], [p + "columns"]),
                 helper.make_node("Mul", [p + "columns", xs], [out])]
    used = {i for n in body for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]  # a float weight nothing else reads goes
    del graph.node[:], graph.initializer[:]
    graph.node.extend(body)
    graph.initializer.extend(kept + [t for pair in weights.values() for t in pair]
                             + [numpy_helper.from_array(v, name[k]) for k, v in const.items() if name[k] in used])
