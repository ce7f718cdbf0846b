"""Energy per token, measured where the bench runs (copy bandwidth, for the roofline: calibration.latency).

Energy: NVML's total-energy counter of the GPU (millijoules since driver load; Volta and newer), read
around each timed run; nothing on the CPU (no counter that covers only this process).
"""

from __future__ import annotations


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
