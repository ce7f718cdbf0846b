"""inplace.json (`specrt inplace`): step graphs that write their K/V into the cache in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specrt.bundle.artifacts.base import Artifact


@dataclass(frozen=True)
class InPlaceGraph:
    """One model's in-graph variant of its step graph (contract.py, kv_update "inplace")."""

    file: str  # relative to the bundle
    bytes: int  # of the graph and its external data
    sha256: str  # of the graph file
    opset: int
    parity: dict  # cases, max |logit| and |K/V| difference against the PyTorch step module, tolerance
    seconds: float  # export and check


@dataclass(frozen=True)
class InPlaceGraphs(Artifact):
    """Step graphs whose cache update is in the graph (`specrt inplace`): ONNX TensorScatter + Attention (opset
    24), which ONNX Runtime runs in place on the CPU and TensorRT >= 10.15 imports as IKVCacheUpdateLayer and
    IAttention. Run with --kv-update inplace."""

    FILE: ClassVar[str] = "inplace.json"
    FORMAT: ClassVar[int] = 1
    COMMAND: ClassVar[str] = "specrt inplace --bundle {bundle}"

    graphs: dict[str, InPlaceGraph]  # role -> graph
