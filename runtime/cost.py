"""The cost model: what one decode round costs, from a LatencyProfile, for each kind of speculation; the one home
of every prediction the tuner (calibration/tune.py), `auto`, ANPD's hardware-aware drafts, PPD's tree choice and the
batch bench make.

For a tree of n nodes, one round at batch size b costs

    L_target(b, n + 1)                          verify the root and every node in one step
    + L_draft(b, 1) + sum_levels L_draft(b, nodes fed at that level)   draft the tree level by level
    + H(b, n)                                   the runtime's host work per round (profiled per batch size)

A dynamic tree (measured by calibration) costs L_draft(b, 1) for the pending tokens, then one step of W
beams per further draft call; the target step of a measured tree (merged trees, ANPD) costs L's expectation
over the width of the batch's widest tree, since a ragged step is as wide as its widest sequence, unless the
backend packs rows (LatencyProfile.packed_rows): then its holes are left out, and it costs L's expectation over the
batch's mean width (a step of b sequences with sum T_b real rows does the token-wise work of b x mean rows).

A workload (requests of given prompt and output lengths, workload_ms) is served in rounds: each request's
output is walked through the acceptance calibrated where each round starts (rounds_needed: acceptance grows
along an output), and each round costs what the batch's live size does as sequences finish, at the context its
cache holds then (LatencyProfile.at_context: a step attends over the cache's whole capacity, and averaging the
profiled contexts overpriced the short HumanEval requests of `specrt bench batch`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from specrt.bundle.artifacts import LatencyProfile, MeasuredTree, TreeEstimate
from specrt.runtime.drafters.ppd import DEFAULT_BUDGET
from specrt.runtime.step_inputs import PREFILL_CHUNK
from specrt.runtime.tree import TreeSpec


def profiled_batch(latency: LatencyProfile, batch_size: int) -> int:
    """The largest profiled batch size <= batch_size (the smallest profiled one below them all): the curve a round
    of that many sequences is priced on where a choice is made per round (ANPD's drafts, PPD's tree)."""
    sizes = latency.batch_sizes()
    return max([b for b in sizes if b <= batch_size] or sizes[:1])


def largest_step(latency: LatencyProfile, batch: int) -> int:
    """The most tokens per sequence every profiled context's target curve reaches at this batch size."""
    return min(max(curve) for curve in latency.models["target"][batch].values())


def round_cost_ms(latency: LatencyProfile, batch: int, spec: TreeSpec) -> tuple[float, float]:
    """(target ms, draft + host ms) of one round with this static tree."""
    target = latency.step_ms("target", batch, len(spec) + 1)
    draft = latency.step_ms("draft", batch, 1)  # the pending (bonus) token and the root's children
    for level in spec.levels[:-1]:
        fed = int(sum(spec.num_children[i + 1] > 0 for i in level))
        draft += latency.step_ms("draft", batch, fed)
    return target, draft + latency.host(len(spec), batch=batch)


def ngram_round_costs(latency: LatencyProfile, num_draft_tokens: int, batch_size: int,
                      host: tuple[str, ...]) -> list[float]:
    """Profiled ms of an ANPD round verifying 0..num_draft_tokens drafted tokens per sequence (ANPD's hardware-aware
    drafts): the target step of n + 1 tokens and ANPD's host work at n, at profiled_batch (a round's step costs
    what its widest sequence needs; each sequence is costed on that curve). Stops at the largest profiled step: a
    hardware-aware drafter verifies no more than that."""
    batch = profiled_batch(latency, batch_size)
    return [latency.step_ms("target", batch, n + 1) + latency.host(n, host, batch=batch)
            for n in range(min(num_draft_tokens, largest_step(latency, batch) - 1) + 1)]


def ppd_round_cost_ms(latency: LatencyProfile, batch: float, tree, rows: float | None = None) -> tuple[float, float]:
    """Predicted (target ms, host ms) of a PPD round of a sparse tree (PromptTokens' trees): the target step of `rows`
    step rows beyond the root (default: the tree's steady-state average) and PPD's host work at the tree's budget
    (where the bundle had no prompt tokens when profiled: a static draft tree's of that many rows); there is no draft model."""
    rows = tree.expected_rows if rows is None else rows
    host = (latency.host(tree.budget, ("ppd",), batch) if "ppd" in latency.host_ms
            else latency.host(rows, batch=batch))
    return latency.step_ms("target", batch, rows + 1), host


def weighed_ppd_trees(tokens, measured: dict | None = None) -> list[tuple[object, float, float]]:
    """PPD's sparse trees with (candidates accepted per round, step rows beyond the root per round): as `specrt
    calibrate` measured them by decoding (`measured`: Acceptance.ppd_measured; then only the trees it measured,
    so that no tree wins by the training-time table's error), else as that table predicts them."""
    if measured:
        return [(t, measured[t.budget].expected_accepted, measured[t.budget].nodes_per_round)
                for t in tokens.trees if t.budget in measured]
    return [(t, t.expected_accepted, t.expected_rows) for t in tokens.trees]


def choose_ppd_tree(tokens, latency: LatencyProfile | None, batch_size: int, measured: dict | None = None):
    """PPD's hardware-aware stage (section 4.2.2): the sparse tree maximising accepted tokens per round + 1 over the
    round's profiled cost at profiled_batch (acceptance as weighed_ppd_trees gives it); `latency` None: the tree of
    DEFAULT_BUDGET rows."""
    if latency is None:
        return tokens.tree(DEFAULT_BUDGET)
    batch = profiled_batch(latency, batch_size)
    largest = largest_step(latency, batch)
    fits = [(t, accepted, rows) for t, accepted, rows in weighed_ppd_trees(tokens, measured) if t.rows + 1 <= largest]
    if not fits:
        return tokens.trees[0]
    return max(fits, key=lambda f: (f[1] + 1) / sum(ppd_round_cost_ms(latency, batch, f[0], f[2])))[0]


def widest(tree: MeasuredTree, batch: float) -> tuple[np.ndarray, np.ndarray]:
    """(widths, probabilities) of the drafted tokens per sequence in one target step of `batch` sequences: a ragged
    step is as wide as its widest tree, so the maximum of `batch` independent draws from the calibrated histogram
    of nodes per round; without a histogram, the mean nodes per round."""
    hist = tree.nodes_hist
    if not hist:
        return np.array([tree.nodes_per_round]), np.array([1.0])
    widths = np.array(sorted(hist))
    cdf = np.cumsum([hist[k] for k in widths]) / sum(hist.values())
    below = np.concatenate(([0.0], cdf[:-1]))
    return widths, cdf ** batch - below ** batch


def mean_width(tree: MeasuredTree, batch: float) -> tuple[np.ndarray, np.ndarray]:
    """(widths, probabilities) of the mean drafted tokens per sequence over a batch of `batch` sequences, each
    drawing its own from the calibrated histogram (a fractional batch, one that drains, as the nearest whole one);
    without a histogram, the mean nodes per round."""
    hist = tree.nodes_hist
    if not hist:
        return np.array([tree.nodes_per_round]), np.array([1.0])
    one = np.zeros(max(hist) + 1)
    for k, count in hist.items():
        one[k] = count
    one /= one.sum()
    total, draws = np.ones(1), max(1, round(batch))
    for _ in range(draws):  # the distribution of the sum of `draws` widths
        total = np.convolve(total, one)
    support = np.flatnonzero(total > 1e-12)
    return support / draws, total[support]


def target_step_ms(latency: LatencyProfile, batch: float, tree: MeasuredTree) -> float:
    """Expected ms of the target step of a round verifying a measured tree: L over the distribution of the step's
    width (widest, or mean where the backend packs rows), not L at the expected width, since L is not linear and
    widths can be far apart (ANPD drafts K tokens or none)."""
    widths, p = (mean_width if latency.packed_rows else widest)(tree, batch)
    return float(sum(q * latency.step_ms("target", batch, w + 1) for w, q in zip(widths, p) if q > 0))


def ngram_round_cost_ms(latency: LatencyProfile, batch: float, tree: MeasuredTree,
                        host: tuple[str, ...]) -> tuple[float, float]:
    """(target ms, host ms) of one ANPD round (measured n-gram drafts): the target step as wide as the batch's
    widest draft (target_step_ms), no draft model, and ANPD's own host work (n-gram lookups and updates, verification) at its
    draft length (LatencyProfile.host)."""
    return target_step_ms(latency, batch, tree), latency.host(tree.num_nodes, host, batch=batch)


def measured_round_cost_ms(latency: LatencyProfile, batch: int, tree: MeasuredTree,
                           host: tuple[str, ...]) -> tuple[float, float]:
    """(target ms, draft + host ms) of one round with a measured dynamic (or merged) tree."""
    target = target_step_ms(latency, batch, tree)
    draft = latency.step_ms("draft", batch, 1)  # the pending tokens, whose logits are the root's
    draft += max(0.0, tree.draft_calls_per_round - 1) * latency.step_ms("draft", batch, tree.width)
    return target, draft + latency.host(tree.num_nodes, host, batch)


def prefill_ms(latency: LatencyProfile, role: str, prompt_lens: list[int], running: int = 0) -> float:
    """Predicted ms to prefill prompts admitted together: in steps of the profile's prefill chunk of tokens per
    sequence (the pipeline's), each priced by LatencyProfile.prefill_step_ms. `running`: sequences of the batch
    stepped beside the joining ones as empty rows (a static cache without an admission cache)."""
    chunk = latency.prefill_chunk or PREFILL_CHUNK
    rows = running + len(prompt_lens)
    total = 0.0
    for start in range(0, max(prompt_lens), chunk):
        lens = [min(chunk, max(0, n - start)) for n in prompt_lens]
        total += latency.prefill_step_ms(role, rows, lens)
    return total


def joining_prefill_ms(latency: LatencyProfile, role: str, prompt_lens: list[int], running: int, backend) -> float:
    """Predicted ms to prefill prompts joining `running` sequences on `backend`: in a cache of their own (a dynamic
    cache), one by one alone (an engine's admission cache: Backend.admits_alone), or in place beside the running
    sequences stepped as empty rows (a static cache without one)."""
    if backend.admits_alone and running:
        return sum(prefill_ms(latency, role, [n]) for n in prompt_lens)
    return prefill_ms(latency, role, prompt_lens, running if backend.static_cache else 0)


def rounds_needed(new: int, accepted: float, by_position: tuple[float, ...] = (), bucket: int = 0,
                  whole: bool = True) -> float:
    """Decode rounds to emit `new` tokens: each round emits 1 + the drafted tokens it is expected to accept where it
    starts: `by_position[p // bucket]` at output position p (tokens emitted before it; the last bucket's beyond), or
    `accepted` at every position without them. `whole`: a request's last round counts whole (what it costs); else
    the share of it the request needed (the rate a stream of outputs of about this length sees)."""
    position, rounds = 0.0, 0.0
    while position < new:
        step = 1.0 + (by_position[min(int(position) // bucket, len(by_position) - 1)] if by_position and bucket
                      else accepted)
        rounds += 1.0 if whole or position + step <= new else (new - position) / step
        position += step
    return max(1.0, rounds)


def workload_ms(round_ms, rounds: Callable[[int], float], requests: list[tuple[int, int]], max_batch: int,
                batching: str, prefill) -> float:
    """Predicted ms to serve `requests` (prompt tokens, new tokens) at most `max_batch` at once: a request of `new`
    tokens needs rounds(new) rounds (rounds_needed); a round costs round_ms(live sequences, context), so a batch that
    drains (sequences finishing at different rounds) costs what its live size does, at the context its cache holds:
    its longest live sequence's midway through the rounds until the next one finishes (its prompt and its output's
    share emitted by then), or the longest any reached before (a batch's cache does not shrink; a step attends over
    all of it); each group of requests admitted together pays `prefill(their prompt lengths, sequences running beside
    them)`. Continuous batching admits the next requests as soon as sequences finish; static batching runs each group
    of `max_batch` requests, in a cache of its own, until its last one ends."""
    needed = [rounds(new) for _, new in requests]
    groups = [list(range(len(requests)))] if batching == "continuous" else \
        [list(range(i, min(i + max_batch, len(requests)))) for i in range(0, len(requests), max_batch)]

    def cached(i: int, left: float) -> float:  # request i's tokens in the cache with `left` of its rounds to go
        return requests[i][0] + requests[i][1] * (1 - left / needed[i])

    total = 0.0
    for group in groups:
        waiting, live, reached = list(group), {}, 0.0  # live: request -> rounds left
        while waiting or live:
            joining = waiting[:max_batch - len(live)]
            del waiting[:len(joining)]
            if joining:
                total += prefill([requests[i][0] for i in joining], len(live))
                live.update((i, needed[i]) for i in joining)
            step = min(live.values())  # rounds until the next sequence finishes, all at this live size
            context = max(reached, *(cached(i, left - step / 2) for i, left in live.items()))
            total += step * round_ms(len(live), context)
            reached = max(reached, *(cached(i, left - step) for i, left in live.items()))
            live = {i: left - step for i, left in live.items() if left > step}
    return total


# -- the product model: a static tree's expected accepted tokens from the depth-rank acceptance table p[depth, rank]
# (calibration measures p; the tuner, `specrt profile`'s host-work trees and the batch bench read these) ----------

def best_trees(p: np.ndarray, max_nodes: int) -> list[TreeEstimate]:
    """Nested best trees of 1..max_nodes nodes under the product model, greedily by path probability
    (each tree's paths in the order they were added)."""
    depth, ranks = p.shape
    heap = [(-p[0, r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    paths, out, total = [], [], 0.0
    while heap and len(paths) < max_nodes:
        neg, path = heapq.heappop(heap)
        prob = -neg
        paths.append(path)
        total += prob
        out.append(TreeEstimate(len(paths), tuple(paths), total))
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (-(prob * p[len(path), r]), path + (r,)))
    return out


def tree_expectation(p: np.ndarray, paths) -> float:
    """Expected accepted drafted tokens of a static tree (paths of child ranks) under the product model: the sum
    over its nodes of the probability that the node's whole path is accepted."""
    depth, ranks = p.shape
    return float(sum(np.prod([p[d, r] if d < depth and r < ranks else 0.0 for d, r in enumerate(path)])
                     for path in paths))


def chain_expectation(p: np.ndarray, length: int) -> float:
    """Expected accepted drafted tokens of a chain of rank-0 tokens of the given length."""
    return float(sum(np.prod(p[:d, 0]) for d in range(1, length + 1)))
