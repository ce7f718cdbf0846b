"""quant.json (`specrt quantize`): 8-bit variants of the step graphs for ONNX Runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from specrt.bundle.artifacts.base import Artifact
from specrt.bundle.machine import Machine
from specrt.bundle.manifest import verify_files
from specrt.errors import BundleError


@dataclass(frozen=True)
class QuantVariant:
    """One model's quantized step graph."""

    file: str  # relative to the bundle
    bytes: int  # of the graph and its external data
    sha256: str  # of the graph file
    source_sha256: str  # of the step graph it was made from (the manifest's; an in-graph twin's: inplace.json's)
    source_bytes: int
    quantized_nodes: int  # MatMul nodes with 8-bit weights
    seconds: float
    calibration: dict | None  # static schemes: held-out text (corpus hash, prompts, tokens, seed); None: dynamic
    kept: tuple[str, ...] = ()  # projections left in float by role (`specrt quantize --keep`: down, head)


@dataclass(frozen=True)
class QuantSet(Artifact):
    """Quantized variants of the bundle's step graphs (`specrt quantize`), run by the ort backend with --quant (and
    built into TensorRT plans: `specrt build --backend trt --quant int8-qdq`)."""

    FILE: ClassVar[str] = "quant.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt quantize --bundle {bundle}"

    variants: dict[str, dict[str, QuantVariant]]  # scheme -> role -> variant
    # the same of the in-graph step graphs (`specrt inplace`; `specrt quantize --kv-update inplace`), each made from
    # the graph inplace.json names (source_sha256)
    in_graph: dict[str, dict[str, QuantVariant]] = field(default_factory=dict)

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        scheme = f" --scheme {machine.quant}" if machine and machine.quant else ""
        return f"specrt quantize --bundle {bundle}{scheme}"

    def graphs(self, bundle: Path, scheme: str, verify: bool | str = True, sources: dict[str, str] | None = None
               ) -> dict[str, str]:
        """role -> the step graph (relative to the bundle) of variant `scheme`, refused where it is missing or
        (verify) changed since `specrt quantize` wrote it. With `sources` (role -> the sha256 of each in-graph step
        graph, inplace.json's), the variant of the in-graph graphs, refused where it was made from other ones."""
        variants = self.variants if sources is None else self.in_graph
        redo = f"specrt quantize --bundle {bundle} --scheme {scheme}"
        redo += "" if sources is None else " --kv-update inplace"
        if scheme not in variants:
            what, have = "" if sources is None else " in-graph", ", ".join(sorted(variants)) or "none"
            raise BundleError(f"{bundle} has no{what} {scheme} variant (it has: {have}): run `{redo}`")
        for role, v in variants[scheme].items():
            if verify_files(bundle, {v.file: v.sha256}, verify) or not (Path(bundle) / v.file).is_file():
                raise BundleError(f"{Path(bundle) / v.file} is missing or changed since `specrt quantize` wrote it: "
                                  f"re-run `{redo}`")
            if sources is not None and sources.get(role) != v.source_sha256:
                raise BundleError(f"{Path(bundle) / v.file} was quantized from an earlier in-graph {role} graph "
                                  f"(`specrt inplace` made it again since): re-run `{redo}`")
        return {role: v.file for role, v in variants[scheme].items()}
