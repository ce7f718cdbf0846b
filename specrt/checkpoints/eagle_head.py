"""The feature-level draft head (EAGLE, Li et al., ICML 2024): one decoder layer that extends the target's own hidden
state by one position.

The target's last hidden state n_p (after its final norm: what its LM head reads) at position p and the embedding of
the token x_{p+1} that follows are concatenated and projected (`fc`, 2H -> H); one Llama decoder layer, attending over
the positions before, and a final norm predict n_{p+1}, whose LM-head row is the draft's guess of x_{p+2}. The target's
embedding table and LM head are the head's own (read from the target, never trained or stored): what is trained is
`fc`, the layer and the norm, named as Hugging Face names a Llama's (model.layers.0.*, model.norm), so a step graph
can be built from them as from any decoder layer.

A draft of depth d feeds back its own prediction: the input at position p + d - 1 is (n^_{p+d-1}, x_{p+d}). `chain`
computes every depth for every start p at once (the "training-time test" of EAGLE-3, Li et al. 2025): the depth-d
inputs see the true positions <= p and their own chain's earlier depths, so one pass per depth gives what drafting
would, for training and for measuring acceptance (tested against feeding each chain in turn).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The rotary embedding (rotate-half form, as Llama's) of x [B, heads, T, D] at positions [T]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = positions.to(torch.float32)[:, None] * inv  # [T, D / 2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, shape: dict):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(shape["hidden_size"], eps=shape["rms_norm_eps"])
        self.self_attn = _Attention(shape["hidden_size"], shape["num_attention_heads"],
                                    shape["num_key_value_heads"], shape["head_dim"])
        self.post_attention_layernorm = nn.RMSNorm(shape["hidden_size"], eps=shape["rms_norm_eps"])
        self.mlp = _Mlp(shape["hidden_size"], shape["intermediate_size"])


class _Model(nn.Module):
    def __init__(self, shape: dict):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(shape)])
        self.norm = nn.RMSNorm(shape["hidden_size"], eps=shape["rms_norm_eps"])


class EagleHead(nn.Module):
    """fc + one Llama decoder layer + a final norm over `shape` (SHAPE_KEYS of the target's config)."""

    def __init__(self, shape: dict):
        super().__init__()
        self.shape = dict(shape)
        self.fc = nn.Linear(2 * shape["hidden_size"], shape["hidden_size"], bias=False)
        self.model = _Model(shape)

    def _inputs(self, embedded, features, positions):
        """The layer's residual input and its q, k, v [B, heads, T, D] for inputs at `positions` [T]."""
        attn, theta = self.model.layers[0].self_attn, float(self.shape["rope_theta"])
        x = self.fc(torch.cat([embedded, features], -1))
        h = self.model.layers[0].input_layernorm(x)
        batch, length, _ = h.shape
        split = lambda t, n: t.view(batch, length, n, attn.head_dim).transpose(1, 2)  # noqa: E731
        return (x, rotate(split(attn.q_proj(h), attn.heads), positions, theta),
                rotate(split(attn.k_proj(h), attn.kv_heads), positions, theta), split(attn.v_proj(h), attn.kv_heads))

    def _finish(self, x, q, keys, values, mask):
        layer = self.model.layers[0]
        repeat = layer.self_attn.heads // layer.self_attn.kv_heads
        a = F.scaled_dot_product_attention(q, keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1),
                                           attn_mask=mask)
        batch, _, length, _ = a.shape
        x = x + layer.self_attn.o_proj(a.transpose(1, 2).reshape(batch, length, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def chain(self, embed: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor, depth: int,
              noise: float = 0.0) -> list[torch.Tensor]:
        """The head's predictions [B, T, H] at every depth 1..`depth`: at depth d, entry p is n^_{p+d}, from the true
        n_<=p, the tokens x_{p+1..p+d} (tokens[:, p] is x_{p+1}) and its own n^_{p+1..p+d-1}. `embed`: the target's
        embedding table [V, H]; `noise`: uniform noise of that amplitude on the true features (training)."""
        length = features.shape[1]
        positions = torch.arange(length, device=features.device)
        if noise:
            features = features + noise * (torch.rand_like(features) * 2 - 1)
        x, q, k, v = self._inputs(embed[tokens], features, positions)
        causal = torch.ones(length, length, dtype=torch.bool, device=features.device).tril()
        own = torch.eye(length, dtype=torch.bool, device=features.device)
        outs, keys, values = [self._finish(x, q, k, v, causal)], [k], [v]
        for d in range(2, depth + 1):
            fed = F.pad(outs[-1][:, :length - d + 1], (0, 0, 0, d - 1))  # n^_{p+d-1} of chain p
            x, q, k, v = self._inputs(embed[F.pad(tokens[:, d - 1:], (0, d - 1))], fed, positions + d - 1)
            keys.append(k)
            values.append(v)
            outs.append(self._finish(x, q, torch.cat(keys, 2), torch.cat(values, 2),
                                     torch.cat([causal] + [own] * (d - 1), 1)))
        return outs


SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "rms_norm_eps", "rope_theta")


def head_shape(config) -> dict:
    """The head's shape from a target's (text) config: its own layer's."""
    tc = config.get_text_config()
    rope = getattr(tc, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}  # per layer type (Gemma 3): the global
    theta = rope.get("rope_theta")  # layers', whose attention reads every position as the head's does
    heads = tc.num_attention_heads
    return {"hidden_size": tc.hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            "intermediate_size": tc.intermediate_size, "rms_norm_eps": float(tc.rms_norm_eps),
            "rope_theta": float(theta or getattr(tc, "rope_theta", None) or 1e4)}
