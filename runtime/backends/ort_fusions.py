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

`fuse_grouped_attention` runs each layer of an in-graph step graph (`specrt inplace`) by GroupQueryAttention, the
kernel ONNX Runtime GenAI's models attend with: it writes the new K/V into the bound cache and reads each sequence's
slots up to its end, where ONNX's Attention node reads the whole capacity.
"""

from __future__ import annotations

import functools

import numpy as np

PREFIX = "ort_fusions/"


class _Graph:
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


def _other(node, name: str) -> str:
    """The input of a two-input node that is not `name`."""
    a, b = node.input
    return b if a == name else a


def _rms_norm(g: _Graph, reciprocal):
    """(x, weight, epsilon, output, nodes) of the RMSNorm whose Reciprocal this is, else None."""
    sqrt = g.made_by(reciprocal.input[0], "Sqrt")
    add = sqrt and g.made_by(sqrt.input[0], "Add")
    if add is None:
        return None
    mean = next((g.made_by(i, "ReduceMean") for i in add.input if g.made_by(i, "ReduceMean")), None)
    if mean is None:
        return None
    eps = g.scalar(_other(add, mean.output[0]))
    pow_ = g.made_by(mean.input[0], "Pow")
    axes = g.values.get(mean.input[1]) if len(mean.input) > 1 else None
    keepdims = next((a.i for a in mean.attribute if a.name == "keepdims"), 1)
    if eps is None or pow_ is None or g.scalar(pow_.input[1]) != 2.0 or axes is None \
            or np.atleast_1d(axes).tolist() != [-1] or keepdims != 1:
        return None
    x = pow_.input[0]
    scaled = g.only_use(reciprocal.output[0], "Mul")
    if scaled is None or _other(scaled, reciprocal.output[0]) != x:
        return None
    weighted = g.only_use(scaled.output[0], "Mul")
    if weighted is None:
        return None
    weight = _other(weighted, scaled.output[0])
    chain = [pow_, mean, add, sqrt, reciprocal, scaled]
    if weight not in g.static or any(g.only_use(n.output[0], after.op_type) is not after
                                     for n, after in zip(chain, chain[1:] + [weighted])):
        return None  # a step of the norm read elsewhere too: leave it whole
    return x, weight, eps, weighted.output[0], chain + [weighted]


def fuse_rms_norms(model) -> int:
    """Rewrite model's float32 RMSNorms (the Reciprocal form) into SimplifiedLayerNormalization nodes, in place;
    the number fused."""
    from onnx import TensorProto, helper

    g = _Graph(model)
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
        _replace_nodes(model.graph, replaced)
        _drop_unused_initializers(model.graph)  # the norms' own constants
    return fused


def fuse_skip_norms(model) -> int:
    """Rewrite each residual Add feeding a SimplifiedLayerNormalization (fuse_rms_norms') into one
    SkipSimplifiedLayerNormalization (com.microsoft) whose fourth output is the sum the residual stream goes on
    with, in place; the number fused. ONNX Runtime's own fusion of it skips the packed [N, hidden] rows."""
    from onnx import helper

    g = _Graph(model)
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
                                              epsilon=_attr(node, "epsilon"))]
        replaced[id(node)] = []
        fused += 1
    if fused:
        _replace_nodes(model.graph, replaced)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return fused


def _replace_nodes(graph, replaced: dict[int, list]) -> None:
    """The graph's nodes with each one whose id is in `replaced` swapped for that list (empty: dropped), in order."""
    nodes = [m for n in graph.node for m in replaced.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(nodes)


def _attr(node, name: str, default=None):
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
        widths = [inits[n.input[1]].dims[1] if op == "MatMul" else _attr(n, "N") for n in nodes]
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
    _replace_nodes(graph, replaced)
    for name, array in arrays.items():
        if inline:
            graph.initializer.append(numpy_helper.from_array(array, name))
            continue
        t = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                        data_location=TensorProto.EXTERNAL)
        for key, value in (("location", PREFIX.rstrip("/")), ("offset", "0"), ("length", str(array.nbytes))):
            t.external_data.add(key=key, value=value)
        graph.initializer.append(t)
    _drop_unused_initializers(graph)
    return merged, {} if inline else arrays


def _bias(matmul, width: int, inits, consumers, outputs) -> tuple | None:
    """(the Add, its bias's name) where the MatMul's output is read only by an Add of a float bias [width], else
    None."""
    users = consumers.get(matmul.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add" or matmul.output[0] in outputs:
        return None
    bias = _other(users[0], matmul.output[0])
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


def _drop_unused_initializers(graph) -> None:
    """Initializers no node reads any more (ONNX Runtime warns of each, and would load it)."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


@functools.cache
def grouped_attention_available() -> bool:
    """Whether this ONNX Runtime's GroupQueryAttention takes right-padded query chunks (its `query_seqlens` input,
    ONNX Runtime 1.32): what fuse_grouped_attention's batched multi-token steps need."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as capi

        schema = next(s for s in capi.get_all_operator_schema() if s.name == "GroupQueryAttention")
    except Exception:  # a build without schemas or without the operator
        return False
    return any(i.name == "query_seqlens" for i in schema.inputs)


def fuse_grouped_attention(model, num_heads: int, max_positions: int, weights_dir) -> tuple[int, int, int]:
    """Rewrite each layer of an in-graph step graph (InPlaceStepModule: two TensorScatter nodes writing the new K/V into
    the cache at write_indices, then ONNX's Attention over the whole cache under the slot mask) into one
    GroupQueryAttention (com.microsoft, ONNX Runtime >= 1.32's right-padded query chunks), in place; returns (the
    layers rewritten, those of them whose q and k the kernel rotates, those whose q, k and v it reads packed). The
    kernel writes the new rows into past_key/past_value where they are bound to the same memory as
    present_key/present_value (as OrtBackend binds them) and attends to each sequence's slots up to its last new row
    only, not to the whole capacity: seqlens_k = write_indices + T - 1, every one of the T rows valid (query_seqlens
    = T), the slot mask an additive bias over the capacity (total_sequence_length), under the kernel's causal mask,
    which a step's mask never crosses (no token sees a later row of its step).

    Where a layer rotates its whole q and k by rotate_half (StepLayer's _rope), the kernel rotates them too, at the
    step's own position_ids (a tree's rows at their depths), from cos/sin tables over `max_positions` that the
    graph's own rotary subgraph computes here once: the layer's rotation nodes, reshapes and transposes go. Only
    float32 graphs: there the kernel computes as Attention's softmax_precision asks."""
    from onnx import helper, numpy_helper

    from specrt import contract

    g = _Graph(model, weights_dir)
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    shapes = {v.name: v for v in graph.value_info}
    replaced, biases, tables, layers, rotated, qkv = {}, {}, {}, 0, 0, 0
    p = PREFIX + "gqa/"
    for node in graph.node:
        found = _scattered_attention(g, node, inputs)
        if found is None:
            continue
        scatter_k, scatter_v, out_transpose = found
        name, made = f"{p}{node.output[0]}", []
        if not layers:  # the per-step inputs every layer reads (from graph inputs alone), made once
            made, constants = _gqa_lengths(helper, numpy_helper, scatter_k.input[0])
            graph.initializer.extend(constants)
        mask = node.input[3]
        if mask not in biases:  # the slot mask [B, 1, T, C] as an additive float32 bias, once per mask
            biases[mask] = f"{p}bias/{mask}"
            made.append(helper.make_node("Where", [mask, p + "zero", p + "lowest"], [biases[mask]], name=biases[mask]))
        q_rope = _rotation(g, g.made_by(node.input[0], "Reshape"))  # q flattened to [B, H, T, D] after its rotation
        k_rope = _rotation(g, g.made_by(scatter_k.input[1], "Squeeze"))  # k's rotated [B, Hkv, 1, T, D] squeezed
        rotary = q_rope and k_rope and q_rope[1:] == k_rope[1:] and q_rope[1:]
        if rotary and rotary not in tables:
            tables[rotary] = _rotary_tables(g, model, rotary, max_positions, f"{p}rotary{len(tables)}/")
        rotary = rotary and tables[rotary]
        rows = []  # query, key and value as [B, T, heads x D]
        v_heads = g.made_by(scatter_v.input[1], "Transpose")  # v [B, T, Hkv, D] transposed to [B, Hkv, T, D]
        sources = [("q", q_rope[0] if rotary else None, node.input[0], [0, 2, 1, 3]),
                   ("k", k_rope[0] if rotary else None, scatter_k.input[1], [0, 2, 1, 3]),
                   ("v", v_heads.input[0] if v_heads is not None and list(_attr(v_heads, "perm")) == [0, 2, 1, 3]
                    else None, scatter_v.input[1], [0, 2, 1, 3])]
        for what, heads_first, source, perm in sources:
            if heads_first is not None:  # [B, T, heads..., D] as the projection's [B, T, heads x D] viewed it
                view = g.made_by(heads_first, "Reshape")
                if view is not None:
                    rows.append(view.input[0])  # the projection's rows themselves (a view of them keeps B, T)
                    continue
                source, perm = heads_first, None
            if perm is not None:
                made.append(helper.make_node("Transpose", [source], [f"{name}/{what}/bthd"], name=f"{name}/{what}/t",
                                             perm=perm))
                source = made[-1].output[0]
            made.append(helper.make_node("Reshape", [source, p + "rows"], [f"{name}/{what}/rows"],
                                         name=f"{name}/{what}/r"))
            rows.append(made[-1].output[0])
        kv_heads, head = _dim(inputs[scatter_k.input[0]], 1), _dim(inputs[scatter_k.input[0]], 3)
        packed = _packed_qkv(g, rows, [num_heads, kv_heads, kv_heads], head)
        if packed is not None:  # q, k and v split from one MatMul's rows: the kernel reads those rows as they are
            source, gather = packed
            if gather is not None:
                made.append(helper.make_node("Gather", [source, gather.input[1]], [f"{name}/qkv"], name=f"{name}/qkv",
                                             axis=_attr(gather, "axis", 0)))
                source = made[-1].output[0]
            rows = [source, "", ""]
            qkv += 1
        cos, sin = rotary or ("", "")
        # the kernel's [B, T, H x D] stands for the Transpose of Attention's output to [B, T, H, D]; the Reshape
        # reading that (StepLayer.end's) goes too where the graph says it makes [B, T, H x D]
        out = out_transpose.output[0]
        end = g.only_use(out, "Reshape")
        rows_shape = _shape(inputs[contract.INPUT_IDS])
        if rows_shape is not None and _shape(shapes.get(end.output[0])) == [*rows_shape, num_heads * head]:
            replaced[id(end)], out = [], end.output[0]
        made.append(helper.make_node(
            "GroupQueryAttention",
            [*rows, scatter_k.input[0], scatter_v.input[0], p + "seqlens_k", p + "total", cos, sin,
             p + "positions" if rotary else "", biases[mask], "", "", "", "", "", p + "query_seqlens"],
            [out, scatter_k.output[0], scatter_v.output[0]], name=name, domain="com.microsoft",
            num_heads=num_heads, kv_num_heads=kv_heads, scale=_attr(node, "scale"),
            do_rotary=int(bool(rotary))))
        replaced[id(node)] = made
        replaced.update({id(scatter_k): [], id(scatter_v): [], id(out_transpose): []})
        layers, rotated = layers + 1, rotated + bool(rotary)
    if layers:
        _replace_nodes(graph, replaced)
        made = {o for node in graph.node if node.op_type == "GroupQueryAttention" for o in node.output}
        kept = [v for v in graph.value_info if v.name not in made]  # the shapes the replaced nodes gave them
        del graph.value_info[:]
        graph.value_info.extend(kept)
        _drop_dead_nodes(graph)
        _drop_unused_initializers(graph)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return layers, rotated, qkv


def _packed_qkv(g: _Graph, rows: list[str], heads: list[int], head_dim: int):
    """(the tensor [.., (H + 2 Hkv) x D] that q, k and v (`rows`, [B, T, heads x D] each) are split from, in that
    order and only for this layer, the Gather of packed rows (packed_rows.py, axis 0) each of them is read through,
    or None) where they are; else None. GroupQueryAttention reads such a tensor as its packed query."""
    gathers = [g.made_by(r, "Gather") for r in rows]
    if all(gathers):
        if len({(x.input[1], _attr(x, "axis")) for x in gathers}) != 1:
            return None
        parts = [x.input[0] for x in gathers]
    elif any(gathers):
        return None
    else:
        parts, gathers = rows, [None]
    split = g.made_by(parts[0], "Split")
    sizes = g.values.get(split.input[1]) if split is not None and len(split.input) == 2 else None
    if sizes is None or list(split.output) != parts or list(sizes) != [h * head_dim for h in heads] \
            or _attr(split, "axis", 0) != -1 \
            or any(len(g.consumers.get(t, [])) != 1 or t in g.outputs for t in [*parts, *rows]):
        return None
    return split.input[0], gathers[0]


def _rotation(g: _Graph, reshaped):
    """(the [B, T, heads..., D] tensor a layer rotates, its cos, its sin) where `reshaped` (a Reshape or Squeeze
    node) reads `(x * cos + (x @ R) * sin)` of x = that tensor transposed heads-first, R rotate_half's matrix over
    the whole head (StepLayer's _rope), else None."""
    if reshaped is None:
        return None
    add = g.made_by(reshaped.input[0], "Add")
    if add is None or len(g.consumers.get(add.output[0], [])) != 1:
        return None
    muls = [g.made_by(i, "Mul") for i in add.input]
    if any(m is None for m in muls):
        return None
    for plain, turned in (muls, muls[::-1]):
        matmul = next((g.made_by(i, "MatMul") for i in turned.input if g.made_by(i, "MatMul")), None)
        if matmul is None:
            continue
        x = matmul.input[0]
        transpose = g.made_by(x, "Transpose")
        if x not in plain.input or transpose is None or list(_attr(transpose, "perm")) != [0, 2, 3, 1, 4] \
                or not _is_rotate_half(g.matrix(matmul.input[1])):
            return None
        return transpose.input[0], _other(plain, x), _other(turned, matmul.output[0])
    return None


def _is_rotate_half(r) -> bool:
    """Whether r is the rotate-half matrix (contract.rotate_half_matrix) of its size."""
    from specrt.contract import rotate_half_matrix

    if r is None or r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] % 2:
        return False
    return bool(np.array_equal(r, rotate_half_matrix(r.shape[0])))


def _rotary_tables(g: _Graph, model, rotary, max_positions: int, prefix: str):
    """(cos, sin) initializer names of GroupQueryAttention's tables [max_positions, D/2] for the rope inputs
    `rotary` (the names of the cos and sin tensors, [B, 1, 1, T, D] each), computed by running the graph's own nodes
    that make them from position_ids at positions 0 .. max_positions - 1; None where they read anything else, or
    their two halves differ (not rotate_half's layout)."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from specrt import contract

    cos, sin = rotary
    nodes, todo, seen = [], [cos, sin], set()
    inits = {t.name: t for t in model.graph.initializer}
    feeds = set()
    while todo:
        name = todo.pop()
        if name in seen or name == "":
            continue
        seen.add(name)
        node = g.producer.get(name)
        if node is None:
            if name in inits:
                continue
            if name not in (contract.POSITION_IDS, contract.INPUT_IDS):
                return None
            feeds.add(name)
            continue
        nodes.append(node)
        todo.extend(node.input)
    order = {id(n): i for i, n in enumerate(model.graph.node)}
    nodes = sorted({id(n): n for n in nodes}.values(), key=lambda n: order[id(n)])
    used = {i for n in nodes for i in n.input}
    graph_inputs = [i for i in model.graph.input if i.name in feeds]
    small = [numpy_helper.from_array(g.matrix(n), n) for n in used if n in inits]
    sub = helper.make_model(helper.make_graph(nodes, "rotary", graph_inputs, [
        helper.make_tensor_value_info(cos, 1, None), helper.make_tensor_value_info(sin, 1, None)], small),
        opset_imports=list(model.opset_import))
    positions = np.arange(max_positions, dtype=np.int64)[None]
    try:
        session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
        cos_v, sin_v = session.run([cos, sin], {name: positions if name == contract.POSITION_IDS
                                                else np.zeros_like(positions) for name in feeds})
    except Exception:  # onnxruntime's own exception types: leave the rotation in the graph
        return None
    cos_v, sin_v = (v.reshape(max_positions, -1) for v in (cos_v, sin_v))
    half = cos_v.shape[1] // 2  # the kernel's rotation wants a head size that is a multiple of 16
    if cos_v.shape[1] % 16 or not (np.array_equal(cos_v[:, :half], cos_v[:, half:])
                                   and np.array_equal(sin_v[:, :half], sin_v[:, half:])):
        return None
    model.graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(cos_v[:, :half]), prefix + "cos"),
                                    numpy_helper.from_array(np.ascontiguousarray(sin_v[:, :half]), prefix + "sin")])
    return prefix + "cos", prefix + "sin"


def _drop_dead_nodes(graph) -> None:
    """Nodes whose outputs nothing reads (a rewrite's leftovers), until none is left."""
    while True:
        outputs = {o.name for o in graph.output}
        used = {i for n in graph.node for i in n.input} | outputs
        live = [n for n in graph.node if any(o in used for o in n.output if o)]
        if len(live) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(live)


def _shape(value_info) -> list | None:
    """A value's dims as the graph declares them (sizes, or names of symbolic ones), None where it declares none."""
    if value_info is None or not value_info.type.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value or d.dim_param or None for d in value_info.type.tensor_type.shape.dim]
    return None if None in dims else dims


def _dim(value_info, axis: int) -> int:
    return value_info.type.tensor_type.shape.dim[axis].dim_value


def _scattered_attention(g: _Graph, node, inputs):
    """(the K TensorScatter, the V one, the Transpose reading its output) of an in-graph layer's Attention node, else
    None."""
    from onnx import TensorProto

    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.input) != 4 \
            or any(o for o in node.output[1:]):
        return None
    scatters = [g.made_by(i, "TensorScatter") for i in node.input[1:3]]
    if any(s is None or s.input[0] not in inputs or s.output[0] not in g.outputs for s in scatters):
        return None
    past = inputs[scatters[0].input[0]]
    head = _dim(past, 3)
    if past.type.tensor_type.elem_type != TensorProto.FLOAT or not _dim(past, 1) or not head or head % 8:
        return None  # the kernel's float32 path, its head size a multiple of 8
    attrs = {a.name: a for a in node.attribute}
    if set(attrs) - {"scale", "softmax_precision"} or "scale" not in attrs:
        return None
    after = g.only_use(node.output[0], "Transpose")
    if after is None or list(_attr(after, "perm")) != [0, 2, 1, 3] or g.only_use(after.output[0], "Reshape") is None:
        return None
    return (*scatters, after)


def _gqa_lengths(helper, numpy_helper, past_key: str) -> tuple[list, list]:
    """(nodes, initializers) computing GroupQueryAttention's per-step inputs from the in-graph contract's: seqlens_k
    (write_indices + T - 1), query_seqlens (T for every sequence), total_sequence_length (the capacity), int32; the
    positions its rotation reads."""
    from specrt import contract

    p = PREFIX + "gqa/"
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), p + "zero"),
             numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), p + "lowest"),
             numpy_helper.from_array(np.array([1], np.int64), p + "one"),
             numpy_helper.from_array(np.array(0, np.int64), p + "first"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), p + "rows")]
    nodes = [helper.make_node("Shape", [contract.INPUT_IDS], [p + "batch"], name=p + "batch", start=0, end=1),
             helper.make_node("Shape", [contract.INPUT_IDS], [p + "tokens"], name=p + "tokens", start=1, end=2),
             helper.make_node("Shape", [past_key], [p + "capacity"], name=p + "capacity", start=2, end=3),
             helper.make_node("Cast", [p + "capacity"], [p + "total"], name=p + "total", to=6),
             helper.make_node("Expand", [p + "tokens", p + "batch"], [p + "tokens_b"], name=p + "tokens_b"),
             helper.make_node("Cast", [p + "tokens_b"], [p + "query_seqlens"], name=p + "query_seqlens", to=6),
             helper.make_node("Add", [contract.WRITE_INDICES, p + "tokens"], [p + "ends"], name=p + "ends"),
             helper.make_node("Sub", [p + "ends", p + "one"], [p + "last"], name=p + "last"),
             helper.make_node("Cast", [p + "last"], [p + "seqlens_k"], name=p + "seqlens_k", to=6),
             # a ragged step's padding rows are at position -1 (step_inputs.pack_step), which the kernel's rotation
             # refuses: any position will do for rows whose outputs are never read
             helper.make_node("Max", [contract.POSITION_IDS, p + "first"], [p + "positions"], name=p + "positions")]
    return nodes, inits
