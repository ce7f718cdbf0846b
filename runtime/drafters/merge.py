"""MergedDrafter: one token tree from several drafters (SpecInfer's merge-based tree construction, Miao et
al. 2024, section 3: the speculations of several small models are merged into one token tree, shared
prefixes once, and verified in one target step).

Per round each drafter proposes its own tree; a node of a later tree whose path of tokens is already in
the merged tree reuses that node, the others become new nodes under their merged parent. After
verification each drafter commits the longest prefix of the accepted path that lies in its own tree:
the rest of the emitted tokens is simply text it has not seen (a model drafter feeds it as pending
tokens next round; an n-gram memory reads it from the sequence; PPD shifts its guesses by that many
positions, Verdict.beyond). A drafter that reads the target's logits (PPD) gets the rows of its own nodes.

A hardware-aware n-gram drafter (NgramDrafter with step costs) merged after the others is told, per sequence, the
tree they drafted this round (merged), how many tokens they are expected to yield (the most any of them yielded
per round so far, on average: its own path's share of the accepted path, counted from one token in one round) and
the milliseconds their drafting took this round. It then adds the n-gram drafts that pay on top of that round, not
on top of an empty one.

Only deterministic drafts merge (top-k children, n-grams; no sampled chain with its q): siblings then
carry distinct tokens, so exact match (greedy) and one-hot rejection (sampling) stay lossless.
"""

from __future__ import annotations

import numpy as np

from specrt.runtime.drafters.base import Drafter
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import Verdict


# the least estimated path probability of an n-gram draft merged into a draft model's tree (`ngram_min_prob`):
# pruning unlikely n-gram drafts pays when they ride along a draft model's tree (bench/results, e2e rows)
MERGE_MIN_PROB = 0.3


def merge_trees(trees: list[DraftTree]) -> tuple[DraftTree, list[np.ndarray]]:
    """The union of `trees` by token path, and per tree the merged node of each of its nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    maps = []
    for tree in trees:
        if tree.draft_probs is not None:
            raise ValueError("only deterministic drafts (no sampled q) can be merged into one tree")
        where = np.empty(len(tree), dtype=np.int64)
        for i, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
            key = (int(where[par]) if par >= 0 else -1, tok)
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(tok)
                parents.append(key[0])
            where[i] = node
        maps.append(where)
    merged = DraftTree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64))
    return merged, maps


class MergedDrafter(Drafter):
    def __init__(self, drafters: list[Drafter]):
        if len(drafters) < 2:
            raise ValueError(f"merging needs at least two drafters, got {len(drafters)}")
        self.drafters = drafters
        self._maps: list[list[np.ndarray]] = []  # per sequence, per drafter: merged node of each of its nodes
        # per drafter, per sequence: tokens its own nodes yielded and rounds, from a prior of one token in one round
        self._yielded = np.ones((len(drafters), 0))
        self._rounds = np.ones(0)

    def usage(self) -> tuple[int, float]:
        steps, busy = zip(*(d.usage() for d in self.drafters))
        return sum(steps), sum(busy)

    def _start(self, seqs) -> None:
        self._yielded, self._rounds = np.ones((len(self.drafters), len(seqs))), np.ones(len(seqs))
        for d in self.drafters:
            d.start(seqs)

    def _admit(self, new) -> None:
        self._yielded = np.concatenate([self._yielded, np.ones((len(self.drafters), len(new)))], axis=1)
        self._rounds = np.concatenate([self._rounds, np.ones(len(new))])
        for d in self.drafters:
            d.admit(new)

    def _propose(self, seqs, params, rng) -> list[DraftTree]:
        proposed = []  # [drafter][sequence]
        for k, d in enumerate(self.drafters):
            if k and getattr(d, "step_costs", None) is not None:  # a hardware-aware n-gram drafter (module docstring)
                expected = (self._yielded[:k] / self._rounds).max(axis=0)
                spent = 1e3 * sum(e.seconds for e in self.drafters[:k])  # their drafting is part of the round's cost
                d.ahead = [(merge_trees([p[b] for p in proposed])[0], float(expected[b]), spent)
                           for b in range(len(seqs))]
            proposed.append(d.propose(seqs, params, rng))
        trees, self._maps = [], []
        for b in range(len(seqs)):
            merged, maps = merge_trees([p[b] for p in proposed])
            trees.append(merged)
            self._maps.append(maps)
        return trees

    @property
    def reads_target_logits(self) -> bool:
        return any(d.reads_target_logits for d in self.drafters)

    def target_logits(self, logits, rows=None) -> None:
        """Each drafter the step rows of the root and of its own nodes, in its own node order (nothing is copied)."""
        if rows is not None:
            raise ValueError("merged drafters are not merged again")
        for k, d in enumerate(self.drafters):
            if d.reads_target_logits:
                d.target_logits(logits, [np.concatenate(([0], self._maps[b][k] + 1)) for b in range(len(self._maps))])

    @property
    def reads_target_hidden(self) -> bool:
        return any(d.reads_target_hidden for d in self.drafters)

    def target_hidden(self, hidden, rows, first: int = 0) -> None:
        """The rows the target committed are the same whichever drafter's nodes they were: each reader gets them."""
        for d in self.drafters:
            if d.reads_target_hidden:
                d.target_hidden(hidden, rows, first)

    def commit(self, seqs, verdicts) -> None:
        for k, d in enumerate(self.drafters):
            own = []
            for b, v in enumerate(verdicts):
                back = {int(m): i for i, m in enumerate(self._maps[b][k])}
                path = []
                for node in v.path:
                    if node not in back:
                        break
                    path.append(back[node])
                own.append(Verdict(path, v.bonus, len(v.path) - len(path)))
                self._yielded[k, b] += len(path)
            d.commit(seqs, own)
        self._rounds += 1

    def keep(self, rows) -> None:
        self._yielded, self._rounds = self._yielded[:, rows], self._rounds[rows]
        for d in self.drafters:
            d.keep(rows)

    def close(self) -> None:
        for d in self.drafters:
            d.close()
