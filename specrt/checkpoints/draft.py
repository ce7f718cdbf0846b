"""`specrt models draft`: a new small draft for a target that has none, distilled on the target's own text.

A real target (SmolLM2, Gemma 3) has no smaller sibling sharing its tokenizer here, and its first layers cut off make a
useless draft (two agree with it on 3% of its predictions). So the draft is made:

    shape   a Llama of `--hidden` x `--layers` (heads of 64) over the target's vocabulary, embeddings tied; what costs
            a small draft most on a real vocabulary is its output projection (49152 x hidden for SmolLM2), so with
            `--head-vocab N` its head scores only the N ids most frequent in the teacher's text (FR-Spec, Zhao et
            al. 2025: contract.HEAD_VOCABULARY), the rest never drafted
    init    its embedding table is the target's projected on the target's top `--hidden` principal directions (the
            SVD of the target's table): the draft starts from the target's own geometry of tokens
    data    the teacher corpus (teacher.py): the target's greedy continuations of mixed prompts and Python source,
            with the target's top-k log-probabilities at each predicted position
    loss    cross-entropy of the draft against the target's top-k distribution (renormalized) at those positions
            (forward KL up to the target's entropy, DistillSpec's objective on the target's own outputs); the output
            projection runs only at predicted positions
    eval    top-1 agreement with the target (the draft's argmax is the target's greedy token: what a greedy chain
            gets accepted on) on the validation corpus (held-out prompts and source), by kind, before and after

The checkpoint is written whole or not at all, with `draft.json` (the record: shape, data, losses, agreement, time,
and the key of what made it: the teacher corpora's keys and every setting; run again with the same inputs, it is
kept), `validation-prompts.jsonl` (the held-out prompts, for `specrt calibrate --prompts`) and `teacher-text.npz` (the
training text, for `specrt ngram prior --corpus`). With `--device cuda` the target writes the text and the draft
trains on a GPU (a lent one: `specrt gpu-session --call distill` brings the draft and its text back).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specrt.checkpoints.prompt_mix import OWN_CHAT, Prompt, as_chat, mixed_prompts, spread
from specrt.checkpoints.teacher import TeacherConfig, TeacherCorpus, build_corpus
from specrt.config import option
from specrt.contract import HEAD_VOCABULARY
from specrt.errors import SpecrtError
from specrt.files import check_replaceable

RECORD = "draft.json"
PROMPTS = "validation-prompts.jsonl"  # the held-out prompts, as `specrt calibrate --prompts` reads them
PACE_STEPS = 20  # under a time limit, the steps that set the pace the rest are planned by
TEXT = "teacher-text.npz"  # the training text's ids and offsets, as `specrt ngram prior --corpus` reads them


@dataclass(frozen=True)
class TargetTextConfig(TeacherConfig):
    """What a draft made from a target's own text needs: the target, where its corpora are kept, the held-out set."""
    target: Path = option(Path("build/real/smollm2-135m"), "the target's Hugging Face checkpoint (with its tokenizer)")
    tokenizer: Path | None = option(None, "the target's tokenizer directory (default: the target's own)")
    out: Path | None = option(None, "where the draft goes (default: build/drafts/<target's directory name>)")
    cache: Path = option(Path("build/teacher"), "where teacher corpora are kept, by the key of what made them")
    val_prompts: int = option(96, "held-out prompts the agreement is measured on", ge=1)
    threads: int | None = option(None, "PyTorch's intra-op threads (default: PyTorch's own, every core)", ge=1)
    head_vocab: int = option(8192, "the draft's LM head scores only this many token ids, those most frequent in the "
                                   "teacher's text (its output projection is most of what it costs); 0, or a "
                                   "vocabulary of no more ids: every id", ge=0)
    device: str = option("cpu", "where the target writes its text and the draft (or head) trains: cpu, or cuda (a "
                                "lent GPU: `specrt gpu-session --call distill`); recorded, not keyed")

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer if self.tokenizer is not None else self.target

    def check_device(self) -> None:
        """Refuse, in one line, a --device PyTorch cannot use here."""
        import torch

        try:
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as e:
            raise SpecrtError(f"--device {self.device}: PyTorch {torch.__version__} cannot use it here ({e})") from None

    def teacher(self, split: str) -> TeacherConfig:
        own = {f: getattr(self, f) for f in TeacherConfig.__dataclass_fields__}
        if split == "validation":
            own.update(prompts=self.val_prompts, source_windows=max(1, self.source_windows // 8),
                       own_chats=min(self.own_chats, self.val_prompts // 4))
        return TeacherConfig(**own)


@dataclass(frozen=True)
class DraftConfig(TargetTextConfig):
    hidden: int = option(256, "the draft's hidden size (a multiple of 64)", ge=64)
    layers: int = option(4, "decoder layers", ge=1)
    steps: int = option(1500, "optimizer steps", ge=1)
    batch_size: int = option(16, "sequences per step", ge=1)
    positions: int = option(32, "predicted positions per sequence the loss is taken at in a step (drawn at random: the "
                                "output projection over the vocabulary is most of a step's cost)", ge=1)
    seq_len: int = option(256, "tokens per sequence at most (longer ones are cut)", ge=8)
    lr: float = option(2e-3, "peak learning rate", gt=0)
    warmup_steps: int = option(50, "linear warm-up steps", ge=0)
    time_limit: float | None = option(None, "seconds (from the start) by which training ends: the steps are cut "
                                            "to what the first ones' pace fits, the schedule with them; the record "
                                            "says so, and keys the draft by the steps it ran (gpu-session's budget)",
                                      gt=0)
    save_dtype: str = option("float32", "the dtype the draft is saved in (float16: half the size, what a lent GPU's "
                                        "call brings back)", choices=("float32", "float16"))

    @property
    def dest(self) -> Path:
        return self.out if self.out is not None else Path("build/drafts") / Path(self.target).name


def new_draft(target, hidden: int, layers: int, seed: int):
    """A Llama draft over the target's vocabulary whose tied embeddings are the target's projected on its top `hidden`
    principal directions; the rest initialised as transformers initialises a Llama."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tc = target.config.get_text_config()
    if hidden % 64:
        raise SpecrtError(f"--hidden must be a multiple of 64 (heads of 64), got {hidden}")
    table = target.get_input_embeddings().weight.detach().float()  # [V, H]
    if hidden > table.shape[1]:
        raise SpecrtError(f"--hidden {hidden} exceeds the target's own hidden size {table.shape[1]}")
    heads = hidden // 64
    eos = tc.eos_token_id
    config = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         head_dim=64, max_position_embeddings=tc.max_position_embeddings, tie_word_embeddings=True,
                         rope_theta=float(getattr(tc, "rope_theta", None) or 1e4), rms_norm_eps=1e-5,
                         bos_token_id=tc.bos_token_id, eos_token_id=eos, pad_token_id=tc.pad_token_id)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    _, _, vt = torch.linalg.svd(table - table.mean(0), full_matrices=False)
    projected = table @ vt[:hidden].T  # [V, hidden]
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(projected / projected.pow(2).mean().sqrt() * 0.05)
    draft.generation_config = GenerationConfig(bos_token_id=tc.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tc.pad_token_id)
    return draft


def _batch(corpus: TeacherCorpus, picks, seq_len: int, pad: int, rng: np.random.Generator | None = None,
           per_sequence: int = 0):
    """(ids [B, T], attention mask [B, T], positions of predictions (b, t) [P, 2], their rows [P]) of the sequences
    `picks`, each cut to its last seq_len tokens where longer, right-padded; with `rng`, at most `per_sequence` of each
    sequence's predictions, drawn at random."""
    seqs = [corpus.sequence(int(s)) for s in picks]
    width = min(seq_len, max(len(ids) for ids, _, _ in seqs))
    ids = np.full((len(seqs), width), pad, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    where, rows = [], []
    for b, (seq, first, row) in enumerate(seqs):
        cut = max(0, len(seq) - width)  # positions >= cut are kept, shifted by it
        ids[b, :len(seq) - cut], mask[b, :len(seq) - cut] = seq[cut:], 1
        predicted = np.arange(first, first + (row.stop - row.start))
        keep = np.flatnonzero(predicted >= cut)
        if rng is not None and len(keep) > per_sequence:
            keep = np.sort(rng.choice(keep, per_sequence, replace=False))
        where.append(np.stack([np.full(len(keep), b), predicted[keep] - cut], axis=1))
        rows.append(np.arange(row.start, row.stop)[keep])
    return ids, mask, np.concatenate(where), np.concatenate(rows)


def head_vocabulary(corpus: TeacherCorpus, vocab: int, size: int, first: list[int]) -> np.ndarray:
    """The `size` token ids the draft's head scores: the ids `first` (its end tokens), then those most often in the
    corpus's text or the target's best prediction, ties (ids never seen among them) by the lower id."""
    counts = np.bincount(corpus.ids, minlength=vocab) + np.bincount(corpus.topk_ids[:, 0], minlength=vocab)
    counts[[i for i in first if i is not None and 0 <= i < vocab]] = counts.max() + 1
    return np.argsort(-counts, kind="stable")[:size].astype(np.int64)


class Head:
    """The draft's output projection over the ids it scores: all (`kept` None), or contract.HEAD_VOCABULARY's; the
    teacher's top-k ids as its columns."""

    def __init__(self, vocab: int, kept: np.ndarray | None = None):
        self.kept = kept
        self.spread = np.full(vocab, -1, dtype=np.int64)  # each id's column, -1 where not scored
        self.spread[np.arange(vocab) if kept is None else kept] = np.arange(vocab if kept is None else len(kept))

    def logp(self, draft, hidden):
        """log-softmax [P, columns] of the draft's logits over the ids it scores."""
        import torch

        weight = draft.lm_head.weight
        if self.kept is not None:
            weight = weight[torch.from_numpy(self.kept).to(weight.device)]
        return torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)

    def ids(self, columns: np.ndarray) -> np.ndarray:
        return columns if self.kept is None else self.kept[columns]


def _student_logp(draft, head: Head, ids, mask, where):
    """The draft's log-softmax [P, columns] at the predicted positions only (the output projection skips the rest)."""
    import torch

    on = draft.device
    hidden = draft.model(input_ids=torch.from_numpy(ids).to(on),
                         attention_mask=torch.from_numpy(mask).to(on)).last_hidden_state
    picked = hidden[torch.from_numpy(where[:, 0]).to(on), torch.from_numpy(where[:, 1]).to(on)]
    return head.logp(draft, picked)


def distill_loss(logp, head: Head, topk_ids, topk_logp):
    """Cross-entropy of the draft's log-probabilities [P, columns] against the target's top-k distribution,
    renormalized over the ids the draft scores (a row with none of them weighs nothing)."""
    import torch

    columns = torch.from_numpy(head.spread[topk_ids.astype(np.int64)]).to(logp.device)
    teacher = torch.from_numpy(topk_logp.astype(np.float32)).to(logp.device).masked_fill(columns < 0, float("-inf"))
    teacher = torch.nan_to_num(torch.softmax(teacher, dim=-1), nan=0.0)  # over the top k it scores
    return -(teacher * logp.gather(1, columns.clamp(min=0))).sum(-1).mean()


def agreement(draft, head: Head, corpus: TeacherCorpus, pad: int, batch_size: int = 16, seq_len: int = 512) -> dict:
    """Top-1 agreement with the target and the loss, over every prediction of the corpus, overall and by kind."""
    import torch

    hits: dict[str, list[int]] = {}
    loss = 0.0
    draft.eval()
    with torch.no_grad():
        for start in range(0, len(corpus), batch_size):
            picks = range(start, min(len(corpus), start + batch_size))
            ids, mask, where, rows = _batch(corpus, picks, seq_len, pad)
            logp = _student_logp(draft, head, ids, mask, where)
            loss += distill_loss(logp, head, corpus.topk_ids[rows], corpus.topk_logp[rows]).item() * len(rows)
            same = head.ids(logp.argmax(-1).cpu().numpy()) == corpus.topk_ids[rows, 0]
            for b, hit in zip(where[:, 0], same):
                hits.setdefault(corpus.kinds[picks[b]], []).append(int(hit))
    draft.train()
    every = [h for v in hits.values() for h in v]
    return {"top1_agreement": round(float(np.mean(every)), 4), "loss": round(loss / len(every), 4),
            "by_kind": {k: round(float(np.mean(v)), 4) for k, v in sorted(hits.items())}, "predictions": len(every)}


def draft_key(cfg: DraftConfig, teacher_key: str) -> str:
    """What the draft's weights depend on: the training corpus's key and the settings (not the held-out set's)."""
    settings = {k: v for k, v in asdict(cfg).items()
                if k not in ("out", "cache", "threads", "device", "time_limit", "target", "tokenizer",
                             "val_prompts")}
    return hashlib.sha256(json.dumps({"teacher": teacher_key, **settings}, sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


def make_draft(cfg: DraftConfig, progress: bool = True) -> dict:
    """The teacher corpora (made or read from the cache), a new draft distilled on them, written to cfg.dest (kept
    where its record names the same key); returns the record."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.checkpoints.train import adamw, cosine_lr, optimizer_step

    started = time.perf_counter()
    if not (Path(cfg.target) / "config.json").is_file():
        raise SpecrtError(f"target {cfg.target} is not a Hugging Face checkpoint directory (no config.json)")
    check_replaceable(cfg.dest, RECORD, "a draft `specrt models draft` made")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    cfg.check_device()
    train, train_record = build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("train"), cfg.cache, "train",
                                       cfg.threads, progress, cfg.device)
    val, val_record = build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("validation"), cfg.cache, "validation",
                                   cfg.threads, progress, cfg.device)
    key = draft_key(cfg, train_record["key"])
    dest = cfg.dest
    made = json.loads((dest / RECORD).read_text()) if (dest / RECORD).is_file() else {}
    if made.get("key") == key and made["teacher"]["validation"]["key"] == val_record["key"]:
        return made
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, local_files_only=True, dtype=torch.float32)
    draft = new_draft(target, cfg.hidden, cfg.layers, cfg.seed).to(cfg.device)
    del target
    pad = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0
    vocab = draft.config.vocab_size
    head = Head(vocab)
    if 0 < cfg.head_vocab < vocab:
        eos = draft.config.eos_token_id
        head = Head(vocab, head_vocabulary(train, vocab, cfg.head_vocab, eos if isinstance(eos, list) else [eos]))
        setattr(draft.config, HEAD_VOCABULARY, head.kept.tolist())
    before = agreement(draft, head, val, pad)
    if made.get("key") == key:  # the same draft, another held-out set: measured again, not trained again
        draft = AutoModelForCausalLM.from_pretrained(dest, local_files_only=True, dtype=torch.float32).to(cfg.device)
        record = {**made, "teacher": {**made["teacher"], "validation": val_record}, "before": before,
                  "after": agreement(draft, head, val, pad)}
        _write(draft, tokenizer, record, cfg, dest, train)
        return record
    opt = adamw(draft, cfg.lr, weight_decay=0.01)
    rng = np.random.default_rng(cfg.seed)
    history, t0, step, planned = [], time.perf_counter(), 0, cfg.steps
    draft.train()
    with tqdm(total=planned, desc="distill draft", unit="step", disable=not progress) as bar:
        while step < planned:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, cfg.lr, cfg.warmup_steps, planned, min_ratio=0.1)
            picks = rng.integers(0, len(train), cfg.batch_size)
            ids, mask, where, rows = _batch(train, picks, cfg.seq_len, pad, rng, cfg.positions)
            loss = distill_loss(_student_logp(draft, head, ids, mask, where), head, train.topk_ids[rows],
                                train.topk_logp[rows])
            optimizer_step(opt, loss, draft)
            if step % 50 == 0:
                history.append({"step": step, "loss": round(loss.item(), 4)})
            step += 1
            bar.update()
            if cfg.time_limit is not None and step == min(PACE_STEPS, planned):  # the steps the rest of the time fits
                pace = (time.perf_counter() - t0) / step
                planned = min(planned, max(step, step + int((started + cfg.time_limit - time.perf_counter()) / pace)))
                bar.total = planned
    seconds = time.perf_counter() - t0
    if history[-1]["step"] != step - 1:  # the last step's loss too
        history.append({"step": step - 1, "loss": round(loss.item(), 4)})
    if planned < cfg.steps:  # keyed by what it ran: the same inputs without the limit train it whole
        key = draft_key(replace(cfg, steps=planned), train_record["key"])
    after = agreement(draft, head, val, pad)
    scored = {} if head.kept is None else {"head_vocabulary": {
        "size": len(head.kept), "scored_share_of_held_out_predictions": round(float(
            (head.spread[val.topk_ids[:, 0]] >= 0).mean()), 4)}}
    record = {"key": key, "target": str(cfg.target), "config": {k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in asdict(cfg).items()},
              "num_params": sum(p.numel() for p in draft.parameters()), "teacher": {"train": train_record,
                                                                                     "validation": val_record},
              "before": before, "after": after, "train_seconds": round(seconds, 1), "history": history,
              "threads": torch.get_num_threads(), "device": str(draft.device), "steps_run": planned, **scored,
              **({"time_limited": f"{planned} of {cfg.steps} steps: the time limit of {cfg.time_limit:g} s fitted "
                                  f"no more"} if planned < cfg.steps else {})}
    _write(draft, tokenizer, record, cfg, dest, train)
    return record


def _write(draft, tokenizer, record: dict, cfg: DraftConfig, dest: Path, text: TeacherCorpus) -> None:
    """The draft (in cfg.save_dtype), its tokenizer, its record, its held-out prompts and the text it learnt from
    into `dest`, whole or not at all."""
    import torch

    from specrt.files import replace_dir, write_json_atomic

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{record['key']}")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.to("cpu", getattr(torch, cfg.save_dtype)).save_pretrained(tmp, safe_serialization=True)
    save_text(tmp, text)
    tokenizer.save_pretrained(tmp)
    write_held_out(tmp, tokenizer, cfg, record)
    write_json_atomic(tmp / RECORD, record)
    replace_dir(tmp, dest)


def save_text(directory: Path, text: TeacherCorpus) -> None:
    """The text a draft or head learnt from (its sequences' ids and offsets) into directory/TEXT: what `specrt ngram
    prior --corpus` makes a bundle's n-gram prior from."""
    np.savez(directory / TEXT, ids=text.ids.astype(np.int32), offsets=text.offsets.astype(np.int64))


def write_held_out(directory: Path, tokenizer, cfg: TargetTextConfig, record: dict) -> None:
    """The held-out prompts a draft's record was measured on (`after`), as `specrt calibrate --prompts` reads them,
    into directory/PROMPTS."""
    asked = record["teacher"]["validation"].get("asked", {}).get("requests", [])
    held_out = spread(mixed_prompts(tokenizer, cfg.val_prompts, "validation", cfg.seed),
                      [Prompt(OWN_CHAT, as_chat(tokenizer, r)) for r in asked])
    (directory / PROMPTS).write_text("".join(json.dumps({"prompt": p.text, "kind": p.kind}) + "\n" for p in held_out))
