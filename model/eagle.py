"""A feature-level draft head (EAGLE; `specrt models eagle`) as a step module: the step contract plus `features`.

The head is one Llama decoder layer whose input rows are not embeddings alone: `fc` [H, 2H] projects each new token's
embedding beside the hidden state of the position before it (contract.FEATURES: the target's last hidden state, or the
head's own guess of it, what its step returns as contract.HIDDEN). Its embedding table and LM head are the target's.

A trained head's directory holds only what was trained (`fc`, `model.layers.0.*`, `model.norm`; its config.json says
its shape under contract.EAGLE_HEAD). `assemble_eagle` makes it a whole checkpoint with its target's tables: a
LlamaForCausalLM of one layer, which saves and loads as any (`fc.weight` beside its weights; load_checkpoint puts it
back), so every backend builds its step as it builds a draft's: `FeatureStepModule(model)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specrt.contract import EAGLE_FC as FC, EAGLE_HEAD, HEAD_VOCABULARY, eagle_shape
from specrt.errors import SpecrtError
from specrt.model.step import InPlaceStepModule, StepModule


def assemble_eagle(head_dir: Path, target, dtype: torch.dtype = torch.float32):
    """A trained head (`specrt models eagle`'s directory) with `target`'s embedding table and LM head: a
    LlamaForCausalLM of one layer, its projection as `.fc`, in eval mode."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dir = Path(head_dir)
    shape = eagle_shape(head_dir)
    if shape is None:
        raise SpecrtError(f"{head_dir} is not an EAGLE head (no {EAGLE_HEAD} in its config.json)")
    config = json.loads((head_dir / "config.json").read_text())
    text = target.config.get_text_config()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    if embed.shape[1] != shape["hidden_size"]:
        raise SpecrtError(f"the EAGLE head {head_dir} reads hidden states of {shape['hidden_size']}, its target "
                          f"{embed.shape[1]}: it was trained for another target")
    tied = embed is head
    llama = LlamaConfig(vocab_size=embed.shape[0], hidden_size=shape["hidden_size"],
                        intermediate_size=shape["intermediate_size"], num_hidden_layers=1,
                        num_attention_heads=shape["num_attention_heads"],
                        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                        rms_norm_eps=shape["rms_norm_eps"], rope_theta=shape["rope_theta"],
                        max_position_embeddings=text.max_position_embeddings, tie_word_embeddings=tied,
                        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id)
    setattr(llama, EAGLE_HEAD, shape)
    if config.get(HEAD_VOCABULARY) is not None:
        setattr(llama, HEAD_VOCABULARY, list(config[HEAD_VOCABULARY]))
    weights = load_file(str(head_dir / "model.safetensors"))
    model = LlamaForCausalLM(llama)  # on the host: its rotary table is a buffer no state dict holds
    state = {k: v for k, v in weights.items() if k != FC}
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed.detach(), head.detach()
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # a weight missing, unexpected or of another shape
        raise SpecrtError(f"{head_dir}/model.safetensors is not the head its config.json describes: "
                          f"{str(e).strip().splitlines()[0]}") from None
    if tied:
        model.tie_weights()
    model.fc = nn.Linear(2 * shape["hidden_size"], shape["hidden_size"], bias=False, device="cpu")
    model.fc.weight = nn.Parameter(weights[FC])
    return model.to(dtype).eval()


def attach_fc(model, path: Path) -> None:
    """Put a saved head's projection back (load_checkpoint: transformers leaves the unexpected weight out)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        if FC not in f.keys():
            raise SpecrtError(f"{path}: an EAGLE head without its {FC}")
        weight = f.get_tensor(FC)
    model.fc = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.fc.weight = nn.Parameter(weight.to(model.dtype), requires_grad=False)


def _fc(hf_model):
    if getattr(hf_model, "fc", None) is None:
        raise SpecrtError("a feature-level draft head's model has its projection as .fc (assemble_eagle)")
    return hf_model.fc


def _rows(module, input_ids, features):
    """The head's input rows: fc over each new token's embedding beside its features."""
    return module.fc(torch.cat([module.embed(input_ids), features.to(module.fc.weight.dtype)], dim=-1))


class FeatureStepModule(StepModule):
    """forward(input_ids, position_ids, attention_mask, features, *past) -> (logits, *new_kv, hidden): the head's step
    (module docstring); features [B, T, H] is the hidden state of the position before each new token."""

    reads_features = True

    def __init__(self, hf_model):
        super().__init__(hf_model, hidden=True)
        self.fc = _fc(hf_model)

    def forward(self, input_ids, position_ids, attention_mask, features, *past, room: bool = False):
        return self._step(_rows(self, input_ids, features), position_ids, attention_mask, past, room)


class InPlaceFeatureStepModule(InPlaceStepModule):
    """The head's step with the K/V cache updated inside the graph (InPlaceStepModule): forward(input_ids,
    position_ids, attention_mask, write_indices, features, *past) -> (logits, *present, hidden)."""

    reads_features = True

    def __init__(self, hf_model):
        super().__init__(hf_model, hidden=True)
        self.fc = _fc(hf_model)

    def forward(self, input_ids, position_ids, attention_mask, write_indices, features, *past):
        return self._step_in_place(_rows(self, input_ids, features), position_ids, attention_mask, write_indices, past)


def step_module(model, hidden: bool = False, prompt_embeddings=None, kv_update: str = "runtime") -> StepModule:
    """The step module of a loaded checkpoint: a head's FeatureStepModule, else a StepModule (`hidden`: with its last
    hidden state as an output; `prompt_embeddings`: PPD's); kv_update "inplace": their in-graph variants."""
    inplace = kv_update == "inplace"
    if getattr(model, "fc", None) is not None:
        return InPlaceFeatureStepModule(model) if inplace else FeatureStepModule(model)
    return (InPlaceStepModule if inplace else StepModule)(model, prompt_embeddings, hidden=hidden)
