"""Distil a draft toward its target: the draft learns the target's next-token distributions, not the corpus's tokens.

What speculation gains is set by how often the draft proposes what the target would emit. DistillSpec (Zhou et al.,
ICLR 2024) trains the draft on the target's own distributions and reports 10-45% faster speculative decoding than
with the draft as pretrained. This is its simplest form: the forward KL divergence KL(target || draft) over every
position of windows of a corpus (teacher-forced on the corpus's text), AdamW with warm-up and a cosine decay. The
corpus is the demo pair's (this Python's standard library, corpus.py) or a directory of the user's Python sources,
split into train and validation files the same way.

Before and after, on the validation files' windows, it measures the mean KL and the draft's greedy agreement with
the target (top-1: the draft's argmax is the target's; what a chain drafted greedily gets accepted on) and records
them beside the checkpoint (distill.json). The checkpoint is written whole or not at all. The pair must share
a vocabulary (same tokenizer); a draft whose vocabulary differs is refused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.checkpoints import DEMO_DIR
from specrt.checkpoints.train import adamw, cosine_lr, encode_files, optimizer_step, token_windows
from specrt.config import Config, option
from specrt.errors import SpecrtError
from specrt.files import replace_dir


@dataclass(frozen=True)
class DistillConfig(Config):
    target: Path = option(DEMO_DIR / "target", "the target's Hugging Face checkpoint: what the draft learns to predict")
    draft: Path = option(DEMO_DIR / "draft", "the draft's checkpoint to start from")
    tokenizer: Path = option(DEMO_DIR / "tokenizer", "the pair's tokenizer directory")
    out: Path = option(Path("build/distilled/draft"), "where the distilled draft goes (with distill.json)")
    corpus: Path | None = option(None, "a directory of Python sources to distil on (default: this Python's standard "
                                       "library, the demo pair's corpus)")
    steps: int = option(800, "optimizer steps", ge=1)
    batch_size: int = option(16, "windows per step", ge=1)
    seq_len: int = option(256, "tokens per window (each is read as seq_len + 1 tokens, as training reads them)", ge=1)
    lr: float = option(1e-3, "peak learning rate", gt=0)
    warmup_steps: int = option(50, "linear warm-up steps", ge=0)
    eval_windows: int = option(64, "validation windows measured before and after", ge=1)
    threads: int | None = option(None, "PyTorch's intra-op threads (default: PyTorch's own, every core)", ge=1)
    seed: int = option(0, "seed of the windows drawn", ge=0)


def _load(path: Path, what: str):
    import torch
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise SpecrtError(f"{what} {path} is not a Hugging Face checkpoint directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def divergence(target, draft, batch) -> tuple:
    """(mean KL(target || draft) per position as a tensor, the fraction of positions where the draft's argmax is the
    target's) over a batch of windows [N, T]."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        teacher = F.log_softmax(target(input_ids=batch).logits.float(), dim=-1)
    student = F.log_softmax(draft(input_ids=batch).logits.float(), dim=-1)
    vocab = student.shape[-1]
    kl = F.kl_div(student.reshape(-1, vocab), teacher.reshape(-1, vocab), log_target=True, reduction="batchmean")
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean().item()
    return kl, agree


def evaluate(target, draft, tokens: np.ndarray, cfg: DistillConfig) -> dict:
    """Mean KL and top-1 agreement over evenly spaced validation windows (deterministic)."""
    import torch

    starts = np.linspace(0, len(tokens) - cfg.seq_len - 2, cfg.eval_windows).astype(np.int64)
    kls, agrees = [], []
    draft.eval()
    with torch.no_grad():
        for chunk in np.array_split(starts, math.ceil(cfg.eval_windows / cfg.batch_size)):
            kl, agree = divergence(target, draft, token_windows(tokens, chunk, cfg.seq_len))
            kls.append(kl.item() * len(chunk))
            agrees.append(agree * len(chunk))
    return {"kl": round(sum(kls) / len(starts), 4), "top1_agreement": round(sum(agrees) / len(starts), 4)}


def _corpus_tokens(cfg: DistillConfig) -> tuple[np.ndarray, np.ndarray, str]:
    from transformers import PreTrainedTokenizerFast

    from specrt.checkpoints.corpus import corpus_hash, load_corpus

    if not (cfg.tokenizer / "tokenizer.json").is_file():
        raise SpecrtError(f"tokenizer {cfg.tokenizer} has no tokenizer.json")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.tokenizer)
    try:
        train_files, val_files = load_corpus(cfg.corpus)
    except RuntimeError as e:
        raise SpecrtError(f"corpus {cfg.corpus}: {e}; it needs Python sources for both splits") from None
    train, val = encode_files(tokenizer, train_files), encode_files(tokenizer, val_files)
    for name, tokens in (("train", train), ("validation", val)):
        if len(tokens) < cfg.seq_len + 2:
            raise SpecrtError(f"the corpus's {name} files hold {len(tokens)} tokens, fewer than one window of "
                              f"{cfg.seq_len + 1}: give a larger corpus or a smaller --seq-len")
    return train, val, corpus_hash(train_files)


def _save(draft, out: Path, record: dict) -> None:
    """The checkpoint and its record into `out`, whole or not at all (a directory beside it, renamed into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save_pretrained(tmp, safe_serialization=True)
    (tmp / "distill.json").write_text(json.dumps(record, indent=1) + "\n")
    replace_dir(tmp, out)


def distill(cfg: DistillConfig, progress: bool = True) -> dict:
    """Train cfg.draft on cfg.target's distributions; writes cfg.out and returns its record (distill.json)."""
    import torch
    from tqdm import tqdm

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    target, draft = _load(cfg.target, "target").eval(), _load(cfg.draft, "draft")
    vocab_t, vocab_d = target.config.vocab_size, draft.config.vocab_size
    if vocab_t != vocab_d:
        raise SpecrtError(f"the target's vocabulary has {vocab_t} tokens and the draft's {vocab_d}: a draft learns the "
                          "target's distributions over one shared vocabulary (the same tokenizer)")
    for p in target.parameters():
        p.requires_grad_(False)
    train, val, corpus = _corpus_tokens(cfg)
    before = evaluate(target, draft, val, cfg)
    opt = adamw(draft, cfg.lr, weight_decay=0.01)

    rng = np.random.default_rng(cfg.seed)
    history = []
    t0 = time.perf_counter()
    draft.train()
    for step in tqdm(range(cfg.steps), desc="distill", unit="step", disable=not progress):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.steps, min_ratio=0.1)
        batch = token_windows(train, rng.integers(0, len(train) - cfg.seq_len - 1, size=cfg.batch_size), cfg.seq_len)
        kl, _ = divergence(target, draft, batch)
        optimizer_step(opt, kl, draft)
        if step % 50 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "kl": round(kl.item(), 4)})
    seconds = time.perf_counter() - t0
    after = evaluate(target, draft, val, cfg)
    record = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
              "corpus_hash": corpus, "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
              "before": before, "after": after, "train_seconds": round(seconds, 1), "history": history}
    _save(draft, cfg.out, record)
    return record
