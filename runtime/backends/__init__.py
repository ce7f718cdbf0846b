"""Backends: OrtBackend (ONNX Runtime, the CPU default), TorchBackend (PyTorch eager, CUDA where present),
StaticTorchBackend ("static": static-shape steps per the bundle's engines.json, CUDA graphs on CUDA) and
TrtBackend ("trt": TensorRT plans per the bundle's trt-engines.json, CUDA only).

`load_backend` resolves what the caller left open (threads, device) the same way everywhere, so a
latency profile measured with the defaults matches a Pipeline loaded with the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrt.bundle.manifest import ModelEntry
from specrt.config import Config, option
from specrt.contract import KV_UPDATES
from specrt.errors import InvalidRequestError
from specrt.runtime.backends.base import Backend, Runner
from specrt.runtime.backends.kinds import BACKENDS, KINDS, BackendKind, backend_kind, kinds_that

__all__ = ["BACKENDS", "Backend", "BackendKind", "BackendOptions", "Runner", "ThreadOptions", "backend_kind",
           "load_backend", "resolve_device"]


@dataclass(frozen=True)
class ThreadOptions(Config):
    threads: int | None = option(None, "intra-op threads (default: every core this process may use)", ge=1)


@dataclass(frozen=True)
class BackendOptions(ThreadOptions):
    """Which backend runs the step graphs, where: Pipeline.load's arguments, shared by every verb that runs one."""

    backend: str = option("ort", "; ".join(f"{k.name} = {k.help}" for k in KINDS.values()), choices=BACKENDS)
    device: str | None = option(None, "torch device, e.g. cuda:0 (default: CUDA where present, else cpu)")
    quant: str | None = option(None, "run a quantized variant of the step graphs (`specrt quantize`; ort backend): "
                                     "int8-weights, int4-weights, dynamic-int8 or static-int8; torch backend: 8-bit "
                                     "projections, int8-wo or fp8 (static: the scheme its engines were built with); "
                                     "plan: the one plan.json picked (`specrt tune --variants`)")
    kv_update: str = option("runtime", "runtime = the step graphs return new K/V and the runtime writes the accepted "
                                       "rows; inplace = their in-graph variants (`specrt inplace`) write them into the "
                                       "cache in place (ort backend)", choices=KV_UPDATES)
    packed_rows: bool = option(True, "ort backend: leave a ragged batch's holes out of the step's token-wise work "
                                     "(graphs/packed_rows.py); --no-packed-rows saves the packing's gathers where sequences "
                                     "are decoded one at a time (docs/batching.md)")

    def pipeline_options(self) -> dict:
        """Pipeline.load's keyword arguments for these options (and, in a config that also names a bundle, --verify)."""
        from specrt.bundle.manifest import BundleOptions

        verify = {"verify": self.verify_mode} if isinstance(self, BundleOptions) and isinstance(self.verify, str) else {}
        return {"backend": self.backend, "threads": self.threads, "device": self.device, "quant": self.quant,
                "kv_update": self.kv_update, "packed_rows": self.packed_rows, **verify}


def resolve_device(backend: str, device: str | None) -> str:
    """"cpu" or "cuda:N" for this backend, refusing what cannot run here with one clear line."""
    kind = backend_kind(backend)
    if device is not None and not isinstance(device, str):
        raise InvalidRequestError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    if kind.devices == ("cpu",):
        if device not in (None, "cpu"):
            raise InvalidRequestError(f"device {device!r}: the {backend} backend runs on the CPU here (use backend "
                                      f"{kinds_that(lambda k: 'cuda' in k.devices)} for a "
                                      "CUDA device)")
        return "cpu"
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidRequestError(f"device {device!r} is not a device PyTorch knows (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if dev.type == "cpu":
        if "cpu" not in kind.devices:
            raise InvalidRequestError(f"{kind.title} runs on a CUDA device, not the CPU (the ONNX step graphs "
                                      f"run on the CPU with --backend "
                                      f"{kinds_that(lambda k: k.host_cores)})")
        return "cpu"
    if dev.type != "cuda":
        raise InvalidRequestError(f"device {device!r}: specrt runs on 'cpu' or 'cuda' devices")
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {device!r}: PyTorch {torch.__version__} finds no CUDA device on this machine")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise InvalidRequestError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


@dataclass(frozen=True)
class ModelSource:
    """What one model's backend is made from, resolved (runtime/loader.py): its manifest entry, `threads` and
    `device`; `engines` (an EngineSet) for kind "static", a TrtEngineSet for kind "trt"; `graph` (kind "ort"): the
    step graph to run instead of the exported one (a quantized variant, or the target with PPD's prompt tokens),
    relative to the bundle; `prompt_embeddings` (kinds "torch" and "static"): PPD's prompt tokens, [P, hidden];
    kv_update "inplace" (kind "ort"): `graph` is an in-graph variant (contract.py); `quant` (kind "torch"): 8-bit
    projections (contract.TORCH_QUANT_SCHEMES; kind "static" takes its engines' scheme); `packed_rows` (kind "ort"):
    whether a ragged step's holes are left out (graphs/packed_rows.py)."""

    entry: ModelEntry
    threads: int
    device: str
    engines: object | None = None
    graph: str | None = None
    prompt_embeddings: object | None = None
    kv_update: str = "runtime"
    quant: str | None = None
    packed_rows: bool = True


def load_backend(kind: str, bundle: Path, source: ModelSource) -> Backend:
    """A backend of kind `kind` for one model of `bundle`, made from `source`."""
    return backend_kind(kind).loads(bundle, source)
