"""DraftTree: the drafted tokens of one sequence for one verification step.

Glossary (used across runtime/):
- root: the last emitted token, not yet in the target's cache; row 0 of the verification step.
- node i: a drafted token; row i + 1 of the step; `parents[i]` is its parent node, -1 for the root.
- accepted path: nodes the verifier keeps, root-to-leaf; bonus: the token the target itself emits after
  the accepted path (its argmax, a sample, or a residual sample after a rejection).
- emitted: accepted tokens + bonus, appended to the sequence.

A chain (classic speculative decoding) is the tree whose node i has parent i - 1. The mask lets each
row see itself and its ancestors only, so one target step scores every root-to-node path at once.

TreeSpec is the static shape a drafter fills (Medusa-style paths of child ranks, compiled once);
DraftTree is one round's filled tree for one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class TreeSpec:
    """A static token tree: node i is reached from the root by the child ranks in paths[i].

    `(0,)` is the root's best child, `(0, 1)` the second-best child of that node, and so on. Nodes are
    ordered by depth, then path, so parents come first; every prefix of a path must be a path too.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: np.ndarray  # [N] parent node index, -1 = root
    depths: np.ndarray  # [N] depth of each node, 1 for the root's children
    ranks: np.ndarray  # [N] which top-k child of its parent the node is (0 = most likely)
    levels: tuple[np.ndarray, ...]  # levels[d] = node indices at depth d + 1
    num_children: np.ndarray  # [N + 1] children of the root (index 0) and of each node (i + 1)
    is_chain: bool

    @staticmethod
    def from_paths(paths) -> "TreeSpec":
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths:
            raise ValueError("a tree needs at least one path")
        index = {p: i for i, p in enumerate(paths)}
        parents = np.empty(len(paths), dtype=np.int64)
        for i, p in enumerate(paths):
            if not p or min(p) < 0:
                raise ValueError(f"tree path {p} must be a non-empty tuple of child ranks >= 0")
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"tree path {p} has no parent path {p[:-1]}")
            parents[i] = index[p[:-1]] if len(p) > 1 else -1
        depths = np.array([len(p) for p in paths], dtype=np.int64)
        num_children = np.bincount(parents + 1, minlength=len(paths) + 1)
        levels = tuple(np.flatnonzero(depths == d) for d in range(1, int(depths.max()) + 1))
        is_chain = bool(np.array_equal(parents, np.arange(-1, len(paths) - 1)))
        if is_chain and any(r for p in paths for r in p):
            is_chain = False  # a single path through second-best children is not the greedy chain
        return TreeSpec(tuple(paths), parents, depths, np.array([p[-1] for p in paths]), levels, num_children, is_chain)

    @staticmethod
    def chain(length: int) -> "TreeSpec":
        return TreeSpec.from_paths([(0,) * d for d in range(1, length + 1)])

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return len(self.levels)

    @cached_property
    def row_mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool over root + nodes: each row sees itself and its ancestors (read-only)."""
        m = DraftTree(np.zeros(len(self), np.int64), self.parents, is_chain=self.is_chain).mask()
        m.flags.writeable = False
        return m

    @cached_property
    def retrieve(self) -> np.ndarray:
        """[num_leaves, depth] step rows (node + 1) along each root-to-leaf path, -1 padded (read-only).

        Verification compares every path at once: row r_j is accepted when its token equals the
        target's choice at row r_{j-1} (r_0 = 0, the root), and the longest accepted prefix wins."""
        leaves = np.flatnonzero(self.num_children[1:] == 0)
        out = np.full((len(leaves), self.depth), -1, dtype=np.int64)
        for k, leaf in enumerate(leaves):
            node, d = int(leaf), int(self.depths[leaf])
            while node >= 0:
                d -= 1
                out[k, d] = node + 1
                node = int(self.parents[node])
        out.flags.writeable = False
        return out

    @cached_property
    def row_depths(self) -> np.ndarray:
        """[N + 1] depth of root (0) and nodes."""
        d = np.concatenate(([0], self.depths))
        d.flags.writeable = False
        return d

    def children(self, node: int) -> np.ndarray:
        """Nodes whose parent is `node` (-1 = root), in rank order."""
        kids = np.flatnonzero(self.parents == node)
        return kids[np.argsort(self.ranks[kids], kind="stable")]


@dataclass
class DraftTree:
    tokens: np.ndarray  # [N] int64 drafted tokens
    parents: np.ndarray  # [N] int64 parent node of each node, -1 = root; parents[i] < i
    draft_probs: np.ndarray | None = None  # [N, V] warped draft distribution each token was sampled from
    is_chain: bool | None = None  # node i's parent is i - 1 for every i (computed when not given)
    spec: TreeSpec | None = None  # the static shape this tree fills (its mask and depths are precomputed)
    joint_logq: np.ndarray | None = None  # [N] draft log-likelihood of the path root..node i (MTAD)

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
        if self.spec is not None:
            return self.spec.row_depths
        depth = np.zeros(len(self) + 1, dtype=np.int64)
        for i, p in enumerate(self.parents):
            depth[i + 1] = depth[p + 1] + 1
        return depth

    def mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool: row r sees itself and its ancestors (rows are root + nodes)."""
        n = len(self) + 1
        if self.is_chain:
            return np.tri(n, dtype=bool)
        if self.spec is not None:
            return self.spec.row_mask
        m = np.eye(n, dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] |= m[p + 1]
        return m

    def children(self, node: int) -> np.ndarray:
        """Nodes whose parent is `node` (-1 for the root), in drafting order."""
        return np.flatnonzero(self.parents == node)
