"""Passes over step graphs: structural check, shape inference and the file layout (in place or to a new file);
a float32 copy of a bfloat16 graph for ONNX Runtime on the CPU.

Graphs whose weights exceed what one protobuf file holds (2 GiB) keep them as ONNX external data: the graph
file plus one `<graph>.data` file next to it holding every initializer. Every pass here goes through paths
(onnx.checker and shape inference on the file), so it works on graphs of any size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt import contract
from specrt.errors import SpecrtError

EXTERNAL_THRESHOLD = 1024  # bytes: initializers at least this big go to the external data file


def data_file(graph: Path) -> Path:
    """Where a graph's external data lives (one file per graph)."""
    return graph.with_name(graph.name + ".data")


def save_graph(model, dest: Path, external: bool) -> None:
    """Write `model` to `dest`; where `external`, its tensors to data_file(dest)."""
    import onnx

    data = data_file(dest)
    data.unlink(missing_ok=True)  # save_model appends to an existing data file
    if external:
        onnx.save_model(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=EXTERNAL_THRESHOLD)
    else:
        onnx.save_model(model, str(dest))


def graph_bytes(path: Path, streamed: bool = False) -> int:
    """Bytes of a step graph's weights as ONNX Runtime loads them: every initializer it names, inline or in any
    external data file (a graph may read another's file: PPD's copy of the target reads target.onnx.data beside
    its own embedding table), each stored range counted once; plus the graph's own protobuf beside them.

    streamed: the bytes a one-token step reads (the roofline's): a table that only lookups read (Gather: an untied
    input embedding, PPD's table with its prompt rows) is left out, since a step reads a row of it."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total, ranges = 0, set()
    looked_up = lookup_tables(model.graph) if streamed else set()
    for t in model.graph.initializer:
        if t.name in looked_up:
            total -= len(t.raw_data)  # inline ones are in the protobuf's size, added below
            continue
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue  # inline: inside the protobuf, counted below
        info = {e.key: e.value for e in t.external_data}
        length = int(info["length"])
        key = (info["location"], int(info.get("offset", 0)), length)
        if key not in ranges:
            ranges.add(key)
            total += length
    return path.stat().st_size + total


def lookup_tables(graph) -> set[str]:
    """Initializers every reader of which is a Gather taking them as its table (input 0)."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, i))
    return {t.name for t in graph.initializer
            if readers.get(t.name) and all(op == "Gather" and i == 0 for op, i in readers[t.name])}


def finalize_graph(raw: Path, dest: Path, external: bool) -> None:
    """Check the exported graph `raw` (with any external data next to it), infer its shapes, and write it to
    `dest`: one file, or with `external` the graph and `dest.data` holding every initializer. The contract's
    inputs and outputs must be present."""
    import onnx

    onnx.checker.check_model(str(raw))  # by path: also graphs over 2 GiB
    onnx.shape_inference.infer_shapes_path(str(raw), str(raw))
    model = onnx.load(str(raw))  # external data of the raw export is read from beside it
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for name in (contract.INPUT_IDS, contract.POSITION_IDS, contract.ATTENTION_MASK):
        if name not in inputs:
            raise SpecrtError(f"{raw}: step graph has no input {name!r} (inputs: {sorted(inputs)})")
    if contract.LOGITS not in outputs:
        raise SpecrtError(f"{raw}: step graph has no output {contract.LOGITS!r} (outputs: {sorted(outputs)})")
    save_graph(model, dest, external)


def upcast_bfloat16(src: Path, dest: Path, external: bool) -> None:
    """A float32 copy of a bfloat16 step graph: every bfloat16 initializer, constant, cast and tensor type made
    float32 (the values are the bfloat16 ones, exactly). ONNX Runtime has no bfloat16 kernels on the CPU, so
    this is how the export checks a bfloat16 graph there: the copy must compute what the PyTorch module computes
    in float32 from the same bfloat16 weights, which checks the graph's structure and every weight."""
    import onnx
    from onnx import TensorProto, numpy_helper

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT
    model = onnx.load(str(src))

    def upcast(t: TensorProto) -> TensorProto:
        if t.data_type != bf16:
            return t
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)

    g = model.graph
    for i, t in enumerate(g.initializer):
        g.initializer[i].CopyFrom(upcast(t))
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(upcast(a.t))
            elif a.name == "to" and node.op_type == "Cast" and a.i == bf16:
                a.i = f32
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.tensor_type.elem_type == bf16:
            v.type.tensor_type.elem_type = f32
    save_graph(model, dest, external)
    onnx.checker.check_model(str(dest))


def _array(tensor, base_dir: Path):
    """An initializer's values, its external data read from `base_dir` directly: onnx's own reader refuses a data
    file with several hard links (bundles copied with `cp -al`, deduplicated stores), which is no attack here."""
    from onnx import TensorProto, helper, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    with open(Path(base_dir) / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        raw = f.read(int(info["length"]))
    return np.frombuffer(raw, dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))


def add_prompt_embeddings(src: Path, dest: Path, prompt_embeddings) -> None:
    """`dest`: the step graph `src` with extra rows appended to its input embedding table (PPD's prompt tokens,
    ids V .. V + P - 1); the head and every other weight unchanged. `dest` must sit in `src`'s directory: the
    graph is edited without loading external data, so its other weights stay references into `src`'s data
    file (a large model's prompt-token graph costs the new table, not a second copy of the weights)."""
    import onnx
    from onnx import numpy_helper

    src, dest = Path(src), Path(dest)
    if src.parent.resolve() != dest.parent.resolve():
        raise SpecrtError(f"{dest} must be in the directory of {src} (it shares {src.name}'s external data)")
    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    gathers = [n for n in g.node if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == contract.INPUT_IDS
               and n.input[0] in inits]
    if len(gathers) != 1:
        raise SpecrtError(f"{src}: expected one Gather of the embedding table by {contract.INPUT_IDS!r}, found {len(gathers)}")
    table = inits[gathers[0].input[0]]
    weights = _array(table, src.parent)  # external data read, not moved
    extra = np.asarray(prompt_embeddings, dtype=weights.dtype)
    if extra.ndim != 2 or extra.shape[1] != weights.shape[1]:
        raise SpecrtError(f"prompt embeddings of shape {extra.shape} do not fit the embedding table {weights.shape}")
    name = "ppd.embed_tokens_with_prompts"
    g.initializer.append(numpy_helper.from_array(np.concatenate([weights, extra]), name))
    gathers[0].input[0] = name  # the original table stays for whatever else reads it (a tied head)
    if not any(table.name in n.input for n in g.node):
        g.initializer.remove(next(t for t in g.initializer if t.name == table.name))
    # not onnx.checker: it re-reads the shared data file, refusing hard links; the caller runs the graph instead
    # (engines/ppd.py compares its logits with the source's)
    onnx.save_model(model, str(dest))
