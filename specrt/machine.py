"""Which machine and backend a measurement was taken on; a plan tuned elsewhere is refused."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(backend: str, threads: int | None, device: str | None = None) -> dict:
    """What latency depends on: processor, cores, GPU (for CUDA devices), backend and threads."""
    fp = {"cpu": cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(), "backend": backend,
          "threads": threads, "gpu": None}
    if backend == "torch":
        import torch

        if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
            fp["gpu"] = torch.cuda.get_device_name(0)
    return fp


def describe(fp: dict) -> str:
    gpu = f", GPU {fp['gpu']}" if fp.get("gpu") else ""
    return f"{fp['cpu']} ({fp['cores']} cores{gpu}), backend {fp['backend']}, {fp['threads']} threads"
