"""Packed token rows: the holes of a ragged step left out of a step graph's token-wise work (ONNX Runtime).

A ragged step is [B, T] with T the widest sequence's row count; every other sequence's rows past its own are
holes (contract.HOLE_POSITION). Computed as they stand, holes cost what real rows do in every projection and
MLP: at batch 8 with ANPD drafts of 0-7 tokens, most of a step. EMS-SD ("unpad input tokens", its Table 2:
1.48x at batch 8 alone) concatenates the real rows before the token-wise layers. `pack_rows` rewrites a step
graph (in memory, when OrtBackend loads it) to do that without changing the step contract:

    keep = (b, t) of every row whose position is not a hole  [N, 2]
    input_ids [B, T] -> [N] (GatherND); every op that works row by row then runs on [N, ...]: the
    embedding lookup, norms, activations, residual adds, and the weight MatMuls (float, MatMulInteger,
    MatMulNBits, QDQ); before any other op (the reshape to heads, attention, a graph output) a packed tensor is
    gathered back to [B, T, ...] (one Gather by each row's packed index; a hole takes packed row 0's garbage),
    and a [B, T, ...] tensor feeding a weight MatMul (attention's output) is packed (one GatherND).

Attention stays [B, T] as the contract has it (its cost is B x T x S either way; EMS-SD's unpadded attention
needs a kernel the ONNX step cannot name). Invariants: every row that is not a hole gets exactly the ops and
operands it got before (the same values; tested against the unrewritten graph); a hole's logits and new K/V are
finite garbage (packed row 0's), which nobody reads; a step without holes keeps every row, in order, and adds
none (a GEMM of M rows is what the unrewritten graph runs: one row more would turn ONNX Runtime's single-row
kernel into its general one). What counts as row by row is an allow-list (ROW_OPS, LAST_AXIS, WEIGHT_OPS);
anything else gets its packed inputs gathered back first, so an op the pass does not know costs speed, never
correctness.
"""

from __future__ import annotations

import numpy as np

from specrt import contract

# elementwise ops: row by row when every other input is packed, [B, T, ...] (gathered) or a constant of rank <= 1
ROW_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Erf", "Relu", "Neg",
                     "Exp", "Log", "Cast", "Abs", "Round", "Max", "Min", "Identity", "Clip", "Softplus", "Gelu",
                     "QuantizeLinear", "DequantizeLinear", "Where", "Equal", "Less", "Greater", "Not", "And", "Or"})
LAST_AXIS = frozenset({"ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceL2", "Softmax", "LogSoftmax"})
# X · W with W (and any scale / zero point) constant: row r of the result depends on row r of X alone
WEIGHT_OPS = frozenset({"MatMul", "MatMulInteger", "MatMulNBits"})
PREFIX = "packed_rows/"
SMALL_BYTES = 4096  # initializers up to this size keep their values for shape inference (shapes, axes)


class _Packer:
    def __init__(self, model):
        from onnx import numpy_helper

        self.model = model
        graph = model.graph
        constants = {n.output[0]: n.attribute[0].t for n in graph.node
                     if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
        self.dims = {t.name: list(t.dims) for t in graph.initializer}  # every constant tensor's shape
        self.dims.update({name: list(t.dims) for name, t in constants.items()})
        self.small = {t.name: t for t in graph.initializer if not t.external_data and len(t.dims) <= 1}
        self.small.update(constants)  # values the pass reads (axes); external or large weights are never loaded
        self.static = set(self.dims)  # tensors no step input reaches: weights and what is computed from them alone
        for node in graph.node:
            if node.input and all(i == "" or i in self.static for i in node.input):
                self.static.update(node.output)
        inferred = _inferred(model).graph
        self.shapes = {v.name: [_dim(d) for d in v.type.tensor_type.shape.dim]
                       for v in [*inferred.value_info, *inferred.input, *inferred.output]
                       if v.type.tensor_type.HasField("shape")}
        self.rows = self.shapes.get(contract.INPUT_IDS, [])[:2]  # the symbolic [B, T]
        self.array = numpy_helper.to_array
        self.consts: dict[str, np.ndarray] = {}
        self.head, self.body = [], []
        self.packed = {contract.INPUT_IDS: contract.INPUT_IDS + "/packed"}  # name -> its packed tensor [N, ...]
        self.rank = {contract.INPUT_IDS: 2}  # name -> rank of its [B, T, ...] tensor (packed: one less)
        self.unpacked = {contract.INPUT_IDS: contract.INPUT_IDS}  # name -> its [B, T, ...] tensor, once made
        self.replaced: set[str] = set()  # axes constants replaced by -1

    def const(self, name: str, value) -> str:
        self.consts[PREFIX + "const/" + name] = np.asarray(value, np.int64)
        return PREFIX + "const/" + name

    def node(self, op: str, inputs: list[str], outputs: list[str], **attrs):
        from onnx import helper

        return helper.make_node(op, inputs, outputs, name=PREFIX + outputs[0], **attrs)

    def value(self, name: str):
        t = self.small.get(name)
        return None if t is None else self.array(t)

    def aligned(self, name: str) -> bool:
        """A [B, T, ...] tensor of the step (by shape inference's symbolic dims)."""
        shape = self.shapes.get(name)
        return shape is not None and len(shape) >= 2 and shape[:2] == self.rows and name not in self.static

    def start(self) -> None:
        from onnx import TensorProto

        p, n = PREFIX, self.node
        self.head += [
            n("Equal", [contract.POSITION_IDS, self.const("hole", contract.HOLE_POSITION)], [p + "hole"]),
            n("Not", [p + "hole"], [p + "real"]),  # [B, T]
            n("NonZero", [p + "real"], [p + "nonzero"]),  # [2, N]
            n("Transpose", [p + "nonzero"], [p + "real_rows"], perm=[1, 0]),
            n("Shape", [p + "real_rows"], [p + "shape"]),
            n("Slice", [p + "shape", self.const("zero1", [0]), self.const("one1", [1])], [p + "n"]),  # [N]
            # a hole takes packed row 0's garbage (the first real row's); a step of holes alone packs row (0, 0)
            n("Max", [p + "n", self.const("one1", [1])], [p + "n_kept"]),
            n("Concat", [p + "real_rows", self.const("stand_in", [[0, 0]])], [p + "rows_or_stand_in"], axis=0),
            n("Slice", [p + "rows_or_stand_in", self.const("zero1", [0]), p + "n_kept"], [p + "keep"]),  # [N, 2]
            n("Reshape", [p + "real", self.const("flat", [-1])], [p + "real_flat"]),
            n("Cast", [p + "real_flat"], [p + "real64"], to=TensorProto.INT64),
            n("CumSum", [p + "real64", self.const("zero", 0)], [p + "count"]),
            n("Sub", [p + "count", self.const("one", 1)], [p + "slot"]),
            n("Where", [p + "real_flat", p + "slot", self.const("zero", 0)], [p + "source_flat"]),
            n("Shape", [contract.POSITION_IDS], [p + "bt"]),
            n("Reshape", [p + "source_flat", p + "bt"], [p + "source"]),  # [B, T]: each row's packed row
            n("GatherND", [contract.INPUT_IDS, p + "keep"], [self.packed[contract.INPUT_IDS]]),  # [N]
        ]

    def pack(self, name: str) -> str:
        """The packed [N, ...] tensor of a [B, T, ...] one."""
        if name not in self.packed:
            self.body.append(self.node("GatherND", [name, PREFIX + "keep"], [name + "/packed"]))
            self.packed[name], self.rank[name] = name + "/packed", len(self.shapes[name])
            self.unpacked.setdefault(name, name)
        return self.packed[name]

    def unpack(self, name: str, out: str | None = None) -> str:
        """The [B, T, ...] tensor of a packed one (a hole's rows: packed row 0's garbage), made once."""
        if name not in self.unpacked:
            out = out or name + "/unpacked"
            self.body.append(self.node("Gather", [self.packed[name], PREFIX + "source"], [out], axis=0))
            self.unpacked[name] = out
        return self.unpacked[name]

    def weight_op(self, node) -> bool:
        return node.op_type in WEIGHT_OPS and all(i == "" or i in self.static for i in node.input[1:])

    def row_by_row(self, node) -> bool:
        from onnx import helper

        op, inputs = node.op_type, list(node.input)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op in ROW_OPS:
            return all(i == "" or i in self.packed or self.aligned(i) or len(self.dims.get(i, [0, 0])) <= 1
                       for i in inputs)
        if op in LAST_AXIS:  # over the last axis only, which stays the last (made -1 by rewrite)
            axes = attrs.get("axes", attrs.get("axis"))
            if axes is None and len(inputs) > 1:
                axes = self.value(inputs[1])
            rank = self.rank.get(inputs[0])
            keeps_dims = op in ("Softmax", "LogSoftmax") or attrs.get("keepdims", 1) == 1
            return axes is not None and rank is not None and keeps_dims and \
                all(a in (-1, rank - 1) for a in np.atleast_1d(axes).tolist())
        if op in WEIGHT_OPS:
            return self.weight_op(node) and (inputs[0] in self.packed or self.aligned(inputs[0]))
        if op == "Gather":  # an embedding lookup: packed ids -> packed rows
            return inputs[0] in self.static and attrs.get("axis", 0) == 0 and inputs[1] in self.packed
        return False

    def rewrite(self, node) -> None:
        from onnx import helper

        inputs = list(node.input)
        if not (any(i in self.packed for i in inputs) or (self.weight_op(node) and self.aligned(inputs[0]))):
            self.body.append(node)
            return
        if self.row_by_row(node):
            new = [self.packed[i] if i in self.packed else self.pack(i) if i and self.aligned(i) else i for i in inputs]
            if node.op_type in LAST_AXIS:  # the packed tensor has one axis less: name the last one -1
                for a in node.attribute:
                    if a.name in ("axis", "axes"):
                        a.CopyFrom(helper.make_attribute(a.name, -1 if a.name == "axis" else [-1]))
                if len(new) > 1 and new[1] and np.atleast_1d(self.value(new[1])).tolist() != [-1]:
                    self.replaced.add(new[1])
                    new[1] = self.const("last", [-1])
            if node.op_type == "Gather":
                rank = len(self.dims[inputs[0]]) + self.rank[inputs[1]] - 1
            else:
                rank = max(self.rank.get(i, len(self.shapes[i]) if self.aligned(i) else 0) for i in inputs)
            for out in node.output:
                self.packed[out] = out + "/packed"
                self.rank[out] = len(self.shapes[out]) if out in self.shapes else rank
            outs = [self.packed[o] for o in node.output]
            del node.output[:]
            node.output.extend(outs)
        else:
            new = [self.unpack(i) if i in self.packed else i for i in inputs]
        del node.input[:]
        node.input.extend(new)
        self.body.append(node)

    def finish(self) -> None:
        from onnx import numpy_helper

        graph = self.model.graph
        for out in graph.output:
            if out.name in self.packed:
                made = self.unpack(out.name, out=out.name)
                if made != out.name:  # unpacked already for another op
                    self.body.append(self.node("Identity", [made], [out.name]))
        del graph.node[:]
        graph.node.extend(self.head + self.body)
        used = {i for n in graph.node for i in n.input}
        kept = [t for t in graph.initializer if t.name in used or t.name not in self.replaced]  # (ONNX Runtime warns
        del graph.initializer[:]  # of an initializer nothing reads)
        graph.initializer.extend(kept + [numpy_helper.from_array(v, k) for k, v in self.consts.items() if k in used])
        # a packed tensor has a name of its own (and no declared shape): a name still made keeps its shape
        made = {o for n in graph.node for o in n.output}
        kept = [v for v in graph.value_info if v.name in made]
        del graph.value_info[:]
        graph.value_info.extend(kept)


def _inferred(model):
    """Shape inference over the graph without its weights' data (a copy of hundreds of MB otherwise; shapes need
    only their dims)."""
    from onnx import ModelProto, TensorProto, shape_inference

    skeleton = ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    g = skeleton.graph
    for field in ("node", "input", "output", "value_info"):
        getattr(g, field).extend(getattr(model.graph, field))
    g.initializer.extend(t if t.ByteSize() <= SMALL_BYTES
                         else TensorProto(name=t.name, dims=t.dims, data_type=t.data_type)
                         for t in model.graph.initializer)
    return shape_inference.infer_shapes(skeleton)


def _dim(d) -> str | int | None:
    return d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None


def packed_source(position_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """The host's twin of the graph's packing (_Packer.start) for a step of these position_ids: each row's packed row
    [B, T] (a hole: 0) and how many rows are packed (a step of holes alone packs one stand-in)."""
    real = np.asarray(position_ids) != contract.HOLE_POSITION
    slot = np.cumsum(real.ravel()).reshape(real.shape) - 1
    return np.where(real, slot, 0).astype(np.int64), max(int(real.sum()), 1)


def pack_rows(model) -> bool:
    """Rewrite step graph `model` (an onnx ModelProto; external data need not be loaded) in place so that its
    token-wise ops skip hole rows; False (left as it is) for a graph without the step's input_ids / position_ids,
    with B and T not symbolic, or packed already."""
    names = {i.name for i in model.graph.input}
    if contract.INPUT_IDS not in names or contract.POSITION_IDS not in names \
            or any(n.name.startswith(PREFIX) for n in model.graph.node):
        return False
    packer = _Packer(model)
    if len(packer.rows) < 2 or not all(isinstance(d, str) and d for d in packer.rows):
        return False  # B and T must be dynamic (symbolic) for [B, T, ...] tensors to be told apart
    packer.start()
    for node in list(model.graph.node):
        packer.rewrite(node)
    packer.finish()
    return True
