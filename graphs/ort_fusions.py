"""Load-time fusions of a step graph into ONNX Runtime's own kernels (OrtBackend, after packed_rows).

The exporter writes RMSNorm as the module computes it: Pow(x, 2), ReduceMean over the last axis, Add(eps), Sqrt,
Reciprocal, Mul(x, .), Mul(weight, .): six nodes, each a pass over the row and a dispatch, per norm. ONNX Runtime's
own optimizer fuses only the Div form (x / Sqrt(...)) into SimplifiedLayerNormalization, the kernel ONNX Runtime
GenAI's models use, so `fuse_rms_norms` rewrites the Reciprocal form into it, and `fuse_skip_norms` folds the
residual Add before each into SkipSimplifiedLayerNormalization (ONNX Runtime's own skip fusion leaves packed
[N, hidden] rows alone). The kernels compute the same function (float32 statistics, stash_type 1); the fused graph
is checked against the unfused one in the tests.

Only float32 norms are fused: a float16 graph computes the statistics after a Cast to float32 and casts back before
the weight, which the kernel would round differently.

`fuse_projections` merges the MatMuls that read one input (q, k, v; gate and up of the weight-only variants) into
one over their weights side by side: at one token a step is a chain of matrix-vector products, and each dispatch
costs its own thread-pool round (ONNX Runtime GenAI's builder emits q, k and v as one MatMul too). A float MLP's gate
and up stay two MatMuls, as that builder leaves them: on 2 AVX2 cores the inflated target's in-graph step ran its
one-token step 1.07x slower with them merged (`specrt bench fusions`, which times the choices on any machine;
docs/benchmarks.md).

The in-graph step graphs' attention rewrite lives in ort_attention.py.
"""

from __future__ import annotations

import numpy as np

PREFIX = "ort_fusions/"


class GraphIndex:
    """Producers and consumers of each tensor of a graph, and the constants it can read without external data."""

    def __init__(self, model, weights_dir=None):
        from onnx import numpy_helper

        self.weights_dir = weights_dir  # where external data files are (None: leave external tensors unread)
        graph = model.graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}
        self.tensors = {t.name: t for t in graph.initializer}
        small = {t.name: t for t in graph.initializer if not t.external_data and len(t.dims) <= 1}
        small.update({n.output[0]: n.attribute[0].t for n in graph.node
                      if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
        self.values = {name: numpy_helper.to_array(t) for name, t in small.items()}
        self.static = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
        for node in graph.node:  # what no step input reaches: weights and what is computed from them alone
            if node.input and all(i == "" or i in self.static for i in node.input):
                self.static.update(node.output)

    def made_by(self, name: str, op: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def only_use(self, name: str, op: str):
        """The one node reading `name`, if it is an `op` and `name` is not a graph output."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and name not in self.outputs else None

    def matrix(self, name: str):
        """An initializer's values (read from external data where the graph was given its folder), else None."""
        t = self.tensors.get(name)
        if t is None or t.data_location == t.EXTERNAL and self.weights_dir is None:
            return None
        return _values(t, self.weights_dir)

    def scalar(self, name: str) -> float | None:
        value = self.values.get(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def other_input(node, name: str) -> str:
    """The input of a two-input node that is not `name`."""
    a, b = node.input
    return b if a == name else a


def _rms_norm(g: GraphIndex, reciprocal):
    """(x, weight, epsilon, output, nodes) of the RMSNorm whose Reciprocal this is, else None."""
    sqrt = g.made_by(reciprocal.input[0], "Sqrt")
    add = sqrt and g.made_by(sqrt.input[0], "Add")
    if add is None:
        return None
    mean = next((g.made_by(i, "ReduceMean") for i in add.input if g.made_by(i, "ReduceMean")), None)
    if mean is None:
        return None
    eps = g.scalar(other_input(add, mean.output[0]))
    pow_ = g.made_by(mean.input[0], "Pow")
    axes = g.values.get(mean.input[1]) if len(mean.input) > 1 else None
    keepdims = next((a.i for a in mean.attribute if a.name == "keepdims"), 1)
    if eps is None or pow_ is None or g.scalar(pow_.input[1]) != 2.0 or axes is None \
            or np.atleast_1d(axes).tolist() != [-1] or keepdims != 1:
        return None
    x = pow_.input[0]
    scaled = g.only_use(reciprocal.output[0], "Mul")
    if scaled is None or other_input(scaled, reciprocal.output[0]) != x:
        return None
    weighted = g.only_use(scaled.output[0], "Mul")
    if weighted is None:
        return None
    weight = other_input(weighted, scaled.output[0])
    chain = [pow_, mean, add, sqrt, reciprocal, scaled]
    if weight not in g.static or any(g.only_use(n.output[0], after.op_type) is not after
                                     for n, after in zip(chain, chain[1:] + [weighted])):
        return None  # a step of the norm read elsewhere too: leave it whole
    return x, weight, eps, weighted.output[0], chain + [weighted]


def fuse_rms_norms(model) -> int:
    """Rewrite model's float32 RMSNorms (the Reciprocal form) into SimplifiedLayerNormalization nodes, in place;
    the number fused."""
    from onnx import TensorProto, helper

    g = GraphIndex(model)
    inits = {t.name: t for t in model.graph.initializer}
    replaced, fused = {}, 0
    for node in model.graph.node:
        found = _rms_norm(g, node) if node.op_type == "Reciprocal" else None
        scale = found and inits.get(found[1])
        if found is None or scale is not None and (scale.data_type != TensorProto.FLOAT or len(scale.dims) != 1):
            continue  # the kernel's scale: float32, over the last axis alone
        x, weight, eps, out, nodes = found
        replaced[id(nodes[0])] = [helper.make_node("SimplifiedLayerNormalization", [x, weight], [out],
                                                   name=PREFIX + out, axis=-1, epsilon=eps, stash_type=1)]
        replaced.update({id(n): [] for n in nodes[1:]})
        fused += 1
    if fused:
        replace_nodes(model.graph, replaced)
        drop_unused_initializers(model.graph)  # the norms' own constants
    return fused


def fuse_skip_norms(model) -> int:
    """Rewrite each residual Add feeding a SimplifiedLayerNormalization (fuse_rms_norms') into one
    SkipSimplifiedLayerNormalization (com.microsoft) whose fourth output is the sum the residual stream goes on
    with, in place; the number fused. ONNX Runtime's own fusion of it skips the packed [N, hidden] rows."""
    from onnx import helper

    g = GraphIndex(model)
    replaced, fused = {}, 0
    for node in model.graph.node:
        if node.op_type != "SimplifiedLayerNormalization" or not node.name.startswith(PREFIX):
            continue
        add = g.made_by(node.input[0], "Add")
        if add is None or any(i in g.static for i in add.input):
            continue  # a bias, not a residual
        replaced[id(add)] = [helper.make_node("SkipSimplifiedLayerNormalization", [*add.input, node.input[1]],
                                              [node.output[0], "", "", add.output[0]],
                                              name=PREFIX + "skip/" + node.output[0], domain="com.microsoft",
                                              epsilon=node_attr(node, "epsilon"))]
        replaced[id(node)] = []
        fused += 1
    if fused:
        replace_nodes(model.graph, replaced)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return fused


def replace_nodes(graph, replaced: dict[int, list]) -> None:
    """The graph's nodes with each one whose id is in `replaced` swapped for that list (empty: dropped), in order."""
    nodes = [m for n in graph.node for m in replaced.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(nodes)


def node_attr(node, name: str, default=None):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def fuse_projections(model, weights_dir, inline: bool, pairs: bool = False) -> tuple[int, dict[str, np.ndarray]]:
    """Rewrite each set of weight MatMuls that read one input (a layer's q, k and v projections; its gate and up)
    into one over the weights side by side and a Split, in place: one dispatch and one pass over the input instead
    of one each. Float MatMuls with weights [K, N_i] are joined on N where three or more read the input (q, k and
    v: a pair, the MLP's gate and up, runs faster as two, see the module's doc; `pairs` merges those too), and so are
    their biases where each is added right after (Qwen2's q, k and v); MatMulNBits nodes (the int8/int4 weight
    variants) of one K, bit width and block size are joined in any number, their packed weights, scales and zero
    points all leading with N.
    Returns (the number of nodes merged away, the merged initializers by name): with `inline` they are the graph's
    own and the dict is empty; else the graph declares them as external data in no file, for the session to be given
    with SessionOptions.add_external_initializers (a graph of external weights is not reserialized with hundreds of
    MB in it). `weights_dir`: where the model's external data files are."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    outputs = {o.name for o in model.graph.output}
    groups: dict[tuple, list] = {}
    for node in model.graph.node:
        key = _merge_key(node, inits)
        if key is not None:
            groups.setdefault(key, []).append(node)
    replaced, arrays, merged = {}, {}, 0
    for (source, op, *_), nodes in groups.items():
        if len(nodes) < (3 if op == "MatMul" and not pairs else 2):
            continue
        name = f"{PREFIX}merged/{nodes[0].output[0]}"
        axis = 1 if op == "MatMul" else 0  # MatMul's weight is [K, N]; every MatMulNBits constant leads with N
        inputs = [source]
        for i in range(1, len(nodes[0].input)):
            inputs.append(f"{name}/{i}")
            arrays[inputs[-1]] = np.concatenate([_values(inits[n.input[i]], weights_dir) for n in nodes], axis=axis)
        widths = [inits[n.input[1]].dims[1] if op == "MatMul" else node_attr(n, "N") for n in nodes]
        sizes = numpy_helper.from_array(np.array(widths, np.int64), name + "/sizes")
        model.graph.initializer.append(sizes)
        attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
        if op == "MatMulNBits":
            attrs["N"] = sum(widths)
        made = [helper.make_node(op, inputs, [name + "/out"], name=name, domain=nodes[0].domain, **attrs)]
        ends = [n.output[0] for n in nodes]
        biases = [_bias(n, widths[i], inits, consumers, outputs) for i, n in enumerate(nodes)] if op == "MatMul" else []
        if biases and all(biases):  # one Add of the biases side by side, before the Split
            arrays[name + "/bias"] = np.concatenate([_values(inits[b], weights_dir) for _, b in biases])
            made.append(helper.make_node("Add", [name + "/out", name + "/bias"], [name + "/biased"],
                                         name=name + "/bias"))
            ends = [add.output[0] for add, _ in biases]
            replaced.update({id(add): [] for add, _ in biases})
        made.append(helper.make_node("Split", [made[-1].output[0], sizes.name], ends, name=name + "/split", axis=-1))
        replaced[id(nodes[0])] = made
        replaced.update({id(n): [] for n in nodes[1:]})
        merged += len(nodes) - 1
    if not arrays:
        return 0, {}
    graph = model.graph
    replace_nodes(graph, replaced)
    for name, array in arrays.items():
        if inline:
            graph.initializer.append(numpy_helper.from_array(array, name))
            continue
        t = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                        data_location=TensorProto.EXTERNAL)
        for key, value in (("location", PREFIX.rstrip("/")), ("offset", "0"), ("length", str(array.nbytes))):
            t.external_data.add(key=key, value=value)
        graph.initializer.append(t)
    drop_unused_initializers(graph)
    return merged, {} if inline else arrays


def _bias(matmul, width: int, inits, consumers, outputs) -> tuple | None:
    """(the Add, its bias's name) where the MatMul's output is read only by an Add of a float bias [width], else
    None."""
    users = consumers.get(matmul.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add" or matmul.output[0] in outputs:
        return None
    bias = other_input(users[0], matmul.output[0])
    t = inits.get(bias)
    weight = inits[matmul.input[1]]
    return (users[0], bias) if t is not None and list(t.dims) == [width] and t.data_type == weight.data_type else None


def _merge_key(node, inits) -> tuple | None:
    """What a weight MatMul must share with another to be merged with it (its input first), else None."""
    from onnx import TensorProto, helper

    if node.op_type == "MatMul":
        w = inits.get(node.input[1])
        if w is None or len(w.dims) != 2 or w.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            return None
        return node.input[0], "MatMul", w.dims[0], w.data_type
    if node.op_type == "MatMulNBits" and all(i in inits for i in node.input[1:]):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "N"}
        # the same optional inputs (zero points; no g_idx or bias is ever given a merged layout here)
        return (node.input[0], "MatMulNBits", len(node.input), tuple(sorted(attrs.items())),
                tuple(inits[i].data_type for i in node.input[1:])) if len(node.input) <= 4 else None
    return None


def _values(tensor, weights_dir) -> np.ndarray:
    """An initializer's values, read from its external data file where it has one."""
    from pathlib import Path

    from onnx import helper, numpy_helper

    if tensor.data_location != tensor.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    data = np.fromfile(Path(weights_dir) / info["location"], dtype=dtype, count=int(np.prod(tensor.dims)),
                       offset=int(info.get("offset", 0)))
    return data.reshape(tuple(tensor.dims))


def drop_unused_initializers(graph) -> None:
    """Initializers no node reads any more (ONNX Runtime warns of each, and would load it)."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
