"""Acceptance calibration: how likely the target's next token is the draft's rank-r candidate, per depth.

On held-out text (the standard-library files the demo pair never trained on; never HumanEval, which is
the benchmark), the target decodes greedily from each prompt; the draft then reads prompt + trajectory
in one teacher-forced step, and we record the rank of each target token among the draft's logits.
From these rank sequences, for tree depth d and rank r < K:

    p[d][r] = P(rank at position s + d - 1 == r | ranks at s .. s + d - 2 all < K)

over every start position s: the chance that the rank-r child of an accepted depth-(d - 1) node is
accepted. Under the product model (SpecInfer, Medusa, Sequoia), a tree node reached by ranks
(r1, ..., rd) is accepted with probability prod_j p[j][r_j]; the expected number of accepted drafted
tokens of a tree is the sum over its nodes, and the best tree of each size is built greedily by adding
the most likely node (a node is never likelier than its parent, so the greedy trees are nested).

The same positions also calibrate the draft's confidence for dynamic trees (`method="dynamic"`): the
temperature T that maximises sum log softmax(draft logits / T)[target's greedy token], so that the
draft's sharpened probability of a token estimates the chance that greedy verification accepts it
(temperature scaling, Guo et al. 2017). A small draft is usually under-confident here: T < 1.
A dynamic tree's shape follows the draft's confidence position by position, so its expected accepted
length is not a product over the depth x rank table: it is measured instead, by decoding the same
prompts with dynamic trees of each size (greedy, batch 1, at the fitted temperature) and counting
accepted drafted tokens and draft calls per round; `specrt tune` weighs those against the profiled
latencies like any static tree. Merged trees (dynamic trees with MERGE_NGRAM_TOKENS n-gram drafts merged
in, `ngram_tokens`) are measured the same way, with the histogram of nodes verified per round (their
number varies: n-gram drafts that agree with the draft model's cost nothing).

Deterministic for a seed: prompts are drawn by a seeded generator and decoding is greedy.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

ACCEPTANCE = "acceptance.json"


@dataclass(frozen=True)
class CalibrationConfig:
    bundle: Path
    num_prompts: int = 24
    prompt_tokens: int = 64
    new_tokens: int = 96
    max_depth: int = 8
    max_rank: int = 8
    max_nodes: int = 64
    seed: int = 0
    threads: int | None = 2
    dynamic_sizes: tuple[int, ...] = (2, 4, 6, 8, 10, 12, 16, 24, 32)  # dynamic trees to measure (() for none)
    merged_sizes: tuple[int, ...] = (4, 6, 8, 10, 12, 16)  # the same, n-gram drafts merged in (() for none)


def validation_prompts(encode, num: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """`num` prompts of `prompt_tokens` tokens cut at seeded offsets from held-out stdlib files."""
    from specrt.models.corpus import load_corpus

    _, val = load_corpus()
    rng = np.random.default_rng(seed)
    prompts = []
    for i in rng.permutation(num * 4):
        f = val[int(i) % len(val)]
        ids = encode(f.text)
        if len(ids) < prompt_tokens + 8:
            continue
        start = int(rng.integers(0, len(ids) - prompt_tokens))
        prompts.append(ids[start:start + prompt_tokens])
        if len(prompts) == num:
            return prompts
    raise SpecrtError(f"only {len(prompts)} validation prompts of {prompt_tokens} tokens could be cut")


TEMPERATURES = np.unique(np.append(np.round(np.geomspace(0.1, 4.0, 81), 4), 1.0))  # draft_temperature's grid (1.0 exact)


def draft_ranks(draft_backend, tokens: list[int], first: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank of tokens[j] among the draft's logits after tokens[:j], for j >= first (teacher forcing),
    and the summed negative log-likelihood of those tokens at each of TEMPERATURES."""
    from specrt.runtime.step_inputs import feed_rows

    cache = draft_backend.new_cache(1)
    logits = feed_rows(draft_backend, cache, [np.asarray(tokens[:-1], dtype=np.int64)])[0]  # [T - 1, V]
    rows = logits[first - 1:].astype(np.float64)
    true = np.asarray(tokens[first:])
    chosen = rows[np.arange(len(true)), true]
    return (rows > chosen[:, None]).sum(axis=-1), nll_by_temperature(rows, true)


def nll_by_temperature(rows: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Summed -log softmax(rows / T)[true] over the rows [N, V], for each T in TEMPERATURES."""
    chosen = rows[np.arange(len(true)), true]
    nll = np.empty(len(TEMPERATURES))
    for i, t in enumerate(TEMPERATURES):
        x = rows / t
        top = x.max(axis=-1)
        nll[i] = float((top + np.log(np.exp(x - top[:, None]).sum(axis=-1)) - chosen / t).sum())
    return nll


def depth_rank_table(rank_seqs: list[np.ndarray], max_depth: int, max_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(p [D, K], support [D]): acceptance of rank r at depth d given an accepted parent, and how many
    start positions each depth's estimate rests on."""
    counts = np.zeros((max_depth, max_rank))
    support = np.zeros(max_depth)
    for ranks in rank_seqs:
        hit = ranks < max_rank
        for s in range(len(ranks)):
            for d in range(max_depth):
                if s + d >= len(ranks):
                    break
                support[d] += 1
                if not hit[s + d]:
                    break
                counts[d, ranks[s + d]] += 1
    return counts / np.maximum(support, 1)[:, None], support


def best_trees(p: np.ndarray, max_nodes: int) -> list[dict]:
    """Nested best trees of 1..max_nodes nodes under the product model, greedily by path probability.

    Returns [{"num_nodes": n, "paths": [...], "expected_accepted": f(n)}] (paths in the order added).
    """
    depth, ranks = p.shape
    heap = [(-p[0, r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    paths, out, total = [], [], 0.0
    while heap and len(paths) < max_nodes:
        neg, path = heapq.heappop(heap)
        prob = -neg
        paths.append(path)
        total += prob
        out.append({"num_nodes": len(paths), "paths": [list(q) for q in paths], "expected_accepted": total})
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (-(prob * p[len(path), r]), path + (r,)))
    return out


def chain_expectation(p: np.ndarray, length: int) -> float:
    """Expected accepted drafted tokens of a chain of rank-0 tokens of the given length."""
    return float(sum(np.prod(p[:d, 0]) for d in range(1, length + 1)))


def dynamic_acceptance(pipe, prompts: list[list[int]], sizes, new_tokens: int, temperature: float,
                       progress: bool = True, ngram_tokens: int = 0) -> list[dict]:
    """Per dynamic tree size (with `ngram_tokens` n-gram drafts merged in): accepted drafted tokens, draft
    calls and verified nodes per round, measured by decoding."""
    from tqdm import tqdm

    from specrt.runtime.methods import MERGE_MIN_PROB, dynamic_shape

    out = []
    desc = "calibrate merged trees" if ngram_tokens else "calibrate dynamic trees"
    bar = tqdm(total=len(sizes) * len(prompts), desc=desc, unit="prompt", disable=not progress)
    for n in sizes:
        accepted = rounds = calls = nodes = 0
        widths: Counter = Counter()
        for prompt in prompts:
            st = pipe.generate([prompt], method="dynamic", num_draft_tokens=n, draft_temperature=temperature,
                               ngram_tokens=ngram_tokens, max_new_tokens=new_tokens)[0].stats
            rounds += st["rounds"]
            accepted += sum(int(k) * v for k, v in st["accepted_hist"].items())
            calls += st["draft_calls"] - 1  # the prompt's prefill is one draft call
            nodes += st["drafted"]
            widths.update(st["drafted_hist"])
            bar.update()
        width, depth = dynamic_shape(n)
        entry = {"num_nodes": n, "width": width, "depth": depth,
                 "expected_accepted": round(accepted / max(1, rounds), 6),
                 "draft_calls_per_round": round(calls / max(1, rounds), 4),
                 "nodes_per_round": round(nodes / max(1, rounds), 4),
                 "nodes_hist": {str(k): widths[k] for k in sorted(widths)}}
        if ngram_tokens:
            entry.update(ngram_tokens=ngram_tokens, ngram_min_prob=MERGE_MIN_PROB)
        out.append(entry)
    bar.close()
    return out


def calibrate(cfg: CalibrationConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    from specrt.runtime.methods import MERGE_NGRAM_TOKENS
    from specrt.runtime.pipeline import Pipeline

    if cfg.max_depth < 1 or cfg.max_rank < 1 or cfg.max_nodes < 1:
        raise SpecrtError("max_depth, max_rank and max_nodes must be >= 1")
    t0 = time.perf_counter()
    pipe = Pipeline.load(cfg.bundle, threads=cfg.threads)
    prompts = validation_prompts(pipe.encode, cfg.num_prompts, cfg.prompt_tokens, cfg.seed)
    rank_seqs, nll = [], np.zeros(len(TEMPERATURES))
    for prompt in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
        out = pipe.generate([prompt], method="autoregressive", max_new_tokens=cfg.new_tokens)[0]
        ranks, prompt_nll = draft_ranks(pipe.draft, prompt + out.token_ids, len(prompt))
        rank_seqs.append(ranks)
        nll += prompt_nll
    p, support = depth_rank_table(rank_seqs, cfg.max_depth, cfg.max_rank)
    trees = best_trees(p, cfg.max_nodes)
    temperature = float(TEMPERATURES[int(np.argmin(nll))])
    dynamic = dynamic_acceptance(pipe, prompts, cfg.dynamic_sizes, cfg.new_tokens, temperature, progress)
    merged = dynamic_acceptance(pipe, prompts, cfg.merged_sizes, cfg.new_tokens, temperature, progress, MERGE_NGRAM_TOKENS)
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "manifest_sha256": _manifest_hash(cfg.bundle),
        "num_positions": int(sum(len(r) for r in rank_seqs)),
        "rank_histogram": np.bincount(np.minimum(np.concatenate(rank_seqs), cfg.max_rank), minlength=cfg.max_rank + 1).tolist(),
        "depth_rank": p.round(6).tolist(),
        "depth_support": support.astype(int).tolist(),
        "chain_expected_accepted": [round(chain_expectation(p, g), 6) for g in range(1, cfg.max_depth + 1)],
        "draft_temperature": temperature,
        "draft_nll_at_temperature_1": round(float(nll[np.flatnonzero(TEMPERATURES == 1.0)[0]]) / len(np.concatenate(rank_seqs)), 6),
        "draft_nll_at_draft_temperature": round(float(nll.min()) / len(np.concatenate(rank_seqs)), 6),
        "trees": trees,
        "dynamic": dynamic,
        "merged": merged,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (cfg.bundle / ACCEPTANCE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _manifest_hash(bundle: Path) -> str:
    from specrt.contract import MANIFEST
    from specrt.manifest import sha256_file

    return sha256_file(bundle / MANIFEST)


def load_acceptance(bundle: Path) -> dict:
    path = Path(bundle) / ACCEPTANCE
    if not path.is_file():
        raise SpecrtError(f"no {ACCEPTANCE} in {bundle}: run `specrt calibrate --bundle {bundle}` first")
    return json.loads(path.read_text())
