"""`specrt models eagle`: a feature-level draft head for a target (EAGLE), trained on the target's own text.

A small independent draft guesses from the tokens alone; the head (eagle_head.py) reads the target's own last hidden
state, so it guesses with what the target already computed. Its data is the draft's (teacher.py: the target's greedy
continuations of mixed prompts and self-asked requests, the same cached corpora `specrt models draft` reads), read
once more by the target teacher-forced for its hidden states n_p and greedy tokens:

    loss    at each position and depth d <= `--depth`: smooth L1 between the head's n^_{p+d} and the target's n_{p+d}
            (EAGLE's feature regression) plus `--ce-weight` x the cross-entropy of the LM head's scores over the
            `--head-vocab` most frequent ids against the target's greedy token, weighted 0.8^(d-1); uniform noise of
            `--noise` on the true features it reads
    eval    on the held-out corpus, at the positions the target wrote: the share of the head's first guesses that are
            the target's greedy token, and the guesses a chain of `--eval-depth` gets accepted per round, by kind

With `--device cuda` the target writes the text and gives its features, and the head trains, on a GPU (as `specrt
models draft --device`: recorded, not keyed); the head is saved for any device.

The directory holds `config.json` (the head's shape, its head vocabulary, what target it reads), `model.safetensors`
(fc, model.layers.0.*, model.norm), `validation-prompts.jsonl` (the held-out prompts, for `specrt calibrate
--prompts`), `teacher-text.npz` (the text it learnt from, as a draft's: `specrt ngram prior --corpus` makes a bundle's
n-gram prior of it) and `eagle.json` (the record, keyed by what made it: run again with the same inputs, it is kept),
written whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.checkpoints.draft import TEXT, TargetTextConfig, head_vocabulary, save_text, write_held_out
from specrt.checkpoints.teacher import TeacherCorpus, build_corpus
from specrt.config import option
from specrt.contract import EAGLE_HEAD, HEAD_VOCABULARY
from specrt.errors import SpecrtError
from specrt.files import check_replaceable

RECORD = "eagle.json"


@dataclass(frozen=True)
class EagleConfig(TargetTextConfig):
    out: Path | None = option(None, "where the head goes (default: build/eagles/<target's directory name>)")
    steps: int = option(2500, "optimizer steps", ge=1)
    batch_size: int = option(8, "sequences per step", ge=1)
    seq_len: int = option(384, "tokens per sequence at most (longer ones are cut)", ge=8)
    lr: float = option(1e-3, "peak learning rate", gt=0)
    warmup_steps: int = option(30, "linear warm-up steps", ge=0)
    depth: int = option(1, "depths trained at once (the head fed its own predictions: EAGLE-3's training-time test)",
                        ge=1)
    eval_depth: int = option(5, "the chain length acceptance is measured for", ge=1)
    noise: float = option(0.1, "amplitude of the uniform noise on the true features the head reads in training", ge=0)
    ce_weight: float = option(0.1, "weight of the token cross-entropy beside the feature regression", ge=0)

    @property
    def dest(self) -> Path:
        return self.out if self.out is not None else Path("build/eagles") / Path(self.target).name


@dataclass
class Features:
    """Per sequence of a corpus (cut to seq_len): ids, the target's last hidden states [L, H] and greedy tokens [L]
    (greedy[p]: the token it predicts after position p), the first position it wrote, and its kind."""
    ids: list
    hidden: list
    greedy: list
    first: list
    kinds: list

    def batch(self, picks, torch, device="cpu"):
        """(features [B, T, H], next tokens x_{p+1} [B, T], greedy [B, T] (-1 past the end)) of `picks` on `device`,
        and their lengths."""
        width = max(len(self.ids[i]) for i in picks)
        size = self.hidden[picks[0]].shape[1]
        feats = torch.zeros(len(picks), width, size)
        nxt = torch.zeros(len(picks), width, dtype=torch.long)
        greedy = torch.full((len(picks), width), -1, dtype=torch.long)
        for b, i in enumerate(picks):
            n = len(self.ids[i])
            feats[b, :n] = torch.from_numpy(self.hidden[i])
            nxt[b, :n - 1] = torch.from_numpy(self.ids[i][1:].astype(np.int64))
            greedy[b, :n] = torch.from_numpy(self.greedy[i].astype(np.int64))
        return feats.to(device), nxt.to(device), greedy.to(device), [len(self.ids[i]) for i in picks]


def target_features(target, corpus: TeacherCorpus, seq_len: int, batch_size: int = 8, bar=None) -> Features:
    """The target's last hidden states and greedy tokens over each sequence of `corpus` (source windows, which the
    target did not write, left out), teacher-forced in right-padded batches on the target's device."""
    import torch

    decoder, weight = target.base_model, target.get_output_embeddings().weight
    keep = [s for s in range(len(corpus)) if corpus.kinds[s] != "source"]
    out = Features([], [], [], [], [])
    with torch.no_grad():
        for start in range(0, len(keep), batch_size):
            seqs = [corpus.sequence(s) for s in keep[start:start + batch_size]]
            cut = [ids[:seq_len].astype(np.int64) for ids, _, _ in seqs]
            width = max(len(c) for c in cut)
            ids = torch.zeros(len(cut), width, dtype=torch.long)
            mask = torch.zeros(len(cut), width, dtype=torch.long)
            for b, c in enumerate(cut):
                ids[b, :len(c)], mask[b, :len(c)] = torch.from_numpy(c), 1
            hidden = decoder(input_ids=ids.to(target.device), attention_mask=mask.to(target.device)
                             ).last_hidden_state.float()
            for b, (c, (_, first, _)) in enumerate(zip(cut, seqs)):
                h = hidden[b, :len(c)]
                out.ids.append(c)
                out.hidden.append(h.cpu().numpy().copy())
                out.greedy.append((h @ weight.T.float()).argmax(-1).cpu().numpy().astype(np.int32))
                out.first.append(first)
                out.kinds.append(corpus.kinds[keep[start + b]])
            if bar is not None:
                bar.update(len(seqs))
    return out


def _depth_targets(feats, greedy, lengths, d: int, torch):
    """(true n_{p+d} [B, T, H], greedy token after p + d [B, T], valid [B, T]) for the depth-d predictions at p."""
    batch, width, _ = feats.shape
    want = torch.zeros_like(feats)
    want[:, :width - d] = feats[:, d:]
    label = torch.full((batch, width), -1, dtype=torch.long, device=feats.device)
    label[:, :width - d] = greedy[:, d:]
    valid = torch.zeros(batch, width, dtype=torch.bool, device=feats.device)
    for b, n in enumerate(lengths):
        valid[b, :max(0, n - d)] = True
    return want, label, valid


def acceptance(head, data: Features, embed, weight, kept, depth: int, batch_size: int = 8) -> dict:
    """At the positions the target wrote (a chain's tokens are its greedy ones there): the share of first guesses
    right, and the guesses a chain of `depth` gets accepted per round, overall and by kind."""
    import torch

    kept_t = torch.as_tensor(kept, device=weight.device)
    rows = weight[kept_t]
    tally: dict[str, list[float]] = {}
    head.eval()
    with torch.no_grad():
        for start in range(0, len(data.ids), batch_size):
            picks = list(range(start, min(len(data.ids), start + batch_size)))
            feats, nxt, greedy, lengths = data.batch(picks, torch, weight.device)
            alive = torch.ones(feats.shape[:2], dtype=torch.bool, device=weight.device)
            accepted = torch.zeros(feats.shape[:2], device=weight.device)
            for d, out in enumerate(head.chain(embed, feats, nxt, depth), 1):
                _, label, _ = _depth_targets(feats, greedy, lengths, d, torch)
                alive &= kept_t[(out @ rows.T).argmax(-1)] == label
                accepted += alive
                if d == 1:
                    first = alive.clone()
            for b, i in enumerate(picks):
                span = slice(max(0, data.first[i] - 1), max(0, lengths[b] - 1 - depth))  # chains inside the answer
                t = tally.setdefault(data.kinds[i], [0, 0.0, 0.0])
                t[0] += len(range(*span.indices(lengths[b])))
                t[1] += float(first[b, span].sum())
                t[2] += float(accepted[b, span].sum())
    head.train()
    n = max(1, sum(t[0] for t in tally.values()))
    return {"first_guess": round(sum(t[1] for t in tally.values()) / n, 4),
            "accepted_per_round": round(sum(t[2] for t in tally.values()) / n, 4), "depth": depth,
            "positions": int(n), "by_kind": {k: {"first_guess": round(t[1] / max(1, t[0]), 4),
                                                 "accepted_per_round": round(t[2] / max(1, t[0]), 4)}
                                             for k, t in sorted(tally.items())}}


def eagle_key(cfg: EagleConfig, teacher_key: str) -> str:
    """What the head's weights depend on: the training corpus's key (the target's weights among its inputs) and the
    settings (not where it goes, nor what it is measured on)."""
    settings = {k: v for k, v in asdict(cfg).items()
                if k not in ("out", "cache", "threads", "device", "target", "tokenizer", "val_prompts", "eval_depth")}
    return hashlib.sha256(json.dumps({"eagle": teacher_key, **settings}, sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


def make_eagle(cfg: EagleConfig, progress: bool = True) -> dict:
    """The teacher corpora (made or read from the cache), the target's features over them, a head trained on them and
    written to cfg.dest (kept where its record names the same key); returns the record."""
    import torch
    from torch.nn import functional as F
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from specrt.checkpoints.eagle_head import EagleHead, head_shape
    from specrt.checkpoints.train import adamw, cosine_lr, optimizer_step

    if not (Path(cfg.target) / "config.json").is_file():
        raise SpecrtError(f"target {cfg.target} is not a Hugging Face checkpoint directory (no config.json)")
    check_replaceable(cfg.dest, RECORD, "a head `specrt models eagle` made")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    cfg.check_device()
    train_corpus, train_record = build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("train"), cfg.cache, "train",
                                              cfg.threads, progress, cfg.device)
    val_corpus, val_record = build_corpus(cfg.target, cfg.tokenizer_dir, cfg.teacher("validation"), cfg.cache,
                                          "validation", cfg.threads, progress, cfg.device)
    key = eagle_key(cfg, train_record["key"])
    made = json.loads((cfg.dest / RECORD).read_text()) if (cfg.dest / RECORD).is_file() else {}
    if made.get("key") == key and made["teacher"]["validation"]["key"] == val_record["key"] and \
            (cfg.dest / TEXT).is_file():  # a head made before heads kept their text is made again, whole
        return made
    target = AutoModelForCausalLM.from_pretrained(cfg.target, local_files_only=True, dtype=torch.float32
                                                  ).to(cfg.device).eval()
    embed = target.get_input_embeddings().weight.detach()
    weight = target.get_output_embeddings().weight.detach()
    t0 = time.perf_counter()
    written = sum(k != "source" for k in train_corpus.kinds + val_corpus.kinds)
    with tqdm(total=written, desc="target features", unit="seq",
              disable=not progress) as bar:
        train, val = (target_features(target, c, cfg.seq_len, bar=bar) for c in (train_corpus, val_corpus))
    feature_seconds = time.perf_counter() - t0
    vocab = weight.shape[0]
    eos = target.config.get_text_config().eos_token_id
    kept = np.sort(head_vocabulary(train_corpus, vocab, min(cfg.head_vocab or vocab, vocab),
                                   eos if isinstance(eos, list) else [eos]))
    column = torch.full((vocab,), -100, dtype=torch.long, device=cfg.device)
    column[torch.as_tensor(kept, device=cfg.device)] = torch.arange(len(kept), device=cfg.device)
    rows = weight[torch.as_tensor(kept, device=cfg.device)]
    torch.manual_seed(cfg.seed)
    head = EagleHead(head_shape(target.config)).to(cfg.device)
    with torch.no_grad():  # the final norm starts as the target's, so n^ starts on n's scale
        norm = getattr(target.base_model, "norm", None)
        if norm is not None and norm.weight.shape == head.model.norm.weight.shape:
            head.model.norm.weight.copy_(norm.weight)
    del target
    before = acceptance(head, val, embed, weight, kept, cfg.eval_depth)
    opt = adamw(head, cfg.lr, weight_decay=0.0)
    rng = np.random.default_rng(cfg.seed)
    history, t0 = [], time.perf_counter()
    for step in tqdm(range(cfg.steps), desc="train eagle head", unit="step", disable=not progress):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.steps, min_ratio=0.0)
        feats, nxt, greedy, lengths = train.batch(rng.integers(0, len(train.ids), cfg.batch_size).tolist(), torch,
                                                  cfg.device)
        loss = 0.0
        for d, out in enumerate(head.chain(embed, feats, nxt, cfg.depth, cfg.noise), 1):
            want, label, valid = _depth_targets(feats, greedy, lengths, d, torch)
            cols = column[label[valid].clamp(min=0)]
            scored = cols >= 0  # greedy tokens the head scores (the rest weigh nothing)
            ce = F.cross_entropy((out[valid] @ rows.T)[scored], cols[scored]) if scored.any() else 0.0
            loss = loss + (F.smooth_l1_loss(out[valid], want[valid]) + cfg.ce_weight * ce) * 0.8 ** (d - 1)
        optimizer_step(opt, loss, head)
        if step % 50 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": round(float(loss.detach()), 4)})
    record = {"key": key, "target": str(cfg.target),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
              "num_params": sum(p.numel() for p in head.parameters()),
              "teacher": {"train": train_record, "validation": val_record}, "sequences": len(train.ids),
              "before": before, "after": acceptance(head, val, embed, weight, kept, cfg.eval_depth),
              "feature_seconds": round(feature_seconds, 1), "train_seconds": round(time.perf_counter() - t0, 1),
              "history": history, "threads": torch.get_num_threads(), "device": str(cfg.device)}
    _write(head, kept, record, cfg, train_corpus)
    return record


def summary(record: dict) -> str:
    """One line of what a record says: size, time, and acceptance before and after training."""
    b, a = record["before"], record["after"]
    kinds = ", ".join(f"{k} {v['first_guess']:.3f}" for k, v in a["by_kind"].items())
    return (f"an EAGLE head for {record['target']}: {record['num_params'] / 1e6:.1f}M params, trained in "
            f"{record['train_seconds']:.0f} s; first guesses right on held-out answers {b['first_guess']:.3f} -> "
            f"{a['first_guess']:.3f} ({kinds}), accepted a round by a chain of {a['depth']}: "
            f"{b['accepted_per_round']:.3f} -> {a['accepted_per_round']:.3f}")


def _write(head, kept: np.ndarray, record: dict, cfg: EagleConfig, text: TeacherCorpus) -> None:
    """The head's weights, its config, its held-out prompts, the text it learnt from and its record into cfg.dest,
    whole or not at all."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from specrt.files import replace_dir, write_json_atomic

    dest = cfg.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{record['key']}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(tmp / "model.safetensors"))
    write_json_atomic(tmp / "config.json", {EAGLE_HEAD: {**head.shape, "target": record["target"],
                                                         "key": record["key"]},
                                            HEAD_VOCABULARY: kept.tolist()})
    write_held_out(tmp, AutoTokenizer.from_pretrained(cfg.tokenizer_dir, local_files_only=True), cfg, record)
    save_text(tmp, text)
    write_json_atomic(tmp / RECORD, record)
    replace_dir(tmp, dest)
