"""The 8-bit PyTorch schemes a test may run here: each skipped, with PyTorch's own reason, where the installed build
cannot run its kernel on the device (torch 2.11's CPU `_scaled_mm` takes only per-tensor scales, not FP8's rows)."""

import pytest

from specrt.contract import TORCH_QUANT_SCHEMES


def needs_kernel(scheme: str, device: str = "cpu") -> None:
    from specrt.model.quant import kernel_refusal

    why = kernel_refusal(scheme, device)
    if why:
        pytest.skip(why)


def quant_schemes(device: str = "cpu") -> list:
    """TORCH_QUANT_SCHEMES as pytest parameters, each marked to skip where this PyTorch cannot run it on `device`."""
    from specrt.model.quant import kernel_refusal

    return [pytest.param(s, marks=pytest.mark.skipif(bool(why := kernel_refusal(s, device)), reason=why or ""))
            for s in TORCH_QUANT_SCHEMES]
