"""8-bit weights for the PyTorch step (backends torch and static): the decoder layers' projections swapped for
quantized linears when a backend loads the checkpoint, so the bundle stores nothing new (`specrt build --quant S`
records the scheme in quant/S/engines.json). Quantizing the 148M-parameter inflated target on this project's
2-core CPU took 2.1 s (int8-wo) and 0.6 s (fp8), QuantReport.seconds of one load each; not yet timed on a GPU.

    int8-wo  weight-only INT8: each output channel's weights symmetric int8 with one scale; activations stay
             in the model's dtype; torch._weight_int8pack_mm (CPU; CUDA in recent PyTorch releases).
    fp8      FP8 e4m3 weights and activations (W8A8): a scale per output channel of the weights and per row of
             the activations (its own max |x| / 448), torch._scaled_mm with row-wise scales (CUDA compute
             capability >= 8.9, e.g. H100; PyTorch also runs it on the CPU, which is how it is tested here).

Both compute each token's row on its own (no scale is shared between rows), so a verify step of T tokens
computes what T one-token steps compute, and every lossless method stays token-identical to greedy
autoregressive decoding of the same quantized target (tested). As with float weights, a kernel for another row
count may sum in another order; with FP8 activations such a difference can move an activation onto the
neighbouring 8-bit step, and the logits by that step's share (6e-3 per unit of the largest logit on the demo
target, engines/graphs.QUANT_TOL): a greedy token changes only where its two best logits are that close.

Quantized: q/k/v/o and the MLP's projections of every layer. Kept in the model's dtype: embeddings, norms,
attention's products, the rotary product and the LM head (it decides each greedy token directly; in Llama-2-7B
it is 32000 x 4096 of 6.7B weights, 2%).
A layer whose shape the kernel cannot take (fp8: both dimensions multiples of 16) stays as it was, counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from specrt.contract import TORCH_QUANT_SCHEMES as TORCH_SCHEMES
from specrt.errors import InvalidRequestError, SpecrtError

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_TINY = 1e-12  # floor of a scale: an all-zero row or channel quantizes to zeros, not NaN


def _channel_scales(weight: torch.Tensor, top: float) -> torch.Tensor:
    """[N] float32: each output channel's max |w| / top."""
    return (weight.float().abs().amax(dim=1) / top).clamp(min=_TINY)


class Int8WeightLinear(nn.Module):
    """y = x @ (w_int8 * scale).T + b with w_int8 [N, K] and one scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = _channel_scales(w, 127.0)
        self.register_buffer("weight", (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(w.dtype))
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x):
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Fp8Linear(nn.Module):
    """y = (q(x) @ w_fp8.T) * (sx * sw) + b: e4m3 weights with a scale per output channel, e4m3 activations
    with a scale per row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = _channel_scales(w, FP8_MAX)
        self.register_buffer("weight", (w.float() / scale[:, None]).to(torch.float8_e4m3fn))  # [N, K]
        self.register_buffer("scale", scale[None])  # [1, N] float32
        self.bias = linear.bias
        self.out_features = linear.out_features
        self.out_dtype = w.dtype

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        sx = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=torch.finfo(rows.dtype).tiny)  # [M, 1]
        q = (rows / sx).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=sx.float(), scale_b=self.scale, out_dtype=self.out_dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class QuantReport:
    """What quantize_step did: layers swapped, layers left (the kernel could not take their shape), the bytes of
    the model's weights before and after, and the time it took."""

    scheme: str
    quantized: int
    kept: int
    bytes_before: int
    bytes_after: int
    seconds: float


def _fits(scheme: str, linear: nn.Linear) -> bool:
    return scheme != "fp8" or (linear.in_features % 16 == 0 and linear.out_features % 16 == 0)


def module_bytes(module: nn.Module, streamed: bool = False) -> int:
    """Bytes of a module's parameters and buffers; `streamed`: those a one-token step reads (the roofline's), an
    embedding table no other module shares (untied) left out, since a step looks up a row of it
    (graphs/passes.graph_bytes's rule)."""
    skip = set()
    if streamed:
        tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        shared = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding)
                  for p in m.parameters(recurse=False)}
        skip = tables - shared
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if id(t) not in skip)


def _refusal(linear: nn.Module, dtype: torch.dtype) -> str | None:
    """Why this PyTorch build cannot run a quantized linear on its device, in one line, or None."""
    x = torch.zeros((2, linear.weight.shape[1]), dtype=dtype, device=linear.weight.device)
    try:
        with torch.inference_mode():
            linear(x)
    except (RuntimeError, NotImplementedError) as e:
        scheme = "int8-wo" if isinstance(linear, Int8WeightLinear) else "fp8"
        return f"PyTorch {torch.__version__} cannot run {scheme} linears on {x.device} ({str(e).splitlines()[0]})"
    return None


def kernel_refusal(scheme: str, device: str = "cpu", dtype: str = "float32") -> str | None:
    """Why this PyTorch build cannot run `scheme`'s linears on `device` (e.g. torch 2.11 takes only per-tensor FP8
    scales on the CPU), or None: what a caller checks before quantizing, and tests skip on."""
    cls = Int8WeightLinear if scheme == "int8-wo" else Fp8Linear
    return _refusal(cls(nn.Linear(32, 32, device=device, dtype=getattr(torch, dtype))), getattr(torch, dtype))


def quantize_step(step_module: nn.Module, scheme: str) -> QuantReport:
    """Swap the projections of step_module's decoder layers (a StepModule's `hf.model.layers`) for `scheme`'s
    quantized linears, in place, and check one on the module's device (a PyTorch build without the kernel is
    refused here, with one clear line, not at the first decode step)."""
    if scheme not in TORCH_SCHEMES:
        raise InvalidRequestError(f"unknown PyTorch quantization scheme {scheme!r} (choose from {', '.join(TORCH_SCHEMES)})")
    cls = Int8WeightLinear if scheme == "int8-wo" else Fp8Linear
    t0 = time.perf_counter()
    before = module_bytes(step_module)
    quantized = kept = 0
    probe = None
    for layer in step_module.hf.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                if not _fits(scheme, child):
                    kept += 1
                    continue
                swapped = cls(child)
                setattr(parent, name, swapped)
                quantized += 1
                if probe is None:
                    probe = swapped
    if probe is not None:
        why = _refusal(probe, next(step_module.hf.parameters()).dtype)
        if why:
            raise SpecrtError(why)
    return QuantReport(scheme, quantized, kept, before, module_bytes(step_module), round(time.perf_counter() - t0, 3))


def load_step_module(hf_dir, dtype: str, device: str, prompt_embeddings=None, quant: str | None = None,
                     hidden: bool = False):
    """(StepModule of the checkpoint in hf_dir, in eval mode on `device`, QuantReport or None): what the torch
    and static backends run; `quant` one of TORCH_SCHEMES or None (the weights as exported); `hidden`: its last hidden
    state an output too (a draft head's step always has it: model/eagle.py)."""
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.eagle import step_module

    prompts = None if prompt_embeddings is None else torch.from_numpy(prompt_embeddings)
    module = step_module(load_checkpoint(hf_dir, dtype, device), hidden, prompts).eval()
    return module, None if quant is None else quantize_step(module, quant)
