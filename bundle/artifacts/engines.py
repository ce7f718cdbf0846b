"""engines.json and trt-engines.json (`specrt build`): static-shape engines and TensorRT plans, and the environment
they were built in."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from specrt.bundle.artifacts.base import Artifact
from specrt.bundle.machine import Machine
from specrt.errors import InvalidRequestError


@dataclass(frozen=True)
class EngineSet(Artifact):
    """Static-shape steps of both models: one per token-count profile and batch bucket, over one static KV
    capacity; on CUDA each is captured as a CUDA graph when the bundle is loaded (a graph cannot be stored),
    so the file records what was built and checked, and where. TensorRT engines will share the profile table."""

    FILE: ClassVar[str] = "engines.json"
    FORMAT: ClassVar[int] = 4  # 2: quant; 3: compile, spans; 4: kind "static" (was "graphs")
    PER_VARIANT: ClassVar[bool] = True  # each scheme's engines (`specrt build --quant S`) at quant/S/engines.json
    COMMAND: ClassVar[str] = "specrt build --bundle {bundle}"

    kind: str  # "static": the step module at static shapes (CUDA graphs on CUDA, eager on the CPU)
    token_profiles: tuple[int, ...]  # the largest new-token count of each profile, ascending
    batch_buckets: tuple[int, ...]  # the largest batch of each bucket, ascending
    capacity: int  # static KV cache capacity (positions per sequence)
    # attention spans, ascending, the last the capacity: a step whose sequences' cached contexts fit span s attends
    # over the static cache's first s slots only (graphs; trt: (capacity,), its profiles range over the cache size)
    spans: tuple[int, ...]
    slots: int  # calls served at once (each holds a static cache per model)
    device: str  # "cpu" or "cuda:N"
    device_name: str | None  # the GPU's name
    compute_capability: str | None  # e.g. "9.0"
    versions: dict[str, str]  # torch (and cuda) versions the engines were built with
    cuda_graphs: bool  # captured as CUDA graphs (False on the CPU: the same static steps, run eagerly)
    build_seconds: dict[str, float]  # per model: capture (or warm-up) and check time
    parity: dict[str, float]  # per model: max |logit| difference, padded static step vs eager step
    # graphs: the projections' 8-bit scheme (model/quant.py: int8-wo, fp8); trt: the quantized variant's Q/DQ graphs
    # the plans were built from (`specrt quantize`); None: the weights as exported
    quant: str | None
    weight_bytes: dict[str, int]  # per model: the bytes of its weights as the engines hold them (the roofline's)
    # graphs: the torch.compile mode of the decoder layers (contract.TORCH_COMPILE_MODES), None: eager; trt: None
    compile: str | None
    # graphs: the projections merged where they read one input (contract.PROJECTIONS; StepModule.fuse_projections)
    projections: str = field(default="none", kw_only=True)  # keyword-only: TrtEngineSet's fields follow

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        device = f" --device {machine.device}" if machine and machine.device != "cpu" else ""
        return f"specrt build --bundle {bundle}{device}"

    def table(self) -> str:
        return (f"token profiles {', '.join(map(str, self.token_profiles))}; batch buckets "
                f"{', '.join(map(str, self.batch_buckets))}; capacity {self.capacity}; {self.slots} slot(s)")

    def describe(self) -> str:
        """What `specrt build` made, a line for the set and one per model."""
        what = "CUDA graphs" if self.cuda_graphs else "static steps, no CUDA graphs on the CPU"
        what += f"; decoder layers torch.compile'd ({self.compile})" if self.compile else ""
        what += f"; projections merged: {self.projections}" if self.projections != "none" else ""
        spans = f"; attention spans {', '.join(map(str, self.spans))}" if len(self.spans) > 1 else ""
        lines = [f"{len(self.token_profiles) * len(self.batch_buckets) * len(self.spans)} shapes per model and slot "
                 f"({what}) on {self.device_name or self.device}: {self.table()}{spans}"]
        lines += [f"{role}: built and checked in {self.build_seconds[role]:.1f} s; {self.weight_bytes[role] / 2**20:.1f} "
                  f"MiB of weights{' (' + self.quant + ')' if self.quant else ''}; static vs eager step: max |logit err| "
                  f"{self.parity[role]:.2e}" for role in self.build_seconds]
        return "\n".join(lines)

    def load_flags(self) -> str:
        """The Pipeline.load flags that run these engines."""
        return f"--backend {self.kind}" + (f" --quant {self.quant}" if self.quant and self.PER_VARIANT else "")

    def for_tokens(self, num_tokens: int) -> int:
        """The profile (its largest token count) a step of num_tokens new tokens per sequence runs at."""
        for t in self.token_profiles:
            if num_tokens <= t:
                return t
        raise InvalidRequestError(f"a step of {num_tokens} new tokens exceeds the engines' largest profile "
                          f"({self.token_profiles[-1]}): rebuild with a larger --token-profiles entry")

    def for_context(self, length: int) -> int:
        """The attention span a step over cached contexts of at most `length` rows runs at."""
        for s in self.spans:
            if length <= s:
                return s
        raise InvalidRequestError(f"a context of {length} cached rows exceeds the engines' capacity ({self.capacity})")

    def for_batch(self, batch: int) -> int:
        """The batch bucket a step of `batch` sequences runs at."""
        for b in self.batch_buckets:
            if batch <= b:
                return b
        raise InvalidRequestError(f"a batch of {batch} exceeds the engines' largest batch bucket ({self.batch_buckets[-1]}): "
                          "rebuild with a larger --batch-buckets entry")

    def mismatch(self) -> str | None:
        here = environment(self.device)
        built = (self.versions, self.device_name, self.compute_capability)
        if built != (here["versions"], here["device_name"], here["compute_capability"]):
            return (f"was built with {_describe_env(self.versions, self.device_name, self.compute_capability)}, but this is "
                    f"{_describe_env(here['versions'], here['device_name'], here['compute_capability'])}")
        return None


def environment(device: str, tensorrt: bool = False) -> dict:
    """What built engines depend on: the libraries (torch and CUDA; or TensorRT, None where it does not import),
    the GPU's name and compute capability."""
    if tensorrt:
        try:
            import tensorrt as trt

            versions = {"tensorrt": trt.__version__}
        except (ImportError, OSError):
            versions = {"tensorrt": None}
    else:
        import torch

        versions = {"torch": torch.__version__}
        if device.startswith("cuda"):
            versions["cuda"] = str(torch.version.cuda)
    name = capability = None
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        if torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
            name = torch.cuda.get_device_name(dev)
            capability = "{}.{}".format(*torch.cuda.get_device_capability(dev))
    return {"versions": versions, "device_name": name, "compute_capability": capability}


def _describe_env(versions: dict, name: str | None, capability: str | None) -> str:
    libs = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return f"{libs} on {name} (compute capability {capability})" if name else f"{libs} on the CPU"


# -- trt-engines.json -----------------------------------------------------------------------------
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


@dataclass(frozen=True)
class TrtEngineSet(EngineSet):
    """TensorRT engines of both models (`specrt build --backend trt`): one serialized plan per model under trt/,
    built from the bundle's step ONNX as a strongly typed network (the export's dtype is the engine's), with one
    optimization profile per token-count range of the profile table (over batch 1..largest bucket and KV
    capacity 1..capacity), repeated per slot (concurrent contexts never share a profile). A plan runs only
    with the TensorRT version and on the GPU it was built for, unless built version- or hardware-compatible."""

    FILE: ClassVar[str] = "trt-engines.json"
    FORMAT: ClassVar[int] = 3  # 2: compile (None), spans ((capacity,)); 3: kv_update "inplace" (was "graph")
    PER_VARIANT: ClassVar[bool] = False  # one set of plans, built from the variant `quant` names
    COMMAND: ClassVar[str] = "specrt build --bundle {bundle} --backend trt"

    plans: dict[str, str]  # role -> plan file, relative to the bundle
    plan_bytes: dict[str, int]
    plan_sha256: dict[str, str]
    profiles: dict[str, tuple[dict[str, tuple[tuple[int, ...], ...]], ...]]  # role -> per range: input -> (min, opt, max)
    hardware_compatibility: str  # HARDWARE_COMPATIBILITY
    version_compatible: bool  # runs with later TensorRT versions (TensorRT's lean runtime in the plan)
    workspace_bytes: int
    kv_update: str = "runtime"  # "inplace": built from `specrt inplace`'s graphs (a static cache the engine writes)

    @classmethod
    def command(cls, bundle: Path, machine: Machine | None = None, reason: str = "missing") -> str:
        device = f" --device {machine.device}" if machine and machine.device != "cpu" else ""
        return f"specrt build --bundle {bundle} --backend trt{device}"

    def describe(self) -> str:
        lines = [f"TensorRT {self.versions['tensorrt']} plans on {self.device_name or self.device}, "
                 f"{len(self.token_profiles) * self.slots} optimization profiles per model: {self.table()}"]
        lines += [f"{role}: {self.plans[role]} ({self.plan_bytes[role] / 2**20:.1f} MiB) built and checked in "
                  f"{self.build_seconds[role]:.1f} s; TensorRT vs eager step: max |logit err| {self.parity[role]:.2e}"
                  for role in self.build_seconds]
        return "\n".join(lines)

    def profile_index(self, num_tokens: int, slot: int = 0) -> int:
        """The optimization profile a step of num_tokens new tokens per sequence runs at, in slot `slot`."""
        return slot * len(self.token_profiles) + self.token_profiles.index(self.for_tokens(num_tokens))

    def mismatch(self) -> str | None:
        here = environment(self.device, tensorrt=True)
        built_v, here_v = self.versions.get("tensorrt"), here["versions"]["tensorrt"]
        fallback = "(the ONNX step graphs still run with --backend ort)"
        if here_v is None:
            return f"needs TensorRT {built_v}, which does not import here {fallback}"
        # a version-compatible plan runs with later releases of its major version (TensorRT's support matrix)
        here_t, built_t = _version_tuple(here_v), _version_tuple(built_v)
        version_ok = here_v == built_v or (self.version_compatible and here_t >= built_t and here_t[:1] == built_t[:1])
        cc, built_cc = here["compute_capability"], self.compute_capability
        if self.hardware_compatibility == "ampere_plus":
            gpu_ok = cc is not None and _version_tuple(cc) >= (8, 0)
        elif self.hardware_compatibility == "same_compute_capability":
            gpu_ok = cc == built_cc
        else:
            gpu_ok = (cc, here["device_name"]) == (built_cc, self.device_name)
        if version_ok and gpu_ok:
            return None
        return (f"was built with {_describe_env(self.versions, self.device_name, built_cc)}, but this is "
                f"{_describe_env(here['versions'], here['device_name'], cc)} {fallback}")
