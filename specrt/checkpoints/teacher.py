"""What a draft is distilled from on a real target: the target's own text and its top-k next-token log-probabilities.

A draft's drafts are accepted where it proposes what the target would emit, so it learns from text the target itself
writes (sequence-level distillation, as DistillSpec's "on-policy" data and EAGLE's regenerated corpus): the target's
greedy continuations of mixed prompts (prompt_mix.py: code, prose, chat through its template), beside windows of
Python source read teacher-forced. A chat model also answers requests it wrote itself: sampled from the opening of a
user's turn in its own template, they are as varied as the traffic it was tuned for, where the mix's chats are mostly
requests for code (Magpie, Xu et al. 2024, section 2.1; greedy answers here, not sampled ones).

At every position the target predicts, its top-k log-probabilities are kept (a real vocabulary is too large to keep
whole: 49152 floats a position for SmolLM2, 262144 for Gemma 3), read off the logits of the same forward passes that
generate the text, so the text costs one pass of the target.

The corpus is written atomically under its cache directory as `<key>.npz` with `<key>.json` beside it, the key a hash
of everything it depends on (the target's weights, the tokenizer, the prompts, every setting), so a second
distillation with the same inputs reads it instead of running the target again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.checkpoints.prompt_mix import OWN_CHAT, Prompt, as_chat, mixed_prompts, user_turn
from specrt.config import Config, option
from specrt.held_out import near_benchmark, words

FORMAT = 1
ASK_TOKENS = 48  # a self-asked request not ended within this many tokens is dropped
VALIDATION_SHARE = 8  # one self-asked request in 8, by a hash of its words, is a held-out one; the rest train


@dataclass(frozen=True)
class TeacherConfig(Config):
    prompts: int = option(1024, "prompts the target continues greedily (prompt_mix: code, prose, chat)", ge=0)
    own_chats: int = option(512, "requests the target writes itself from its chat template's opening of a user's "
                                 "turn (sampled, Magpie), then answers greedily; none without a template", ge=0)
    new_tokens: int = option(128, "tokens the target writes for each", ge=1)
    source_windows: int = option(128, "windows of Python source read teacher-forced", ge=0)
    window: int = option(256, "tokens per source window", ge=8)
    top_k: int = option(32, "the target's log-probabilities kept per position (its top k)", ge=1)
    gen_batch: int = option(48, "prompts generated at once", ge=1)
    seed: int = option(0, "seed of the prompts and windows drawn", ge=0)


@dataclass
class TeacherCorpus:
    """Sequences (token ids) and, for each position the target predicted in them, its top-k log-probabilities."""
    ids: np.ndarray  # [total tokens] int32: the sequences end to end
    offsets: np.ndarray  # [num sequences + 1] int64: sequence s is ids[offsets[s]:offsets[s + 1]]
    first: np.ndarray  # [num sequences] int32: the first position (within its sequence) with the target's prediction
    rows: np.ndarray  # [num sequences + 1] int64: sequence s's predictions are topk_*[rows[s]:rows[s + 1]]
    topk_ids: np.ndarray  # [num predictions, k] int32, best first
    topk_logp: np.ndarray  # [num predictions, k] float16: log-softmax of the target's logits at those ids
    kinds: list[str]  # per sequence: code, prose, chat, own-chat or source

    def __len__(self) -> int:
        return len(self.first)

    def sequence(self, s: int) -> tuple[np.ndarray, int, slice]:
        """(ids, first predicted position, rows of its predictions) of sequence s; position first + j predicts
        ids[first + j + 1] and has row rows.start + j."""
        return self.ids[self.offsets[s]:self.offsets[s + 1]], int(self.first[s]), slice(self.rows[s], self.rows[s + 1])

    def save(self, path: Path, record: dict) -> None:
        from specrt.files import write_atomic, write_json_atomic

        import io

        buf = io.BytesIO()
        np.savez(buf, ids=self.ids, offsets=self.offsets, first=self.first, rows=self.rows, topk_ids=self.topk_ids,
                 topk_logp=self.topk_logp, kinds=np.asarray(self.kinds))
        write_atomic(path.with_suffix(".npz"), buf.getvalue())
        write_json_atomic(path.with_suffix(".json"), record)

    @classmethod
    def load(cls, path: Path) -> "TeacherCorpus":
        with np.load(path.with_suffix(".npz")) as z:
            return cls(z["ids"], z["offsets"], z["first"], z["rows"], z["topk_ids"], z["topk_logp"],
                       [str(k) for k in z["kinds"]])


def cache_key(target: Path, tokenizer_dir: Path, cfg: TeacherConfig, split: str, inputs: list) -> str:
    """Hash of the target's weights and config, the tokenizer, the settings, the split and the inputs (the prompts'
    text and the source windows' ids)."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "split": split, **asdict(cfg), "inputs": inputs},
                                  sort_keys=True).encode())
    for directory in (target, tokenizer_dir):
        for f in sorted(Path(directory).glob("*")):
            if f.suffix in (".json", ".safetensors", ".jinja", ".model"):
                h.update(f.name.encode())
                h.update(hashlib.sha256(f.read_bytes()).digest() if f.stat().st_size < 1 << 26 else
                         f"{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class _TopK:
    """A logits processor that keeps each step's top-k log-probabilities of the raw logits and changes nothing."""

    def __init__(self, k: int):
        self.k, self.steps = k, []

    def __call__(self, input_ids, scores):
        import torch

        logp = torch.log_softmax(scores.float(), dim=-1)
        values, ids = logp.topk(self.k, dim=-1)
        self.steps.append((ids.to(torch.int32).cpu().numpy(), values.to(torch.float16).cpu().numpy()))
        return scores


def _generate(model, tokenizer, prompts: list[list[int]], cfg: TeacherConfig, bar) -> list[tuple]:
    """(prompt + continuation ids, first predicted position, topk ids, topk logp) per prompt: greedy, batched with
    left padding, each continuation cut after the end token."""
    import torch
    from transformers import LogitsProcessorList

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    out = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # like lengths together: less padding
    done = {}
    for start in range(0, len(order), cfg.gen_batch):
        chunk = order[start:start + cfg.gen_batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, i in enumerate(chunk):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        keep = _TopK(cfg.top_k)
        with torch.no_grad():
            gen = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                                 max_new_tokens=cfg.new_tokens, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([keep]))[:, width:]
        top_ids = np.stack([s[0] for s in keep.steps], axis=1)  # [B, steps, k]
        top_logp = np.stack([s[1] for s in keep.steps], axis=1)
        gen = gen.cpu()
        for r, i in enumerate(chunk):
            new = gen[r].tolist()
            n = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
            done[i] = (np.asarray(prompts[i] + new[:n], dtype=np.int32), len(prompts[i]) - 1, top_ids[r, :n],
                       top_logp[r, :n])
        bar.update(len(chunk))
    out = [done[i] for i in range(len(prompts))]
    return out


def split_of(request: str) -> str:
    """The split a self-asked request belongs to, by a hash of its words: the same request, drawn in either split's
    sampling, is in one of them only."""
    digest = hashlib.sha256(" ".join(sorted(words(request))).encode()).digest()
    return "validation" if int.from_bytes(digest[:4], "little") % VALIDATION_SHARE == 0 else "train"


def _dropped(text: str | None, tokens: list[int], markup: set[int], seen: set[frozenset]) -> str | None:
    """Why a drawn request is not kept (None: it is): not ended, the template's markup in it, fewer than three words,
    near a benchmark's prompt, or written before (the same words)."""
    return ("unended" if text is None else "markup" if markup.intersection(tokens) else
            "short" if len(words(text)) < 3 else "benchmark" if near_benchmark(text) else
            "repeated" if words(text) in seen else None)


def _ask(model, tokenizer, cfg: TeacherConfig, split: str, progress: bool) -> tuple[list[str], dict]:
    """Up to cfg.own_chats requests of `split` that the target writes itself after the opening of a user's turn in its
    chat template (temperature 1, no truncation, as Magpie samples), each ended by the template's own end of the turn
    within ASK_TOKENS tokens; a request with the template's markup in it, of fewer than three words, written before,
    or near a benchmark's chat prompt (held_out.near_benchmark) is dropped. Returns them and a record of the
    drawing."""
    import torch
    from tqdm import tqdm

    opening = user_turn(tokenizer)
    if opening is None or not cfg.own_chats:
        return [], {}
    prefix = tokenizer.encode(opening[0], add_special_tokens=False)
    end = tokenizer.encode(opening[1], add_special_tokens=False)[0]
    eos = model.generation_config.eos_token_id
    stops = {end, *(eos if isinstance(eos, list) else [eos])} - {None}
    markup = set(tokenizer.all_special_ids) - {end}
    torch.manual_seed(int.from_bytes(hashlib.sha256(f"{cfg.seed}:{split}".encode()).digest()[:4], "little"))
    share = 1 / VALIDATION_SHARE if split == "validation" else 1 - 1 / VALIDATION_SHARE
    most = int(4 * cfg.own_chats / share) + cfg.gen_batch  # draws at most: a model that rarely ends a turn stops here
    asked, seen, drawn, elsewhere = [], set(), 0, 0
    dropped = dict.fromkeys(("unended", "markup", "short", "benchmark", "repeated"), 0)
    batch = torch.tensor([prefix] * cfg.gen_batch, dtype=torch.long, device=model.device)
    with tqdm(total=cfg.own_chats, desc=f"self-asked requests ({split})", unit="req", disable=not progress) as bar:
        while len(asked) < cfg.own_chats and drawn < most:
            with torch.no_grad():
                out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=ASK_TOKENS, eos_token_id=sorted(stops),
                                     pad_token_id=end)[:, len(prefix):].tolist()
            for row in out:
                if len(asked) == cfg.own_chats:
                    break
                drawn += 1
                stop = next((j for j, t in enumerate(row) if t in stops), None)
                text = tokenizer.decode(row[:stop]).strip() if stop is not None and row[stop] == end else None
                why = _dropped(text, row[:stop], markup, seen)
                if why is not None:
                    dropped[why] += 1
                    continue
                seen.add(words(text))
                if split_of(text) != split:
                    elsewhere += 1
                    continue
                asked.append(text)
                bar.update(1)
    return asked, {"requests": asked, "drawn": drawn, "dropped": dropped, "other_split": elsewhere}


def _source_windows(model, windows: list[list[int]], cfg: TeacherConfig, bar) -> list[tuple]:
    """(window ids, 0, topk ids, topk logp) of each window, read teacher-forced in batches."""
    import torch

    out = []
    for start in range(0, len(windows), cfg.gen_batch):
        batch = torch.tensor(windows[start:start + cfg.gen_batch], dtype=torch.long)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=batch.to(model.device)).logits.float(), dim=-1)
        values, ids = (t.cpu() for t in logp.topk(cfg.top_k, dim=-1))
        for r in range(len(batch)):
            out.append((batch[r].numpy().astype(np.int32), 0, ids[r].to(torch.int32).numpy(),
                        values[r].to(torch.float16).numpy()))
        bar.update(len(batch))
    return out


def build_corpus(target: Path, tokenizer_dir: Path, cfg: TeacherConfig, cache: Path, split: str = "train",
                 threads: int | None = None, progress: bool = True,
                 device: str = "cpu") -> tuple[TeacherCorpus, dict]:
    """The teacher corpus of `split` (train or validation) for this target, from the cache where it is there;
    returns it with its record. The target runs on `device` (cpu, or cuda: a lent GPU writes the text in minutes);
    the device is recorded, not keyed: it writes the same text up to the float32 rounding of its kernels."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.checkpoints.corpus import corpus_windows

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    prompts = mixed_prompts(tokenizer, cfg.prompts, split, cfg.seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    windows = corpus_windows(encode, cfg.source_windows, cfg.window, cfg.seed, split) if cfg.source_windows else []
    key = cache_key(target, tokenizer_dir, cfg, split, [[p.kind, p.text] for p in prompts] + windows)
    path = Path(cache) / f"teacher-{split}-{key}"
    if path.with_suffix(".npz").is_file() and path.with_suffix(".json").is_file():
        return TeacherCorpus.load(path), json.loads(path.with_suffix(".json").read_text())
    if threads is not None:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32).to(device).eval()
    t0 = time.perf_counter()
    asked, asking = _ask(model, tokenizer, cfg, split, progress)
    prompts = prompts + [Prompt(OWN_CHAT, as_chat(tokenizer, a)) for a in asked]
    with tqdm(total=len(prompts) + len(windows), desc=f"teacher corpus ({split})", unit="seq",
              disable=not progress) as bar:
        made = _generate(model, tokenizer, [encode(p.text) for p in prompts], cfg, bar) if prompts else []
        made += _source_windows(model, windows, cfg, bar)
    kinds = [p.kind for p in prompts] + ["source"] * len(windows)
    lengths = [len(m[0]) for m in made]
    counts = [len(m[2]) for m in made]
    corpus = TeacherCorpus(
        ids=np.concatenate([m[0] for m in made]), offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        first=np.asarray([m[1] for m in made], dtype=np.int32),
        rows=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        topk_ids=np.concatenate([m[2] for m in made]), topk_logp=np.concatenate([m[3] for m in made]), kinds=kinds)
    record = {"format": FORMAT, "key": key, "split": split, "target": str(target), "config": asdict(cfg),
              "sequences": {k: kinds.count(k) for k in sorted(set(kinds))}, "tokens": int(len(corpus.ids)),
              "predictions": int(len(corpus.topk_ids)), "seconds": round(time.perf_counter() - t0, 1),
              "threads": torch.get_num_threads(), "device": str(model.device), "asked": asking}
    Path(cache).mkdir(parents=True, exist_ok=True)
    corpus.save(path, record)
    return corpus, record
