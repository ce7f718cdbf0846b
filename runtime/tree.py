"""DraftTree: the drafted tokens of one sequence for one verification step.

Glossary (used across runtime/):
- root: the last emitted token, not yet in the target's cache; row 0 of the verification step.
- node i: a drafted token; row i + 1 of the step; `parents[i]` is its parent node, -1 for the root.
- accepted path: nodes the verifier keeps, root-to-leaf; bonus: the token the target itself emits after
  the accepted path (its argmax, a sample, or a residual sample after a rejection).
- emitted: accepted tokens + bonus, appended to the sequence.

A chain (classic speculative decoding) is the tree whose node i has parent i - 1. The mask lets each
row see itself and its ancestors only, so one target step scores every root-to-node path at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DraftTree:
    tokens: np.ndarray  # [N] int64 drafted tokens
    parents: np.ndarray  # [N] int64 parent node of each node, -1 = root; parents[i] < i
    draft_probs: np.ndarray | None = None  # [N, V] warped draft distribution each token was sampled from
    is_chain: bool | None = None  # node i's parent is i - 1 for every i (computed when not given)

    def __post_init__(self):
        if self.is_chain is None:
            self.is_chain = bool(np.array_equal(self.parents, np.arange(-1, len(self.parents) - 1)))

    @staticmethod
    def chain(tokens, draft_probs=None) -> "DraftTree":
        n = len(tokens)
        return DraftTree(np.asarray(tokens, dtype=np.int64), np.arange(-1, n - 1, dtype=np.int64), draft_probs, True)

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree.chain([])

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> np.ndarray:
        """[N + 1] depth of each row: 0 for the root, parent depth + 1 for node i."""
        if self.is_chain:
            return np.arange(len(self) + 1, dtype=np.int64)
        depth = np.zeros(len(self) + 1, dtype=np.int64)
        for i, p in enumerate(self.parents):
            depth[i + 1] = depth[p + 1] + 1
        return depth

    def mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool: row r sees itself and its ancestors (rows are root + nodes)."""
        n = len(self) + 1
        if self.is_chain:
            return np.tri(n, dtype=bool)
        m = np.eye(n, dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] |= m[p + 1]
        return m

    def children(self, node: int) -> np.ndarray:
        """Nodes whose parent is `node` (-1 for the root), in drafting order."""
        return np.flatnonzero(self.parents == node)
