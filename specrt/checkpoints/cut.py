"""A draft cut from its target: the target's first N layers under its own embeddings, final norm and output head
(self-speculation by early exit, as in Draft & Verify, Zhang et al., ACL 2024, without its layer skipping), for a
target no small model shares a tokenizer with. No training: on SmolLM2-135M two layers agree with the target on 3% of
its held-out predictions (docs/models.md), so `specrt models draft` is the draft to serve; a cut is the quick,
reproducible stand-in for bundles whose methods draft without a model (anpd, ppd)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from specrt.config import Config, option
from specrt.errors import SpecrtError


@dataclass(frozen=True)
class CutConfig(Config):
    target: Path = option(Path("build/real/smollm2-135m"), "the target's Hugging Face checkpoint")
    layers: int = option(2, "how many of its first layers the draft keeps", ge=1)
    out: Path | None = option(None, "where the draft goes (default: build/drafts/<target's name>-l<layers>)")

    def dest(self) -> Path:
        return self.out or Path("build/drafts") / f"{Path(self.target).name}-l{self.layers}"


def cut_model(model, layers: int):
    """`model` (a transformers causal LM) cut to its first `layers` layers, in place; its config says so (and, where
    layers differ in kind, e.g. Gemma 3's sliding and global ones, which kinds the kept layers are)."""
    stack = model.model.layers
    if layers >= len(stack):
        raise SpecrtError(f"the target has {len(stack)} layers: a draft of {layers} would be no smaller")
    del stack[layers:]
    config = model.config
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    return model


def cut(cfg: CutConfig) -> Path:
    """Write the cut draft (its tokenizer files and cut.json, the record: source, its weights' sha256, layers kept) to
    cfg.dest(), whole or not at all."""
    import torch
    from transformers import AutoModelForCausalLM

    from specrt.checkpoints import copy_tokenizer
    from specrt.checkpoints.real import sha256_path
    from specrt.files import replace_dir, write_json_atomic

    src, dest = Path(cfg.target), cfg.dest()
    if not (src / "config.json").is_file():
        raise SpecrtError(f"{src} is not a Hugging Face checkpoint directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float32).eval()
    cut_model(model, cfg.layers)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(src, tmp)
        weights = sorted(src.glob("*.safetensors"))
        write_json_atomic(tmp / "cut.json", {"target": str(src), "layers": cfg.layers,
                                             "target_sha256": {w.name: sha256_path(w) for w in weights},
                                             "num_params": sum(p.numel() for p in model.parameters())})
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted cut leaves no half-written directory behind
    return dest
