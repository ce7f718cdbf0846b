"""The backend registry: each backend one `BackendKind` that says what it can do (where it runs, what it loads, which
quantized weights, KV updates and prompt tokens it takes, what `specrt build` makes for it) and how it loads a model.
The rest of the code asks a kind (`backend_kind(name)`), never compares a backend's name (DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specrt.bundle.artifacts import EngineSet, TrtEngineSet
from specrt.contract import KV_UPDATES, TORCH_QUANT_SCHEMES
from specrt.errors import BundleError, InvalidRequestError


@dataclass(frozen=True)
class BackendKind:
    name: str
    title: str  # what it runs on, for messages: "TensorRT"
    help: str  # what --backend NAME means, one clause
    devices: tuple[str, ...]  # the device types it runs on ("cpu", "cuda")
    loads: Callable  # (bundle: Path, source: ModelSource) -> Backend
    step_graphs: bool = False  # runs the ONNX step graphs: a quantized variant, an in-graph variant and the target with
    # PPD's prompt tokens are graph files it swaps in as it loads
    # where its quantized weights come from: "graphs" (`specrt quantize`'s variants of the step graphs) or
    # "projections" (contract.TORCH_QUANT_SCHEMES, the module's projections quantized as it loads)
    quant: str = "graphs"
    kv_updates: tuple[str, ...] = ("runtime",)  # the KV updates it runs (contract.KV_UPDATES)
    engines: type | None = None  # the artifact of its engines (`specrt build --backend NAME`), None: it builds nothing
    kv_update_built: bool = False  # the engines fix the KV update when they are built (--kv-update at build time)
    prompt_tokens: str | None = None  # how PPD's prompt tokens reach it: "graph" | "embeddings" | None: why not
    no_prompt_tokens: str = ""  # why it holds none, where prompt_tokens is None
    packs_rows: bool = False  # leaves a ragged step's holes out of the token-wise work (graphs/packed_rows.py)
    compiles_layers: bool = False  # its build may torch.compile the decoder layers (--compile)
    attention_spans: bool = False  # its build makes engines per attention span (--spans)

    @property
    def host_cores(self) -> bool:
        """It runs on the host's cores only: server instances share them, splitting --threads."""
        return self.devices == ("cpu",)

    def check_quant(self, quant: str | None) -> None:
        """Refuse, in one line, a quantization scheme this backend does not run."""
        if quant is None:
            return
        if self.quant == "projections" and quant not in TORCH_QUANT_SCHEMES:
            raise InvalidRequestError(f"quant={quant!r}: the {self.name} backend quantizes its projections with "
                                      f"{' or '.join(TORCH_QUANT_SCHEMES)}; `specrt quantize`'s variants of the step "
                                      f"graphs run on the {kinds_that(lambda k: k.quant == 'graphs', 'and')} backends")
        if self.quant == "graphs" and quant in TORCH_QUANT_SCHEMES:
            raise InvalidRequestError(f"quant={quant!r} quantizes the PyTorch step (backend "
                                      f"{kinds_that(lambda k: k.quant == 'projections')}); "
                                      f"the {self.name} backend runs `specrt quantize`'s variants")

    def check_kv_update(self, kv_update: str) -> None:
        if kv_update not in KV_UPDATES:
            raise InvalidRequestError(f"kv_update must be one of {', '.join(KV_UPDATES)}, got {kv_update!r}")
        if kv_update not in self.kv_updates:
            able = [f"{k.name} (its engines built with --kv-update {kv_update})" if k.kv_update_built else k.name
                    for k in KINDS.values() if kv_update in k.kv_updates]
            raise InvalidRequestError(f"kv_update={kv_update!r} runs on the backends {' and '.join(able)}, "
                                      f"not {self.name!r}")


def kinds_that(can: Callable[[BackendKind], bool], last: str = "or", title: bool = False) -> str:
    """The names (or titles) of the backends that `can`, for a message: "ort, torch or static"."""
    names = [k.title if title else k.name for k in KINDS.values() if can(k)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _ort(bundle: Path, s) -> object:
    from specrt.runtime.backends.ort import OrtBackend

    entry = s.entry
    if not entry.onnx:
        raise BundleError(f"{bundle} has no ONNX step graphs (exported with --no-onnx): load it with backend "
                          f"{kinds_that(lambda k: not k.step_graphs and 'cpu' in k.devices)}"
                          ", or re-export it with the graphs")
    if entry.dtype == "bfloat16":
        raise BundleError(f"{bundle} holds bfloat16 step graphs, which ONNX Runtime cannot run on the CPU (it has no "
                          f"bfloat16 kernels): load it with backend "
                          f"{kinds_that(lambda k: not k.step_graphs)}, or export in float32")
    return OrtBackend(entry, bundle / (s.graph or entry.onnx), threads=s.threads, kv_update=s.kv_update,
                      pack_rows=s.packed_rows)


def _torch(bundle: Path, s) -> object:
    from specrt.runtime.backends.pytorch import TorchBackend

    return TorchBackend(s.entry, bundle / s.entry.hf_dir, device=s.device, threads=s.threads,
                        prompt_embeddings=s.prompt_embeddings, quant=s.quant)


def _static(bundle: Path, s) -> object:
    from specrt.runtime.backends.static import StaticTorchBackend

    return StaticTorchBackend(s.entry, bundle / s.entry.hf_dir, device=s.device, threads=s.threads, engines=s.engines,
                              prompt_embeddings=s.prompt_embeddings)


def _trt(bundle: Path, s) -> object:
    from specrt.runtime.backends.trt import TrtBackend

    return TrtBackend(s.entry, bundle, device=s.device, engines=s.engines)


KINDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("ort", "ONNX Runtime", "ONNX Runtime (CPU)", ("cpu",), _ort, step_graphs=True,
                kv_updates=("runtime", "inplace"), prompt_tokens="graph", packs_rows=True),
    BackendKind("torch", "PyTorch eager", "PyTorch, eager (CUDA where present)", ("cpu", "cuda"), _torch,
                quant="projections", prompt_tokens="embeddings"),
    BackendKind("static", "static engines", "the bundle's static-shape engines (`specrt build`; CUDA graphs on CUDA)",
                ("cpu", "cuda"), _static, quant="projections", engines=EngineSet, prompt_tokens="embeddings",
                compiles_layers=True, attention_spans=True),
    BackendKind("trt", "TensorRT", "its TensorRT engines (`specrt build --backend trt`)", ("cuda",), _trt,
                kv_updates=("runtime", "inplace"), engines=TrtEngineSet, kv_update_built=True,
                no_prompt_tokens="the TensorRT plans hold no prompt tokens"),
)}
BACKENDS = tuple(KINDS)
ENGINE_BACKENDS = tuple(name for name, k in KINDS.items() if k.engines is not None)


def backend_kind(name: str) -> BackendKind:
    """The registered kind of backend `name`, or a one-line refusal naming the choices."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise InvalidRequestError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})") from None
