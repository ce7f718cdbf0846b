"""Acceptance calibration: how likely the target's next token is the draft's rank-r candidate, per depth.

On held-out text (the standard-library files the demo pair never trained on; never HumanEval, which is
the benchmark), or on the user's own prompts (`--prompts FILE`: acceptance depends on the text, so prompts
like the traffic predict it best), the target decodes greedily from each prompt; the draft then reads prompt +
trajectory in one teacher-forced step, and we record the rank of each target token among the draft's logits.
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

Acceptance grows along an output: the draft model reads more context, and n-gram drafts (ANPD, merged
trees) can only copy what the output has already said (measured on the tiny pair: ANPD accepts 0.12
drafted tokens per round over HumanEval outputs of 16 tokens and 1.56 over 128; sd 1.13 and 1.73). So every
estimate is also kept by the bucket of POSITION_BUCKET output positions a round starts at (the tables over
the rounds starting there; the decoded measurements by where each round started), and the batch cost model
walks each request's output through them (runtime.cost.rounds_needed): requests shorter than the
calibration's are not predicted at its average.

Acceptance also depends on the text, and varies a lot from one prompt to the next (ANPD most: n-gram drafts pay
only where an output repeats itself). Each measured figure keeps the 5-95% interval of its pooled rate over
bootstrap resamples of the prompts (ratio_interval): how far the prompts drawn alone move it. Measured on the
inflated pair (ad hoc; `pipe.generate`, ANPD at K = 7, 16-96 new tokens): the first and the second 32 of the
HumanEval tasks 64-127 gave 2.04 and 1.76 tokens emitted per round, the bench's 32 tasks 1.84 (5-95%: 1.68-2.02).
Prompt files are read whole unless --prompt-tokens cuts them: cut to their last 64 tokens, the bench's own prompts
had ANPD accept 1.22 drafted tokens per round against 0.92 whole (the target writes other text from less context).

Deterministic for a seed: prompts are drawn by a seeded generator and decoding is greedy.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.bundle import artifacts
from specrt.bundle.artifacts import Acceptance, CurvePoint, MeasuredTree, Stamp
from specrt.bundle.manifest import BundleOptions, sha256_file
from specrt.calibration.chains import chain_ranks
from specrt.checkpoints.corpus import read_prompts, validation_prompts
from specrt.config import config_dict, option
from specrt.contract import UNSCORED_LOGIT
from specrt.errors import SpecrtError
from specrt.runtime.backends import BackendOptions
from specrt.runtime.cost import best_trees, chain_expectation, tree_expectation
from specrt.runtime.methods import runs_with
from specrt.runtime.speculation import SPECULATION, SpeculationKind, speculation_kind
from specrt.runtime.stats import POSITION_BUCKET

HELD_OUT_PROMPT_TOKENS = 64  # held-out text prompts' length where --prompt-tokens does not say


@dataclass(frozen=True)
class CalibrationConfig(BundleOptions, BackendOptions):
    num_prompts: int = option(24, "held-out prompts decoded", ge=1)
    prompt_tokens: int | None = option(None, "tokens per prompt: held-out text prompts are this long (default "
                                             f"{HELD_OUT_PROMPT_TOKENS}); --prompts are cut to their last this many "
                                             "(default: whole, as the traffic sends them)", ge=1)
    new_tokens: int = option(96, "tokens decoded per prompt", ge=1, flag="max-new-tokens")
    max_depth: int = option(8, "deepest tree level estimated", ge=1)
    max_rank: int = option(8, "draft ranks estimated per level", ge=1)
    max_nodes: int = option(64, "largest static tree built", ge=1)
    seed: int = option(0, "seed of the prompt sampler", ge=0)
    dynamic_sizes: tuple[int, ...] = option((2, 4, 6, 8, 10, 12, 16, 24, 32),
                                            "dynamic tree sizes whose acceptance is measured by decoding ('' for none)", ge=1)
    merged_sizes: tuple[int, ...] = option((1, 2, 3, 4, 6, 8, 10, 12, 16),
                                           "dynamic tree sizes measured with n-gram drafts merged in ('' for none)", ge=1)
    ngram_sizes: tuple[int, ...] = option((3, 5, 7, 10), "ANPD draft lengths K measured by decoding ('' for none)", ge=1)
    ppd_budgets: tuple[int, ...] | None = option(None, "PPD sparse trees (step rows) measured by decoding where the "
                                                       "bundle has prompt tokens (`specrt ppd train`); the tuner and "
                                                       "PPD's tree choice then weigh only these (default: every tree "
                                                       "it built; '' for none: the training-time table's predictions)", ge=1)
    prompts: Path | None = option(None, "calibrate on your own prompts: a JSON Lines file, one {\"prompt\": \"...\"} "
                                        "per line (the first --num-prompts, whole unless --prompt-tokens); default: "
                                        "held-out stdlib text. Acceptance depends on the text: "
                                        "prompts like your traffic predict it best (never the prompts you benchmark on)")


TEMPERATURES = np.unique(np.append(np.round(np.geomspace(0.1, 4.0, 81), 4), 1.0))  # draft_temperature's grid (1.0 exact)


def draft_ranks(draft_runner, tokens: list[int], first: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank of tokens[j] among the draft's logits after tokens[:j], for j >= first (teacher forcing),
    and the summed negative log-likelihood of those tokens at each of TEMPERATURES."""
    from specrt.runtime.step_inputs import sequence_logits

    logits = sequence_logits(draft_runner, np.asarray(tokens[:-1], dtype=np.int64))  # [T - 1, V]
    rows = logits[first - 1:].astype(np.float64)
    true = np.asarray(tokens[first:])
    chosen = rows[np.arange(len(true)), true]
    return (rows > chosen[:, None]).sum(axis=-1), nll_by_temperature(rows, true)


def nll_by_temperature(rows: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Summed -log softmax(rows / T)[true] over the rows [N, V], for each T in TEMPERATURES; a row whose true token
    the draft leaves unscored (contract.HEAD_VOCABULARY) is left out: no temperature makes it draft that token."""
    from specrt.runtime.sampling import log_softmax

    scored = rows[np.arange(len(true)), true] > UNSCORED_LOGIT / 2
    rows, index = rows[scored], np.arange(int(scored.sum()))
    return np.array([-float(log_softmax(rows / t)[index, true[scored]].sum()) for t in TEMPERATURES])


def fitted_temperature(nll: np.ndarray) -> float:
    """The temperature of TEMPERATURES whose summed NLL (nll_by_temperature's, over every prompt) is least; 1.0, the
    draft's own logits, where no position was scored (a draft that never scores its target's tokens: no fit)."""
    return float(TEMPERATURES[int(np.argmin(nll))]) if nll.any() else 1.0


def depth_rank_table(rank_seqs: list[np.ndarray], max_depth: int, max_rank: int,
                     starts: tuple[int, int | None] = (0, None)) -> tuple[np.ndarray, np.ndarray]:
    """(p [D, K], support [D]): acceptance of rank r at depth d given an accepted parent, and how many
    start positions each depth's estimate rests on; `starts`: the output positions [first, last) a round may
    start at (last None: to the end). A draft model's ranks are one per output token (teacher-forced: a round's
    depth d reads what teacher forcing does); a draft head's [D, T], one row per depth (chains.chain_ranks)."""
    counts = np.zeros((max_depth, max_rank))
    support = np.zeros(max_depth)
    first, last = starts
    for ranks in rank_seqs:
        chains = ranks.ndim == 2  # a head's: ranks[d, s] at depth d + 1 of the chain from s (calibration/chains.py)
        length = ranks.shape[-1]
        for s in range(first, length if last is None else min(last, length)):
            for d in range(min(max_depth, len(ranks)) if chains else max_depth):
                if s + d >= length:
                    break
                rank = ranks[d, s] if chains else ranks[s + d]
                support[d] += 1
                if rank >= max_rank:
                    break
                counts[d, rank] += 1
    return counts / np.maximum(support, 1)[:, None], support


def position_buckets(new_tokens: int) -> int:
    """Buckets of POSITION_BUCKET output positions that decoding `new_tokens` tokens reaches."""
    return max(1, -(-new_tokens // POSITION_BUCKET))


def depth_rank_by_position(rank_seqs: list[np.ndarray], max_depth: int, max_rank: int, new_tokens: int) -> np.ndarray:
    """[buckets, D, K]: depth_rank_table over the rounds that start in each bucket of POSITION_BUCKET output
    positions (the last bucket: every later one)."""
    n = position_buckets(new_tokens)
    return np.stack([depth_rank_table(rank_seqs, max_depth, max_rank,
                                      (b * POSITION_BUCKET, None if b == n - 1 else (b + 1) * POSITION_BUCKET))[0]
                     for b in range(n)])


def position_acceptance(acceptance: Acceptance, point: CurvePoint) -> tuple[float, ...]:
    """Expected drafted tokens accepted per round of a candidate by the bucket of output positions the round starts
    at (acceptance.position_bucket positions each; the last: every later one); () where the calibration has no such
    estimate (autoregressive accepts nothing; PPD's trees where the bundle had none)."""
    kind = speculation_kind(point.kind)
    if kind.static:
        return tuple(tree_expectation(np.array(p), point.paths) for p in acceptance.depth_rank_by_position)
    m = next((m for m in kind.measured_trees(acceptance) if (m.num_nodes, m.ngram_tokens) == (point.num_nodes, point.ngram_tokens)), None)
    return m.accepted_by_position if m is not None else ()


def ratio_interval(numerators, denominators, level: float = 0.9, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """The central `level` interval of sum(numerators) / sum(denominators) over bootstrap resamples of the items
    (prompts, requests): how much a rate measured over these items moves with which items were drawn. Seeded."""
    num, den = np.asarray(numerators, dtype=np.float64), np.asarray(denominators, dtype=np.float64)
    if len(num) != len(den) or not len(num):
        raise ValueError(f"ratio_interval needs as many numerators as denominators, at least one: {len(num)}, {len(den)}")
    pick = np.random.default_rng(seed).integers(0, len(num), (resamples, len(num)))
    ratios = num[pick].sum(axis=1) / np.maximum(den[pick].sum(axis=1), 1e-12)
    lo, hi = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    return round(float(lo), 6), round(float(hi), 6)


def _measure(pipe, prompts: list[list[int]], new_tokens: int, bar, **method) -> tuple:
    """Decode each prompt alone with `method`; (accepted drafted tokens, draft calls and verified nodes per round,
    verified nodes -> rounds, accepted drafted tokens per round by bucket of output positions, the accepted tokens
    per round's ratio_interval over the prompts)."""
    accepted = rounds = calls = nodes = 0
    widths: Counter = Counter()
    by_rounds: Counter = Counter()
    by_accepted: Counter = Counter()
    per_prompt = []  # (accepted, rounds)
    for prompt in prompts:
        st = pipe.generate([prompt], max_new_tokens=new_tokens, **method)[0].stats
        per_prompt.append((st.accepted, st.rounds))
        rounds += st.rounds
        accepted += st.accepted
        calls += st.draft_calls - st.prefill_draft_calls
        nodes += st.drafted
        widths.update(st.drafted_hist)
        by_rounds.update(st.rounds_by_position)
        by_accepted.update(st.accepted_by_position)
        bar.update()
    per = max(1, rounds)
    by_position, last = [], accepted / per
    for b in range(position_buckets(new_tokens)):  # a bucket no round started in (EOS came first): the one before's
        last = by_accepted[b] / by_rounds[b] if by_rounds[b] else last
        by_position.append(round(last, 6))
    return (round(accepted / per, 6), round(calls / per, 4), round(nodes / per, 4), {k: widths[k] for k in sorted(widths)},
            tuple(by_position), ratio_interval(*zip(*per_prompt)))


def measure_kind(pipe, prompts: list[list[int]], kind: SpeculationKind, sizes, new_tokens: int, temperature: float,
                 progress: bool = True) -> list[MeasuredTree]:
    """A kind of speculation measured by decoding at each size (its decode keywords, at the fitted draft temperature
    where its Calibration says so, and the tree its Calibration names): accepted drafted tokens, draft calls and verified nodes per round, by output position, and
    their spread over the prompts."""
    from tqdm import tqdm

    out = []
    with tqdm(total=len(sizes) * len(prompts), desc=f"calibrate {kind.name}", unit="prompt",
              disable=not progress) as bar:
        for n in sizes:
            kw = {**kind.decode(n), **({"draft_temperature": temperature} if kind.calibration.temperature else {})}
            accepted, calls, nodes, hist, by_position, interval = _measure(pipe, prompts, new_tokens, bar, **kw)
            out.append(MeasuredTree(num_nodes=n, expected_accepted=accepted, draft_calls_per_round=calls,
                                    nodes_per_round=nodes, nodes_hist=hist, accepted_by_position=by_position,
                                    accepted_interval=interval, **kind.calibration.tree(pipe, n)))
    return out


def measured_sizes(cfg: CalibrationConfig, kind: SpeculationKind, pipe) -> tuple[int, ...]:
    """The sizes of a kind calibrate measures: its own option's where it has one and it says, else the kind's."""
    given = getattr(cfg, kind.calibration.flag) if kind.calibration.flag else None
    if given is not None:
        return tuple(sorted(set(given)))
    return kind.calibration.sizes(pipe) if kind.calibration.sizes else ()


def calibrate(cfg: CalibrationConfig, progress: bool = True) -> Acceptance:
    from tqdm import tqdm

    from specrt.runtime.pipeline import Pipeline

    t0 = time.perf_counter()
    pipe = Pipeline.load(cfg.bundle, **cfg.pipeline_options())
    if cfg.ppd_budgets:  # asked for by name: refuse what cannot be measured before decoding anything
        if pipe.prompt_tokens is None:
            raise SpecrtError(f"--ppd-budgets: {pipe.prompt_tokens_refused}")
        built = [t.budget for t in pipe.prompt_tokens.trees]
        if set(cfg.ppd_budgets) - set(built):
            raise SpecrtError(f"--ppd-budgets {','.join(map(str, cfg.ppd_budgets))}: `specrt ppd train` built trees of "
                              f"{', '.join(map(str, built))} rows")
    if cfg.prompts is None:
        prompts = validation_prompts(pipe.encode, cfg.num_prompts, cfg.prompt_tokens or HELD_OUT_PROMPT_TOKENS, cfg.seed)
    else:  # whole by default: how much context a prompt gives changes what the target writes, and so acceptance
        cut = -cfg.prompt_tokens if cfg.prompt_tokens else 0
        prompts = [pipe.encode(p)[cut:] for p in read_prompts(cfg.prompts, cfg.num_prompts)]
    rank_seqs, nll = [], np.zeros(len(TEMPERATURES))
    head = pipe.draft.entry.features  # a draft head on the target's hidden states (EAGLE): its chains, depth by depth
    for prompt in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
        out = pipe.generate([prompt], method="autoregressive", max_new_tokens=cfg.new_tokens)[0]
        text = prompt + out.token_ids
        with pipe.draft.runner() as draft:
            if head:
                with pipe.target.runner() as target:
                    ranks, rows = chain_ranks(target, draft, text, len(prompt), cfg.max_depth)
                prompt_nll = nll_by_temperature(rows.astype(np.float64), np.asarray(text[len(text) - len(rows):]))
            else:
                ranks, prompt_nll = draft_ranks(draft, text, len(prompt))
        rank_seqs.append(ranks)
        nll += prompt_nll
    p, support = depth_rank_table(rank_seqs, cfg.max_depth, cfg.max_rank)
    tokens = pipe.prompt_tokens if cfg.ppd_budgets != () else None
    temperature = fitted_temperature(nll)
    positions = int(sum(r.shape[-1] for r in rank_seqs))
    firsts = [r[0] if r.ndim == 2 else r for r in rank_seqs]  # every position's first-guess rank
    result = Acceptance(
        stamp=Stamp.make(cfg.bundle),
        config={**config_dict(cfg), **({"prompts_sha256": sha256_file(cfg.prompts)} if cfg.prompts else {})},
        num_positions=positions,
        rank_histogram=tuple(np.bincount(np.minimum(np.concatenate(firsts), cfg.max_rank),
                                         minlength=cfg.max_rank + 1).tolist()),
        depth_rank=tuple(tuple(row) for row in p.round(6).tolist()),
        depth_support=tuple(support.astype(int).tolist()),
        chain_expected_accepted=tuple(round(chain_expectation(p, g), 6) for g in range(1, cfg.max_depth + 1)),
        draft_temperature=temperature,
        draft_nll_at_temperature_1=round(float(nll[np.flatnonzero(TEMPERATURES == 1.0)[0]]) / positions, 6),
        draft_nll_at_draft_temperature=round(float(nll.min()) / positions, 6),
        trees=tuple(best_trees(p, cfg.max_nodes)),
        measured={kind.name: tuple(measure_kind(pipe, prompts, kind, sizes, cfg.new_tokens, temperature, progress))
                  for kind in SPECULATION.values() if kind.calibration and runs_with(kind, pipe.draft)
                  for sizes in [measured_sizes(cfg, kind, pipe)] if sizes},
        ppd_source=tokens.identity() if tokens else None,
        position_bucket=POSITION_BUCKET,
        depth_rank_by_position=tuple(tuple(tuple(row) for row in table) for table in
                                     depth_rank_by_position(rank_seqs, cfg.max_depth, cfg.max_rank, cfg.new_tokens)
                                     .round(6).tolist()),
        seconds=round(time.perf_counter() - t0, 2),
    )
    artifacts.save(cfg.bundle, result, quant=pipe.machine.quant)
    return result
