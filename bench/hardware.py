"""What the hardware allows, measured where the bench runs: copy bandwidth (for the roofline) and energy (NVML).

Roofline: decoding one token must read every weight of the target once, so a batch-1 decoder can emit
at most bandwidth / weight bytes tokens per second. Bandwidth is a measured device copy: bytes read plus
bytes written per second, the best of a few copies of a buffer far larger than any cache.
Energy: NVML's total-energy counter of the GPU (millijoules since driver load; Volta and newer), read
around each timed run; nothing on the CPU (no counter that covers only this process).
"""

from __future__ import annotations

import time


def copy_bandwidth(device: str, size_mb: int = 1024, repeats: int = 5) -> float:
    """Bytes per second (read + write) of copying a size_mb buffer on `device` ("cpu" or "cuda:N")."""
    import numpy as np

    n = size_mb * 2**20
    if device.startswith("cuda"):
        import torch

        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return 2 * n / best
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


class EnergyMeter:
    """Joules used by a CUDA device between start() and stop(), from NVML; unavailable (None) elsewhere."""

    def __init__(self, device: str):
        self.why_not = None
        self._handle = None
        if not device.startswith("cuda"):
            self.why_not = "no energy counter on the CPU"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.split(":")[1]) if ":" in device else 0
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception as e:  # no module, no driver, or a GPU without the counter
            self.why_not, self._handle = f"NVML energy counter unavailable ({type(e).__name__}: {e})", None
        self._start = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self.available:
            self._start = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def stop(self) -> float | None:
        """Joules since start(), or None."""
        if not self.available or self._start is None:
            return None
        return (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start) / 1e3
