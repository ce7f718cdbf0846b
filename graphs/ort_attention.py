"""The in-graph step graphs' layers (`specrt inplace`) rewritten into ONNX Runtime's GroupQueryAttention, at load
(OrtBackend, after ort_fusions' merges): the kernel ONNX Runtime GenAI's models attend with. It writes the new K/V
into the bound cache and reads each sequence's slots up to its end, where ONNX's Attention node reads the whole
capacity; it rotates q and k itself where a layer rotates whole heads, and reads q, k and v as one merged
projection's rows where they are split from one.
"""

from __future__ import annotations

import functools

import numpy as np

from specrt.graphs.ort_fusions import (PREFIX, GraphIndex, drop_unused_initializers, node_attr,
                                                 other_input, replace_nodes)


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

    g = GraphIndex(model, weights_dir)
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
                   ("v", v_heads.input[0] if v_heads is not None and list(node_attr(v_heads, "perm")) == [0, 2, 1, 3]
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
                                             axis=node_attr(gather, "axis", 0)))
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
            num_heads=num_heads, kv_num_heads=kv_heads, scale=node_attr(node, "scale"),
            do_rotary=int(bool(rotary))))
        replaced[id(node)] = made
        replaced.update({id(scatter_k): [], id(scatter_v): [], id(out_transpose): []})
        layers, rotated = layers + 1, rotated + bool(rotary)
    if layers:
        replace_nodes(graph, replaced)
        made = {o for node in graph.node if node.op_type == "GroupQueryAttention" for o in node.output}
        kept = [v for v in graph.value_info if v.name not in made]  # the shapes the replaced nodes gave them
        del graph.value_info[:]
        graph.value_info.extend(kept)
        _drop_dead_nodes(graph)
        drop_unused_initializers(graph)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return layers, rotated, qkv


def _packed_qkv(g: GraphIndex, rows: list[str], heads: list[int], head_dim: int):
    """(the tensor [.., (H + 2 Hkv) x D] that q, k and v (`rows`, [B, T, heads x D] each) are split from, in that
    order and only for this layer, the Gather of packed rows (packed_rows.py, axis 0) each of them is read through,
    or None) where they are; else None. GroupQueryAttention reads such a tensor as its packed query."""
    gathers = [g.made_by(r, "Gather") for r in rows]
    if all(gathers):
        if len({(x.input[1], node_attr(x, "axis")) for x in gathers}) != 1:
            return None
        parts = [x.input[0] for x in gathers]
    elif any(gathers):
        return None
    else:
        parts, gathers = rows, [None]
    split = g.made_by(parts[0], "Split")
    sizes = g.values.get(split.input[1]) if split is not None and len(split.input) == 2 else None
    if sizes is None or list(split.output) != parts or list(sizes) != [h * head_dim for h in heads] \
            or node_attr(split, "axis", 0) != -1 \
            or any(len(g.consumers.get(t, [])) != 1 or t in g.outputs for t in [*parts, *rows]):
        return None
    return split.input[0], gathers[0]


def _rotation(g: GraphIndex, reshaped):
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
        if x not in plain.input or transpose is None or list(node_attr(transpose, "perm")) != [0, 2, 3, 1, 4] \
                or not _is_rotate_half(g.matrix(matmul.input[1])):
            return None
        return transpose.input[0], other_input(plain, x), other_input(turned, matmul.output[0])
    return None


def _is_rotate_half(r) -> bool:
    """Whether r is the rotate-half matrix (contract.rotate_half_matrix) of its size."""
    from specrt.contract import rotate_half_matrix

    if r is None or r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] % 2:
        return False
    return bool(np.array_equal(r, rotate_half_matrix(r.shape[0])))


def _rotary_tables(g: GraphIndex, model, rotary, max_positions: int, prefix: str):
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


def _scattered_attention(g: GraphIndex, node, inputs):
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
    if after is None or list(node_attr(after, "perm")) != [0, 2, 1, 3] or g.only_use(after.output[0], "Reshape") is None:
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
