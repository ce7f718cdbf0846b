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

Binding names are built here and nowhere else.
"""

from __future__ import annotations

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROLES = ("target", "draft")


def past_key(layer: int) -> str:
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def new_key(layer: int) -> str:
    return f"new_key.{layer}"


def new_value(layer: int) -> str:
    return f"new_value.{layer}"


def input_names(num_layers: int) -> list[str]:
    names = [INPUT_IDS, POSITION_IDS, ATTENTION_MASK]
    for layer in range(num_layers):
        names += [past_key(layer), past_value(layer)]
    return names


def output_names(num_layers: int) -> list[str]:
    names = [LOGITS]
    for layer in range(num_layers):
        names += [new_key(layer), new_value(layer)]
    return names
