"""TorchBackend: the same StepModule that export traces, run eagerly by PyTorch (CUDA or CPU); with `quant`, its
projections as 8-bit linears (model/quant.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.bundle.manifest import ModelEntry
from specrt.runtime.backends.base import Backend, torch_head, torch_input, torch_pick, torch_wait


class TorchBackend(Backend):
    name = "torch"
    feature_steps = True

    def __init__(self, entry: ModelEntry, hf_dir: Path, device: str, threads: int, prompt_embeddings=None,
                 quant: str | None = None):
        import torch

        from specrt.model.quant import load_step_module

        super().__init__(entry)
        torch.set_num_threads(threads)  # process-wide: PyTorch has one intra-op pool
        self.torch = torch
        self.device = torch.device(device)
        self.dtype = getattr(torch, entry.dtype)
        self.module, self.quant = load_step_module(hf_dir, entry.dtype, device, prompt_embeddings, quant, entry.hidden)
        self.gives_hidden = self.module.hidden

    def allocate(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _run(self, binding, input_ids, position_ids, attention_mask, cache, features=None):
        torch = self.torch
        e = self.entry
        past = []
        for layer in range(e.num_layers):
            past += cache.layer_views(layer)
        fed = [] if features is None else [torch_input(torch, features, self.device, np.float32)]
        with torch.inference_mode():
            out = self.module(torch_input(torch, input_ids, self.device),
                              torch_input(torch, position_ids, self.device),
                              torch_input(torch, attention_mask, self.device, np.bool_), *fed, *past)
            new_kv = torch.stack(out[1:1 + 2 * e.num_layers]).unflatten(0, (e.num_layers, 2))  # [L, 2, B, Hkv, T, D]
        return out[0], new_kv, (out[-1] if self.gives_hidden else None)

    _wait = torch_wait
    _head = staticmethod(torch_head)  # the argmax on the device: [B, T] int64 crosses, not the logits
    host_logits = False

    def _pick(self, logits, pick):
        return torch_pick(self.torch, logits, pick)
