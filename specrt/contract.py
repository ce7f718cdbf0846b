"""The step contract (DESIGN.md): binding names, shapes and dtypes shared by every backend.

A step feeds T new tokens per sequence against that sequence's cached K/V:

    input_ids        [B, T]          int64  new tokens
    position_ids     [B, T]          int64  true position of each new token
    attention_mask   [B, T, S + T]   bool   past slots (S = cache capacity) then the T new tokens
    past_key.{l}     [B, Hkv, S, D]  float  cache buffers, bound in place
    past_value.{l}   [B, Hkv, S, D]
    logits           [B, T, V]       float
    new_key.{l}      [B, Hkv, T, D]  float  K/V of the T new tokens only
    new_value.{l}    [B, Hkv, T, D]

The in-graph KV update (kv_update "inplace", `specrt inplace`) is the same step with the cache written inside
the graph (ONNX TensorScatter + Attention, opset 24; TensorRT's IKVCacheUpdateLayer + IAttention):

    input_ids, position_ids          as above
    attention_mask   [B, T, C]       bool   cache slots each new token sees; new token j of sequence b
                                            sits at slot write_indices[b] + j
    write_indices    [B]             int64  where each sequence's new K/V are written (its cache length)
    past_key.{l}     [B, Hkv, C, D]  float  the cache at its capacity C
    logits           [B, T, V]       float
    present_key.{l}  [B, Hkv, C, D]  float  past with the new K/V written in, bound to past's memory

A ragged step's shorter sequences fill their rows past their own with holes: token 0 at position
HOLE_POSITION, seeing only itself. Nobody reads a hole's logits or commits its K/V, so a backend may leave holes
out of its token-wise work (OrtBackend does: graphs/packed_rows.py); computed, a hole is finite garbage.

Cache slot s of a sequence holds the K/V of its position s (the runtime appends accepted rows in order from
position 0): a family whose layers window their attention differently (Gemma 2) derives each layer's window in the
graph from that and position_ids, on top of attention_mask.

A step may carry one more input and one more output (EAGLE, Li et al. 2024: a draft head on the target's own hidden
state), each named in a graph only where its model has them:

    hidden           [B, T, H]       float  output: the last hidden state of each new token, after the final norm
                                            (what the LM head reads); a target's where its draft reads it
    features         [B, T, H]       float  input: a feature-level draft head's (EAGLE_HEAD) hidden state of the
                                            position before each new token: the target's, or its own guess of it

Binding names are built here and nowhere else.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
WRITE_INDICES = "write_indices"
LOGITS = "logits"
HIDDEN = "hidden"
FEATURES = "features"
HOLE_POSITION = -1  # position_ids of a hole row (no real token has a negative position)
# A draft's config may name the token ids its LM head scores (the most frequent in its target's text; FR-Spec, Zhao et
# al. 2025): its logits stay [B, T, V], every other id at UNSCORED_LOGIT, which softmax takes to exactly 0 in float32
# and which doubled or summed stays finite.
HEAD_VOCABULARY = "specrt_head_vocabulary"
UNSCORED_LOGIT = -1e30
# a feature-level draft head's checkpoint (`specrt models eagle`) says so in its config.json under this key: its shape,
# and the target whose hidden states it reads
EAGLE_HEAD = "specrt_eagle"
EAGLE_FC = "fc.weight"  # its projection of [embedding; features], beside the Llama layer's weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3_text")
ROLES = ("target", "draft")


def eagle_shape(path: Path) -> dict | None:
    """The head's shape from a checkpoint directory's config.json (contract.EAGLE_HEAD), None for any other model."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    shape = config.get(EAGLE_HEAD) if isinstance(config, dict) else None
    return shape if isinstance(shape, dict) else None


def prompt_token_id(vocab: int, num_ensemble: int, distance: int, ept: int) -> int:
    """PPD: the id of prompt token `distance` (1..k) of ensemble member `ept` (0..e-1), in rows appended after the
    vocabulary's (V + (d - 1) * e + j): what training feeds and what the drafter places in a round's tree."""
    return vocab + (distance - 1) * num_ensemble + ept


def past_key(layer: int) -> str:
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def new_key(layer: int) -> str:
    return f"new_key.{layer}"


def new_value(layer: int) -> str:
    return f"new_value.{layer}"


def present_key(layer: int) -> str:
    return f"present_key.{layer}"


def present_value(layer: int) -> str:
    return f"present_value.{layer}"


# a Hugging Face checkpoint's tokenizer: the files that make one (a chat template may sit beside them, in
# chat_template.jinja)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
KV_UPDATES = ("runtime", "inplace")  # who writes a step's new K/V into the cache: the runtime, or the graph in place
# 8-bit projections of the PyTorch step (backends torch and graphs; model/quant.py); the contract is unchanged
TORCH_QUANT_SCHEMES = ("int8-wo", "fp8")
# torch.compile modes of the static engines' decoder layers (`specrt build --compile`; runtime/backends/static.py)
# tuned: inductor's coordinate-descent tuning (gpt-fast's setting), which on CUDA also computes a one-row matmul as a
# Triton reduction tuned per shape (torch/_inductor/decomposition.py: cuBLAS's GEMVs reach less of the bandwidth)
TORCH_COMPILE_MODES = ("default", "max-autotune", "tuned")
# which weight projections that read one input a backend merges into one (ONNX Runtime's graph, the static engines'
# module): "qkv" (q, k and v), "all" (an MLP's gate and up too), "none"
PROJECTIONS = ("qkv", "all", "none")
# max |logit| (and new K/V) difference between two correct computations of one step, per dtype and per unit of the
# output's largest |value| (parity_tolerance): an exported graph against its module (graphs.parity), or a step of
# another shape (batched, padded, a tree: another summation order) whose greedy token differs only at a tie within it
# (bench.quality.divergence); bfloat16 keeps 3 fewer mantissa bits than float16: 8x its tolerance
PARITY_TOL = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 4e-1}


def parity_tolerance(per_unit: float, scale: float) -> float:
    """The largest |difference| allowed between two computations of an output whose largest |value| is `scale`:
    `per_unit` (PARITY_TOL[dtype], or a quantized step's) per unit of it, and no less than `per_unit` itself (rounding
    error grows with the values summed: a real model's logits reach 20-85)."""
    return per_unit * max(1.0, scale)


def input_names(num_layers: int, kv_update: str = "runtime", features: bool = False) -> list[str]:
    names = [INPUT_IDS, POSITION_IDS, ATTENTION_MASK] + ([WRITE_INDICES] if kv_update == "inplace" else []) \
        + ([FEATURES] if features else [])
    for layer in range(num_layers):
        names += [past_key(layer), past_value(layer)]
    return names


def output_names(num_layers: int, kv_update: str = "runtime", hidden: bool = False) -> list[str]:
    names = [LOGITS]
    for layer in range(num_layers):
        names += [present_key(layer), present_value(layer)] if kv_update == "inplace" else [new_key(layer), new_value(layer)]
    return names + ([HIDDEN] if hidden else [])


def in_graph_mask(attention_mask: np.ndarray, starts: np.ndarray, capacity: int, out: np.ndarray | None = None
                  ) -> np.ndarray:
    """A step's mask [B, T, S + T] as the in-graph variant takes it, [B, T, capacity]: the S past columns stay where
    they are (a sequence's slots >= its length are hidden there), and new token j of sequence b moves to slot
    starts[b] + j, where the graph writes its K/V. `out`: a [B, T, capacity] bool array to fill, or None."""
    batch, num_tokens, width = attention_mask.shape
    past = width - num_tokens
    if out is None:
        out = np.empty((batch, num_tokens, capacity), dtype=bool)
    out[:] = False
    out[:, :, :past] = attention_mask[:, :, :past]
    rows = np.arange(num_tokens)
    out[np.arange(batch)[:, None, None], rows[:, None], (starts[:, None] + rows)[:, None, :]] = attention_mask[:, :, past:]
    return out


def rotate_half_matrix(dim: int) -> np.ndarray:
    """R [dim, dim] float32 with x @ R == cat(-x[..., dim/2:], x[..., :dim/2]): the rotary embedding's rotate-half as
    one MatMul, the constant every exported step graph multiplies q and k by (model/step.py), and what the ort
    backend's load-time fusions recognise it by (graphs/ort_fusions.py)."""
    half = dim // 2
    r = np.zeros((dim, dim), np.float32)
    r[half:, :half] = -np.eye(half)
    r[:half, half:] = np.eye(half)
    return r
