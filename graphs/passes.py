"""Passes over step graphs: structural check and shape inference (in place)."""

from __future__ import annotations

from pathlib import Path

from specrt import contract
from specrt.errors import SpecrtError


def check_and_infer(path: Path) -> None:
    """onnx.checker + shape inference, written back; the contract's inputs and outputs must be present."""
    import onnx

    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    model = onnx.shape_inference.infer_shapes(model)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for name in (contract.INPUT_IDS, contract.POSITION_IDS, contract.ATTENTION_MASK):
        if name not in inputs:
            raise SpecrtError(f"{path}: step graph has no input {name!r} (inputs: {sorted(inputs)})")
    if contract.LOGITS not in outputs:
        raise SpecrtError(f"{path}: step graph has no output {contract.LOGITS!r} (outputs: {sorted(outputs)})")
    onnx.save(model, str(path))
