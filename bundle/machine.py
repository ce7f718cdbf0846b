"""Where a measurement was taken: processor, cores, GPU, backend, threads and device.

Latency profiles and plans are only valid where they were measured; `Machine.here` is what a Pipeline
runs on, with its thread count and device resolved (so `threads=None` means the same number wherever
it is read: the cores this process may use).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from specrt.contract import TORCH_QUANT_SCHEMES
from specrt.errors import InvalidRequestError


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Instruction-set extensions that change what a CPU step costs (8-bit and bfloat16 GEMMs above all), as Linux
# names them in /proc/cpuinfo: x86 "flags", Arm "Features"
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16",
                "asimddp", "i8mm", "sve", "bf16")


def cpu_features() -> tuple[str, ...]:
    """Which of CPU_FEATURES this CPU has (empty where /proc/cpuinfo is not there to say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(x for x in CPU_FEATURES if x in have)
    except OSError:
        pass
    return ()


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Past a few threads per core intra-op threads only wait on each other; thousands of them make ONNX Runtime's session
# creation hang rather than fail
MAX_THREADS_PER_CORE = 4


def resolve_threads(threads: int | None) -> int:
    """The intra-op thread count a backend uses: the given one, else every available core; more than
    MAX_THREADS_PER_CORE per available core is refused."""
    if threads is None:
        return available_cores()
    cores = available_cores()
    if threads > MAX_THREADS_PER_CORE * cores:
        raise InvalidRequestError(f"threads={threads} is more than {MAX_THREADS_PER_CORE} per core of the {cores} this "
                                  f"process may use (at most {MAX_THREADS_PER_CORE * cores})")
    return threads


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    arch: str
    backend: str  # "ort" or "torch"
    threads: int  # intra-op threads, resolved
    device: str  # "cpu" or "cuda:N"
    gpu: str | None = None  # CUDA device name when device is a GPU
    # the quantized variant of the step graphs run (`specrt quantize`), or of the PyTorch step's projections
    # (TORCH_QUANT_SCHEMES: torch and static backends); None: as exported
    quant: str | None = None
    kv_update: str = "runtime"  # "inplace": the step graphs' in-graph variant (`specrt inplace`), another step cost
    packed_rows: bool = True  # False: the ort backend loaded without packed token rows (--no-packed-rows)

    @staticmethod
    def here(backend: str, threads: int, device: str = "cpu", quant: str | None = None,
             kv_update: str = "runtime", packed_rows: bool = True) -> "Machine":
        gpu = None
        if device.startswith("cuda"):
            import torch

            gpu = torch.cuda.get_device_name(torch.device(device))
        return Machine(cpu_model(), os.cpu_count() or 1, platform.machine(), backend, threads, device, gpu, quant,
                       kv_update, packed_rows)

    def describe(self) -> str:
        where = f"GPU {self.gpu} ({self.device})" if self.gpu else self.device
        what = "projections" if self.quant in TORCH_QUANT_SCHEMES else "step graphs"
        quant = f", {self.quant} {what}" if self.quant else ""
        quant += ", in-graph KV update" if self.kv_update == "inplace" else ""
        quant += ", token rows not packed" if not self.packed_rows else ""
        return f"{self.cpu} ({self.cores} cores), backend {self.backend}{quant}, {self.threads} threads, {where}"

    def flags(self) -> str:
        """The CLI flags that select this backend, variant, thread count and device."""
        return (f"--backend {self.backend} --threads {self.threads}" + (f" --device {self.device}" if self.device != "cpu"
                                                                          else "") + (f" --quant {self.quant}" if self.quant else "")
                + (" --kv-update inplace" if self.kv_update == "inplace" else "")
                + ("" if self.packed_rows else " --no-packed-rows"))
