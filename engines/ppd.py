"""`specrt ppd train`: PPD's prompt tokens (Chen et al., "Hardware-aware parallel prompt decoding", sections 3-4
and appendix A), trained for a bundle's target; their step graph; sparse trees per budget.

Prompt tokens: k prompt tokens x e ensemble prompt tokens (EPTs), extra rows of the target's input embedding
table (ids V + (d - 1) * e + j). Placed after a token at position i, prompt token d (at position i + d, seeing
the prefix and its EPT's prompt tokens 1..d-1) guesses the token at i + d + 1; the guess of distance d is
the average of its EPTs' logits. Nothing of the target changes; logits stay over its V tokens.

Training (section 3.3): only the prompt embeddings train (Adam), by distillation against the target's own
next-token distributions: windows of the demo pair's training text, prompt blocks inserted after random
positions (random insertion), loss sum_d alpha^(d-1) KL(target at i + d || prompt token d), averaged. The
target's rows and the prompt rows are one forward pass: window rows never see prompt rows, so the teacher
is the same model in the same pass, detached. Initialised from the embeddings of random ordinary tokens.

Sparse trees (section 4.2.1, appendix A): from how often the guesses along each candidate path (top-r of each
distance) were all right together against the target's own greedy continuations of held-out text (what
decoding verifies against; measured jointly, not as a product of per-distance accuracies), for a budget of n
step rows: for every split of n into candidates and prompt rows, the candidate tree maximising the expected
accepted length (the greedy Medusa/Sequoia construction), k prompt tokens attached to the root and every
candidate, then prompt tokens removed one at a time where the loss dF = P(the round ends at c) *
(f(T_m) - f(T_m-1)) is least, until the budget holds. A tree is scored by its
steady state: after a round ending at candidate c, the next round's tree is cut to the depth c's prompt
tokens allow, so rounds form a Markov chain over depth limits, and R(T) = sum_s pi_s f(T_s) is what one
round accepts on average. Hardware-aware selection (section 4.2.2) picks among these trees at run time from
the bundle's latency profile: the budget maximising (R + 1) / L(rows + 1).

Prompt tokens trained on a target serve any copy of the same function: `--prompts-from` takes them from
another bundle (e.g. the demo target, for its inflated versions), zero-padded to this hidden size.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt import contract
from specrt.bundle import artifacts
from specrt.bundle.artifacts import PathHit, PromptTokens, Stamp
from specrt.files import write_atomic
from specrt.bundle.manifest import BundleOptions, load_manifest, sha256_file
from specrt.config import config_dict, option
from specrt.engines.ppd_graphs import GRAPH, inplace_graph, prompt_graph
from specrt.engines.ppd_trees import PathModel, sparse_tree
from specrt.errors import SpecrtError

EMBEDDINGS = "ppd/prompt_tokens.npy"
BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class PpdConfig(BundleOptions):
    num_prompt_tokens: int = option(3, "prompt tokens k: guesses at distances 2 .. k + 1", ge=1, le=8)
    num_ensemble: int = option(1, "ensemble prompt tokens (EPTs) per prompt token", ge=1, le=16)
    steps: int = option(1000, "training steps", ge=0)
    batch_size: int = option(8, "training windows per step", ge=1)
    window: int = option(128, "tokens per training window", ge=16)
    corpus: str = option("stdlib", "training windows: stdlib (windows of Python source) or own (the target's own greedy "
                                   "continuations of mixed prompts: code, prose and chat through its template, each "
                                   "window's first quarter prompt: what decoding reads)", choices=("stdlib", "own"))
    insertions: int = option(12, "prompt blocks inserted after random positions of each window", ge=1)
    lr: float = option(0.003, "Adam learning rate of the prompt embeddings", gt=0)
    decay: float = option(0.8, "loss weight alpha^(d-1) of distance d", gt=0, le=1)
    val_windows: int = option(32, "held-out windows the accuracy (and so the trees) is measured on", ge=1)
    new_tokens: int = option(128, "tokens the target decodes after each validation window's text (its first --window / 2 "
                                  "tokens); the accuracy is measured over them: guesses get easier as an output goes "
                                  "on (it repeats itself), so match the output lengths you serve", ge=8,
                                  flag="max-new-tokens")
    prompts: Path | None = option(None, "measure the accuracy (and so the trees) on your own prompts instead of held-out "
                                        "stdlib text: a JSON Lines file of {\"prompt\": \"...\"} (as `specrt calibrate "
                                        "--prompts`), the first --val-windows of at least --window / 2 tokens, each "
                                        "cut to its last --window / 2 tokens and continued by the target's greedy "
                                        "tokens; prompts like your traffic predict it best (never those you benchmark on)")
    max_rank: int = option(8, "guesses per distance ranked (top-k)", ge=1)
    budgets: tuple[int, ...] = option(BUDGETS, "tree sizes (step rows beyond the root) to build sparse trees for", ge=1)
    seed: int = option(0, "seed of initialisation, windows and insertion points", ge=0)
    prompts_from: Path | None = option(None, "a bundle whose target computes the same function (the demo target this "
                                             "one inflates): take its trained prompt tokens (zero-padded to this hidden "
                                             "size) instead of training")
    device: str = option("cpu", "where the target runs (in float32) while training and measuring: cuda for a "
                                "GPU-sized target, e.g. a 7B-class inflation taking the demo target's prompt tokens")


# -- batches: windows with prompt blocks ------------------------------------------------------------
def prompt_block(window: int, points: np.ndarray, k: int, e: int, vocab: int) -> tuple[np.ndarray, ...]:
    """Rows after a window of `window` tokens: for each insertion point i (the block follows token i) and EPT j,
    prompt tokens d = 1..k at positions i + d. Returns (ids [P], positions [P], mask [W + P, W + P] bool,
    rows [len(points), k, e]: the row of (point, distance, EPT))."""
    m = len(points)
    n = window + m * e * k
    mask = np.zeros((n, n), dtype=bool)
    mask[:window, :window] = np.tri(window, dtype=bool)
    ids, pos = np.empty(m * e * k, np.int64), np.empty(m * e * k, np.int64)
    rows = np.empty((m, k, e), np.int64)
    r = window
    for a, i in enumerate(points):
        for j in range(e):
            first = r
            for d in range(1, k + 1):
                ids[r - window], pos[r - window], rows[a, d - 1, j] = contract.prompt_token_id(vocab, e, d, j), i + d, r
                mask[r, : i + 1] = True  # the prefix through token i
                mask[r, first: r + 1] = True  # its EPT's prompt tokens 1..d
                r += 1
    return ids, pos, mask, rows


def _forward(module, windows: np.ndarray, points: np.ndarray, k: int, e: int, vocab: int):
    """One step over windows [B, W] with prompt blocks after `points` [B, M]: (window logits [B, W, V], prompt
    logits [B, M, k, V] averaged over EPTs)."""
    import torch

    batch, width = windows.shape
    parts = [prompt_block(width, p, k, e, vocab) for p in points]
    ids = torch.from_numpy(np.stack([np.concatenate([w, p[0]]) for w, p in zip(windows, parts)]))
    pos = torch.from_numpy(np.stack([np.concatenate([np.arange(width), p[1]]) for p in parts]))
    mask = torch.from_numpy(np.stack([p[2] for p in parts]))
    device = module.rotate_half.device
    past = [torch.zeros(batch, module.num_kv_heads, 0, module.head_dim, dtype=module.rotate_half.dtype, device=device)
            for _ in range(2 * module.num_layers)]
    logits = module(ids.to(device), pos.to(device), mask.to(device), *past)[0]  # [B, W + P, V]
    rows = torch.from_numpy(np.stack([p[3] for p in parts])).to(device)  # [B, M, k, e]
    prompt = torch.stack([logits[b, rows[b]] for b in range(batch)]).mean(dim=3)  # [B, M, k, V]
    return logits[:, :width], prompt


def _points(rng: np.random.Generator, batch: int, width: int, k: int, count: int, low: int = 4) -> np.ndarray:
    """Insertion points i in [low, W - k - 2]: the target's distribution at i + k (the teacher) must exist, and the
    true token at i + k + 1."""
    high = width - k - 1
    count = min(count, high - low)
    return np.stack([np.sort(rng.choice(np.arange(low, high), count, replace=False)) for _ in range(batch)])


def greedy_windows(module, windows: list[list[int]], text: int, batch: int = 8) -> np.ndarray:
    """Each window's first `text` tokens followed by the target's own greedy continuation to the window's length:
    what PPD's guesses are verified against when it decodes (the target's argmax after its own tokens), not the
    text."""
    import torch

    data = np.array(windows, dtype=np.int64)
    width, half = data.shape[1], text
    out = data.copy()
    dev = module.rotate_half.device
    with torch.no_grad():
        for start in range(0, len(data), batch):
            ids = torch.from_numpy(data[start:start + batch, :half]).to(dev)
            b = ids.shape[0]
            past = [torch.zeros(b, module.num_kv_heads, 0, module.head_dim, dtype=module.rotate_half.dtype, device=dev)
                    for _ in range(2 * module.num_layers)]
            pos = torch.arange(half, device=dev).expand(b, half)
            mask = torch.ones(b, half, half, dtype=torch.bool, device=dev).tril()
            for t in range(half, width):
                logits, *new = module(ids, pos, mask, *past)
                past = [torch.cat([p, n], dim=2) for p, n in zip(past, new)]
                ids = logits[:, -1].argmax(-1, keepdim=True)
                out[start:start + b, t] = ids[:, 0].cpu().numpy()
                pos = torch.full((b, 1), t, device=dev)
                mask = torch.ones(b, 1, t + 1, dtype=torch.bool, device=dev)
    return out


def distillation_loss(module, windows: np.ndarray, points: np.ndarray, k: int, e: int, vocab: int, weights):
    """The prompt tokens' loss over windows [B, W] with insertion points [B, M]: KL(target's distribution at i + d ||
    prompt token d's, averaged over EPTs), per distance d weighted by `weights` [k] (on the module's device)."""
    import torch

    window_logits, prompt = _forward(module, windows, points, k, e, vocab)
    idx = torch.from_numpy(points[:, :, None] + np.arange(1, k + 1)).to(weights.device)  # [B, M, k]: teacher row i + d
    teacher = torch.stack([window_logits[b, idx[b]] for b in range(len(windows))]).detach()
    log_t, log_s = torch.log_softmax(teacher, -1), torch.log_softmax(prompt, -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, M, k]
    return (kl.mean(dim=(0, 1)) * weights).sum() / weights.sum()


def train(module, windows: list[list[int]], cfg: PpdConfig, vocab: int, progress: bool = True) -> dict:
    """Train module.prompt_embeddings in place; returns the training record (loss per step)."""
    import torch
    from tqdm import tqdm

    k, e = cfg.num_prompt_tokens, cfg.num_ensemble
    for p in module.parameters():
        p.requires_grad_(False)
    module.prompt_embeddings.requires_grad_(True)
    opt = torch.optim.Adam([module.prompt_embeddings], lr=cfg.lr)
    weights = torch.tensor([cfg.decay ** d for d in range(k)], device=module.rotate_half.device)
    rng = np.random.default_rng(cfg.seed + 1)
    data = np.array(windows, dtype=np.int64)
    losses, t0 = [], time.perf_counter()
    with tqdm(range(cfg.steps), desc="ppd train", unit="step", disable=not progress) as bar:
        for _ in bar:
            batch = data[rng.choice(len(data), cfg.batch_size, replace=len(data) < cfg.batch_size)]
            points = _points(rng, cfg.batch_size, data.shape[1], k, cfg.insertions)
            loss = distillation_loss(module, batch, points, k, e, vocab, weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(round(float(loss.detach()), 5))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    module.prompt_embeddings.requires_grad_(False)
    return {"steps": cfg.steps, "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "losses": losses[:: max(1, len(losses) // 100)], "seconds": round(time.perf_counter() - t0, 2)}


def accuracy(module, windows: np.ndarray, text: int, cfg: PpdConfig, vocab: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """([k][K] P(rank r of prompt token d's guess is the token d + 1 after the insertion point), the same for the
    baseline that guesses every distance from the insertion point's own logits (no prompt tokens), {path of ranks:
    P(every guess along it is right)}) over `windows` of greedy_windows (`text` tokens of text first), at every
    insertion point of the greedy part: the token guessed is the target's own choice after its own tokens, as in decoding (against the text, a
    guess is scored right where the target would reject it and wrong where it would accept it: on the demo target
    that halved the accuracy and the trees' predicted acceptance). The paths are measured jointly because one
    round's guesses are not independent: on the demo target's held-out text, distances 2 and 3 were right together
    at top-1 half as often as the product of their accuracies says (`specrt ppd train` prints both)."""
    import torch

    k, e, top = cfg.num_prompt_tokens, cfg.num_ensemble, cfg.max_rank
    data = np.asarray(windows, dtype=np.int64)
    width = data.shape[1]
    hits, base, total = np.zeros((k, top)), np.zeros((k, top)), 0
    joint: dict[tuple[int, ...], int] = {}
    with torch.no_grad():
        for start in range(0, len(data), 8):
            batch = data[start:start + 8]
            points = np.tile(np.arange(text - 1, width - k - 1), (len(batch), 1))
            window_logits, prompt = _forward(module, batch, points, k, e, vocab)
            truth = np.stack([batch[b][points[b][:, None] + np.arange(2, k + 2)] for b in range(len(batch))])  # [B, M, k]
            guess = prompt.topk(top, dim=-1).indices.cpu().numpy()  # [B, M, k, K]
            own = window_logits.topk(top, dim=-1).indices.cpu().numpy()  # [B, W, K]
            own = np.stack([own[b][points[b]] for b in range(len(batch))])[:, :, None, :]  # [B, M, 1, K]
            right = guess == truth[..., None]
            hits += right.sum(axis=(0, 1))
            base += (own == truth[..., None]).sum(axis=(0, 1))
            total += truth.shape[0] * truth.shape[1]
            ranks = np.where(right.any(-1), right.argmax(-1), top).reshape(-1, k)  # top: no guess was right
            for r in map(tuple, ranks.tolist()):
                for m in range(1, k + 1):
                    if r[m - 1] == top:
                        break
                    joint[r[:m]] = joint.get(r[:m], 0) + 1
    return hits / total, base / total, {path: n / total for path, n in sorted(joint.items())}


def _initial(module, k: int, e: int, seed: int):
    """Prompt embeddings initialised from the embeddings of random ordinary tokens."""
    import torch

    table = module.hf.model.embed_tokens.weight
    ids = np.random.default_rng(seed).choice(table.shape[0], k * e, replace=False)
    return table[torch.from_numpy(ids)].detach().clone()


def _from_other(cfg: PpdConfig, hidden: int, vocab: int) -> tuple[np.ndarray, dict]:
    other = artifacts.load(cfg.prompts_from, PromptTokens)
    if other.vocab_size != vocab or other.hidden_size > hidden:
        raise SpecrtError(f"{cfg.prompts_from}'s prompt tokens are for vocabulary {other.vocab_size} and hidden size "
                          f"{other.hidden_size}; this target has {vocab} and {hidden}")
    if (other.num_prompt_tokens, other.num_ensemble) != (cfg.num_prompt_tokens, cfg.num_ensemble):
        raise SpecrtError(f"{cfg.prompts_from} has {other.num_prompt_tokens} prompt tokens x {other.num_ensemble} EPTs: "
                          f"pass --num-prompt-tokens {other.num_prompt_tokens} --num-ensemble {other.num_ensemble}")
    path = Path(cfg.prompts_from) / other.embeddings
    if sha256_file(path) != other.embeddings_sha256:
        raise SpecrtError(f"{path} changed since `specrt ppd train` wrote it: re-run it for {cfg.prompts_from}")
    small = np.load(path)
    padded = np.zeros((small.shape[0], hidden), dtype=small.dtype)
    padded[:, : small.shape[1]] = small  # an inflated target's added hidden dims are zero in every embedding
    return padded, {"from": str(cfg.prompts_from), "from_sha256": other.embeddings_sha256, "source": other.training}


def train_prompt_tokens(cfg: PpdConfig, progress: bool = True) -> PromptTokens:
    import torch
    from tokenizers import Tokenizer

    from specrt.checkpoints.corpus import corpus_hash, load_corpus
    from specrt.model.checkpoint import load_checkpoint
    from specrt.model.step import StepModule

    bundle = Path(cfg.bundle)
    manifest = load_manifest(bundle, cfg.verify_mode)
    entry = manifest.models["target"]
    if entry.dtype != "float32" and (cfg.prompts_from is None or entry.onnx):
        raise SpecrtError(f"{bundle}'s target is {entry.dtype}: train PPD's prompt tokens on a float32 export (a "
                          f"{entry.dtype} export without ONNX graphs, --no-onnx, can take them with --prompts-from)")
    budgets = sorted(set(cfg.budgets))
    if not budgets or budgets[0] < 1:
        raise SpecrtError("--budgets must be tree sizes >= 1")
    torch.manual_seed(cfg.seed)
    module = StepModule(load_checkpoint(bundle / entry.hf_dir, "float32", cfg.device)).eval()
    vocab, hidden = entry.vocab_size, module.hf.config.hidden_size
    k, e = cfg.num_prompt_tokens, cfg.num_ensemble
    encode = Tokenizer.from_file(str(bundle / manifest.tokenizer / "tokenizer.json")).encode
    ids = (lambda text: encode(text).ids)
    text = cfg.window // 2
    val = greedy_windows(module, validation_windows(cfg, ids), text)
    if cfg.prompts_from is not None:
        prompts, record = _from_other(cfg, hidden, vocab)
        module.prompt_embeddings = torch.nn.Parameter(torch.from_numpy(prompts).to(cfg.device), requires_grad=False)
        initial = accuracy_of(module, _initial(module, k, e, cfg.seed), val, text, cfg, vocab)
    else:
        module.prompt_embeddings = torch.nn.Parameter(_initial(module, k, e, cfg.seed), requires_grad=False)
        initial = accuracy(module, val, text, cfg, vocab)[0]
        windows = training_windows(cfg, module, bundle / manifest.tokenizer, ids)
        record = train(module, windows, cfg, vocab, progress)
        record["corpus_sha256"] = (corpus_hash(load_corpus()[0]) if cfg.corpus == "stdlib" else
                                   hashlib.sha256(np.asarray(windows, dtype=np.int64).tobytes()).hexdigest())
    record.update(config=config_dict(cfg), seed=cfg.seed,
                  validation={"prompts_sha256": sha256_file(cfg.prompts)} if cfg.prompts else
                  {"corpus_sha256": corpus_hash(load_corpus()[1])})
    acc, base, joint = accuracy(module, val, text, cfg, vocab)
    prompts = module.prompt_embeddings.detach().cpu().numpy().astype(np.float32)
    (bundle / EMBEDDINGS).parent.mkdir(exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, prompts)
    write_atomic(bundle / EMBEDDINGS, buf.getvalue())
    parity = prompt_graph(bundle, entry.onnx, GRAPH, prompts, vocab) if entry.onnx else None
    inplace = inplace_graph(bundle, prompts, vocab) if entry.onnx else {}
    model = PathModel(acc, joint)
    trees = tuple(sparse_tree(model, b, e) for b in budgets)
    result = PromptTokens(
        stamp=Stamp.make(bundle), num_prompt_tokens=k, num_ensemble=e, vocab_size=vocab, hidden_size=hidden,
        embeddings=EMBEDDINGS, embeddings_sha256=hashlib.sha256((bundle / EMBEDDINGS).read_bytes()).hexdigest(),
        graph=GRAPH if entry.onnx else None, graph_sha256=sha256_file(bundle / GRAPH) if entry.onnx else None,
        parity=parity, training=record, accuracy=_rounded(acc), baseline_accuracy=_rounded(base),
        initial_accuracy=_rounded(initial),
        path_accuracy=tuple(PathHit(path, round(p, 6)) for path, p in joint.items()), trees=trees, **inplace)
    artifacts.save(bundle, result)
    return result


def training_windows(cfg: PpdConfig, module, tokenizer_dir: Path, encode) -> list[list[int]]:
    """The windows prompt tokens train on: cut from the stdlib's training files, or (corpus "own") the target's greedy
    continuations of the last --window / 4 tokens of mixed training prompts (never the validation split's)."""
    from specrt.checkpoints.corpus import corpus_windows

    num = max(64, cfg.batch_size * 8)
    if cfg.corpus == "stdlib":
        return corpus_windows(encode, num, cfg.window, cfg.seed, "train")
    from transformers import AutoTokenizer

    from specrt.checkpoints.prompt_mix import mixed_prompts

    text = cfg.window // 4
    prompts = mixed_prompts(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True), 2 * num, "train", cfg.seed)
    firsts = [ids[-text:] for ids in (encode(p.text) for p in prompts) if len(ids) >= text][:num]
    return greedy_windows(module, [f + [0] * (cfg.window - text) for f in firsts], text).tolist()


def validation_windows(cfg: PpdConfig, encode) -> list[list[int]]:
    """cfg.val_windows windows of cfg.window / 2 tokens of text (cut from held-out stdlib files, or the ends of
    cfg.prompts' prompts) and cfg.new_tokens after them that greedy_windows fills with the target's own
    continuation."""
    from specrt.checkpoints.corpus import corpus_windows, read_prompts

    half = cfg.window // 2
    if cfg.prompts is None:
        firsts = corpus_windows(encode, cfg.val_windows, half, cfg.seed, "validation")
    else:
        firsts = [ids[-half:] for ids in map(encode, read_prompts(cfg.prompts, None)) if len(ids) >= half][: cfg.val_windows]
        if len(firsts) < cfg.val_windows:
            raise SpecrtError(f"--prompts {cfg.prompts} has {len(firsts)} prompt(s) of at least {half} tokens (--window "
                              f"{cfg.window} / 2); --val-windows asks for {cfg.val_windows}")
    return [first + [0] * cfg.new_tokens for first in firsts]


def accuracy_of(module, embeddings, windows, text: int, cfg: PpdConfig, vocab: int) -> np.ndarray:
    """accuracy() with other prompt embeddings in place (restored after)."""
    saved = module.prompt_embeddings.data.clone()
    module.prompt_embeddings.data = embeddings.to(saved.dtype)
    try:
        return accuracy(module, windows, text, cfg, vocab)[0]
    finally:
        module.prompt_embeddings.data = saved


def _rounded(a: np.ndarray) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(round(float(x), 6) for x in row) for row in a)


def describe(t: PromptTokens) -> str:
    lines = [f"{t.num_prompt_tokens} prompt tokens x {t.num_ensemble} EPT(s): {t.num_prompt_tokens * t.num_ensemble * t.hidden_size} "
             f"parameters; graph parity {t.parity}"]
    for d, (a, b, i) in enumerate(zip(t.accuracy, t.baseline_accuracy, t.initial_accuracy), start=1):
        lines.append(f"distance {d + 1}: top-1 {a[0]:.3f} (no prompt tokens {b[0]:.3f}, untrained {i[0]:.3f}), "
                     f"top-{len(a)} {sum(a):.3f}")
    model, alone = PathModel.of(t), PathModel(t.accuracy)
    for d in range(2, t.num_prompt_tokens + 1):
        top = (0,) * d
        lines.append(f"distances 2-{d + 1} all right at top-1: {model(top):.4f} measured together "
                     f"({alone(top):.4f} if they were independent)")
    for tree in t.trees:
        lines.append(f"budget {tree.budget}: {len(tree.paths)} candidates, prompt tokens {list(tree.prompts)}, rows {tree.rows}"
                     f" (steady state {tree.expected_rows}), accepted per round {tree.expected_accepted:.3f}")
    return "\n".join(lines)
