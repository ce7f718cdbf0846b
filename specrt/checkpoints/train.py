"""Train the demo pair: a byte-level BPE tokenizer, a Llama target and a smaller Llama draft.

Everything runs on the CPU from the standard library source (see corpus.py), so a fresh machine
with no model hub can rebuild the pair. The committed pair under specrt/checkpoints/demo/ came from
`make models`; its training record (config, seed, losses, time, corpus hash) is training.json.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specrt.checkpoints.corpus import CorpusFile, corpus_hash, load_corpus

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int = 2048


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    num_steps: int
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    num_eval_windows: int = 128


TARGET = TrainConfig(ModelConfig(256, 688, 2, 4, 2), num_steps=1200)
DRAFT = TrainConfig(ModelConfig(128, 344, 1, 2, 1), num_steps=1000)


def train_tokenizer(files: list[CorpusFile], vocab_size: int, out_dir: Path):
    """Byte-level BPE over the training files, saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        # Without this, the tokenizer also returns token_type_ids, which Llama does not take.
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(out_dir)
    return fast


def encode_files(tokenizer, files: list[CorpusFile]) -> np.ndarray:
    """All files as one token stream, each file followed by EOS."""
    eos = tokenizer.eos_token_id
    ids = tokenizer([f.text for f in files], add_special_tokens=False)["input_ids"]
    out: list[int] = []
    for row in ids:
        out.extend(row)
        out.append(eos)
    return np.asarray(out, dtype=np.int32)


def build_model(cfg: ModelConfig, vocab_size: int, eos_id: int, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=False,
        # LlamaConfig defaults to bos=1, eos=2; they must be the tokenizer's.
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return model


def token_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
    """The windows of seq_len + 1 tokens of a token stream at `starts`, as an int64 tensor [N, seq_len + 1]."""
    import torch

    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def evaluate(model, val_tokens: np.ndarray, seq_len: int, num_windows: int) -> float:
    """Mean next-token loss over evenly spaced validation windows (deterministic)."""
    import torch

    starts = np.linspace(0, len(val_tokens) - seq_len - 2, num_windows).astype(np.int64)
    model.eval()
    losses = []
    with torch.no_grad():
        for chunk in np.array_split(starts, max(1, num_windows // 32)):
            batch = token_windows(val_tokens, chunk, seq_len)
            out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
            # HF shifts labels internally: pass the inputs as labels, loss covers positions 1..T-1.
            losses.append(out.loss.item())
    model.train()
    return float(np.mean(losses))


def adamw(model, lr: float, weight_decay: float):
    """AdamW over a model's parameters (betas 0.9, 0.95), weight decay on its matrices only."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def optimizer_step(opt, loss, model, clip: float = 1.0) -> None:
    """One update: the loss's gradients, their norm clipped to `clip`, applied by `opt`."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def cosine_lr(step: int, lr: float, warmup_steps: int, num_steps: int, min_ratio: float) -> float:
    """Linear warm-up to `lr`, then a cosine decay to min_ratio * lr at num_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    frac = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_model(cfg: TrainConfig, train_tokens: np.ndarray, val_tokens: np.ndarray, tokenizer, out_dir: Path) -> dict:
    from tqdm import tqdm

    model = build_model(cfg.model, len(tokenizer), tokenizer.eos_token_id, cfg.seed)
    num_params = sum(p.numel() for p in model.parameters())
    opt = adamw(model, cfg.lr, cfg.weight_decay)

    rng = np.random.default_rng(cfg.seed)
    history = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.num_steps), desc=f"train h={cfg.model.hidden_size}", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.num_steps, cfg.min_lr_ratio)
        starts = rng.integers(0, len(train_tokens) - cfg.seq_len - 1, size=cfg.batch_size)
        batch = token_windows(train_tokens, starts, cfg.seq_len)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer_step(opt, loss, model)
        if step % 50 == 0 or step == cfg.num_steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            history.append({"step": step, "train_loss": round(loss.item(), 4)})
    train_seconds = time.perf_counter() - t0
    val_loss = evaluate(model, val_tokens, cfg.seq_len, cfg.num_eval_windows)
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "config": asdict(cfg),
        "num_params": num_params,
        "val_loss": round(val_loss, 4),
        "train_seconds": round(train_seconds, 1),
        "tokens_seen": cfg.num_steps * cfg.batch_size * cfg.seq_len,
        "history": history,
    }


def train_pair(out_dir: Path, target: TrainConfig = TARGET, draft: TrainConfig = DRAFT, vocab_size: int = 4096) -> dict:
    """Tokenizer, draft and target into out_dir/{tokenizer,draft,target}; returns the training record."""
    import torch
    import tokenizers
    import transformers

    torch.set_num_threads(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_files, val_files = load_corpus()
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_files, vocab_size, out_dir / "tokenizer")
    tok_seconds = time.perf_counter() - t0
    train_tokens = encode_files(tokenizer, train_files)
    val_tokens = encode_files(tokenizer, val_files)
    record = {
        "corpus": {
            "source": f"Python {platform.python_version()} standard library (*.py, site-packages excluded)",
            "num_train_files": len(train_files),
            "num_val_files": len(val_files),
            "train_tokens": int(len(train_tokens)),
            "val_tokens": int(len(val_tokens)),
            "train_hash": corpus_hash(train_files),
            "val_hash": corpus_hash(val_files),
        },
        "tokenizer": {"kind": "byte-level BPE", "vocab_size": len(tokenizer), "train_seconds": round(tok_seconds, 1)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "threads": torch.get_num_threads(),
    }
    for name, cfg in (("draft", draft), ("target", target)):
        record[name] = train_model(cfg, train_tokens, val_tokens, tokenizer, out_dir / name)
        print(f"{name}: {record[name]['num_params'] / 1e6:.2f}M params, val loss {record[name]['val_loss']}")
        (out_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def scaled(cfg: TrainConfig, num_steps: int) -> TrainConfig:
    return replace(cfg, num_steps=num_steps)
