"""The step module's tensor operations that have two forms: the one its exported graph holds (which ONNX Runtime's
and TensorRT's rewrites match) and, where the module runs in PyTorch (backends torch and static, torch.compile),
one that computes the same numbers in fewer kernels or without copying the cache; and the projections' merge."""

from __future__ import annotations

import torch
from torch import nn


def grouped_matmul(a, b):
    """a [B, Hkv, G, T, X] @ b [B, Hkv, X, Y] -> [B, Hkv, G, T, Y]: the G query heads that share a KV head as G * T
    rows of one product over that head's keys or values (matmul's broadcasting of b over G copies b G times: the whole
    cache, in every layer). The exported graph keeps the broadcast MatMul, the form graphs/ort_attention.py rewrites."""
    if torch.onnx.is_in_onnx_export():
        return torch.matmul(a, b.unsqueeze(2))
    batch, heads, groups, rows = a.shape[:4]
    return torch.matmul(a.reshape(batch, heads, groups * rows, -1), b).view(batch, heads, groups, rows, -1)


def merged_linear(linears) -> nn.Linear | None:
    """One nn.Linear computing the given ones' outputs side by side, their weights (and biases) made views of its
    own; None where they are not all plain linears of one input size, dtype, device and bias-ness."""
    if any(type(m) is not nn.Linear for m in linears) or len(
            {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in linears}) != 1:
        return None
    first = linears[0]
    merged = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                       device="meta")
    with torch.no_grad():
        for name in ("weight", "bias"):
            if getattr(first, name) is None:
                continue
            whole = torch.cat([getattr(m, name) for m in linears])
            setattr(merged, name, nn.Parameter(whole, requires_grad=False))
            for m, part in zip(linears, whole.split([m.out_features for m in linears])):
                setattr(m, name, nn.Parameter(part, requires_grad=False))
    return merged


def rope(x, cos, sin, rotate_half):
    """x [..., D] rotated by the positions' cos and sin [..., R]: on its first R dimensions (all of them unless the
    family's RoPE is partial), the rest passed through; in x's dtype (OLMo 2's rotary embedding gives float32 cos
    and sin, rotating in float32 then casting, as its own attention does)."""
    r = rotate_half.shape[0]
    if r == x.shape[-1]:
        return (x * cos + rotated(x, rotate_half) * sin).to(x.dtype)
    head, rest = x[..., :r], x[..., r:]
    return torch.cat([(head * cos + rotated(head, rotate_half) * sin).to(x.dtype), rest], dim=-1)


def rotated(x, rotate_half):
    """x @ rotate_half: in the exported graph that one MatMul (graphs/ort_attention.py reads it as RoPE); elsewhere the
    same numbers (each output is one input, negated or not) as a negation and a concatenation, which inductor fuses
    into the rotation's pointwise kernel instead of launching a matrix product for q and for k in every layer."""
    if torch.onnx.is_in_onnx_export():
        return torch.matmul(x, rotate_half)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def scatter_rows(cache, update, write_indices):
    """cache [B, Hkv, C, D] with update [B, Hkv, T, D] written at slots write_indices[b] + 0 .. T - 1 (ONNX's
    TensorScatter, mode linear, on the sequence axis)."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic("TensorScatter", (cache, update, write_indices), {"axis": -2, "mode": "linear"},
                                       dtype=cache.dtype, shape=cache.shape, version=24)
    batch, heads, num_tokens, dim = update.shape
    slots = write_indices[:, None] + torch.arange(num_tokens, device=update.device)  # [B, T]
    return cache.scatter(2, slots[:, None, :, None].expand(batch, heads, num_tokens, dim), update)
