"""BeamDrafter: the draft model's beam search for MTAD / MJSD (../shared/papers/mtad-*.txt, mjsd-*.txt).

Per round and sequence: W beams grown for gamma tokens by deterministic beam search on the draft's
log-likelihood log q (warped like the target when sampling, raw when greedy). Beam nodes are scratch
rows in the draft's KV cache, fed one depth per step (W tokens, each seeing only its own ancestors),
so a round costs gamma draft steps of W tokens, like a W-wide tree. The best beam (highest joint
log q) is returned as a chain with its per-prefix joint log-likelihoods, for JointLikelihoodVerifier;
with `num_verified` = k > 1 the top k beams are returned as one tree (shared prefixes merged), which
the target verifies in one step (the MTAD paper's stated future work, section 3.3). The last depth is
never fed; after verification the accepted path is compacted into place like any accepted tree path
(ModelDrafter.commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specrt.runtime.backends import Backend
from specrt.runtime.drafters import ModelDrafter
from specrt.runtime.sampling import warp
from specrt.runtime.tree import DraftTree


def log_probs(logits: np.ndarray, params) -> np.ndarray:
    """log of the distribution beams are scored with: raw softmax when greedy, warped otherwise."""
    x = logits.astype(np.float64)
    if params is None or params.greedy:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    with np.errstate(divide="ignore"):
        return np.log(warp(x, params))


def top_beams(scores: np.ndarray, logq: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best `width` extensions of beams with joint log-likelihoods scores [W0] by next-token logq [W0, V].

    Returns (parent beam [width], token [width], new joint log-likelihood [width]), best first."""
    cand = scores[:, None] + logq  # [W0, V]
    flat = cand.ravel()
    # never extend with a token the (warped) draft gives probability 0: its joint q would be 0
    k = min(width, int(np.isfinite(flat).sum()))
    top = np.argpartition(-flat, k - 1)[:k]
    top = top[np.argsort(-flat[top], kind="stable")]
    return top // logq.shape[1], top % logq.shape[1], flat[top]


class BeamDrafter(ModelDrafter):
    def __init__(self, backend: Backend, num_beams: int, gamma: int, bucket: int = 128, num_verified: int = 1):
        if num_beams < 1 or gamma < 1:
            raise ValueError(f"num_beams and gamma must be >= 1, got {num_beams} and {gamma}")
        if not 1 <= num_verified <= num_beams:
            raise ValueError(f"num_verified must be in [1, num_beams={num_beams}], got {num_verified}")
        super().__init__(backend, bucket)
        self.num_beams = num_beams
        self.gamma = gamma
        self.num_verified = num_verified

    def propose(self, seqs, params, rng):
        t0, busy0 = time.perf_counter(), self.backend.busy_seconds
        nodes, calls = self._search(seqs, params)
        chosen = [self._select(n) for n in nodes]
        self._slots = np.full((len(seqs), max(len(c) for c in chosen)), -1, dtype=np.int64)
        trees = []
        for b, (n, keep) in enumerate(zip(nodes, chosen)):
            # node ids grow with depth, so sorted ids put parents before children
            keep = sorted(keep)
            index = {node: j for j, node in enumerate(keep)}
            self._slots[b, : len(keep)] = [n.slots[i] for i in keep]
            trees.append(DraftTree(np.asarray([n.tokens[i] for i in keep], dtype=np.int64),
                                   np.asarray([index.get(n.parents[i], -1) for i in keep], dtype=np.int64),
                                   joint_logq=np.asarray([n.scores[i] for i in keep])))
        self.num_calls = calls
        self.seconds = time.perf_counter() - t0
        self.backend_seconds = self.backend.busy_seconds - busy0
        return trees

    def _log_probs(self, logits: np.ndarray, params) -> np.ndarray:
        return log_probs(logits, params)

    def _select(self, nodes: "SearchNodes") -> set[int]:
        """The top `num_verified` beams at full depth (highest joint log q first) with their ancestors."""
        return nodes.closure(sorted(nodes.level, key=lambda i: -nodes.scores[i])[: self.num_verified])

    def _expand(self, nodes: "SearchNodes") -> list[int]:
        """The nodes of the deepest level to feed and extend (beam search: all of them)."""
        return nodes.level

    def _search(self, seqs, params) -> tuple[list["SearchNodes"], int]:
        """Beam search of gamma tokens per sequence; returns every node kept at every depth and the
        number of draft calls."""
        batch, width = len(seqs), self.num_beams
        root = self._log_probs(self._feed_pending(seqs), params)  # [B, V]
        found = []
        for b in range(batch):
            _, tok, sc = top_beams(np.zeros(1), root[b][None], width)
            found.append(SearchNodes(list(tok), [-1] * len(tok), list(sc), [-1] * len(tok), list(range(len(tok))),
                                     np.zeros((width * self.gamma, width * self.gamma), dtype=bool), []))
        calls = 1
        for depth in range(1, self.gamma):
            # the scratch rows after each sequence's anchor are its fed nodes, in feeding order; each node
            # of this level sees its own ancestors among them. Levels may be narrower than W (a warped
            # draft left fewer candidates) or empty (nothing left worth extending: _expand)
            expand = [np.asarray(self._expand(f), dtype=np.int64) for f in found]
            if not any(len(e) for e in expand):
                break
            vis = [f.ancestors[np.ix_(e, np.asarray(f.fed, dtype=np.int64))] for f, e in zip(found, expand)]
            rows = [np.asarray(f.tokens, dtype=np.int64)[e] for f, e in zip(found, expand)]
            logits, first = self._step_nodes(rows, [np.full(len(r), depth) for r in rows], vis,
                                             [np.eye(len(r), dtype=bool) for r in rows])
            calls += 1
            for b, (f, e) in enumerate(zip(found, expand)):
                n = len(e)
                for t, node in enumerate(e.tolist()):
                    f.slots[node] = int(first[b]) + t
                f.fed += e.tolist()
                if not n:
                    f.level = []
                    continue
                logq = self._log_probs(logits[b, :n], params)  # [n, V]
                par, tok, sc = top_beams(np.asarray(f.scores)[e], logq, width)
                start = len(f.tokens)
                parents = e[par]
                new = np.arange(start, start + len(tok))
                f.ancestors[new] = f.ancestors[parents]
                f.ancestors[new, parents] = True
                f.tokens += tok.tolist()
                f.parents += parents.tolist()
                f.scores += sc.tolist()
                f.slots += [-1] * len(tok)
                f.level = new.tolist()
        return found, calls


@dataclass
class SearchNodes:
    """Every node a beam search kept, for one sequence (ids in creation order, so by depth)."""

    tokens: list[int]
    parents: list[int]  # parent node id, -1 = root
    scores: list[float]  # joint log q of the path root..node
    slots: list[int]  # scratch slot in the draft cache, -1 if never fed
    level: list[int]  # node ids of the deepest depth
    ancestors: np.ndarray  # [capacity, capacity] bool: ancestors[i, j] = node j is a strict ancestor of node i
    fed: list[int]  # node ids fed to the draft, in the order of their scratch slots

    def closure(self, nodes) -> set[int]:
        keep: set[int] = set()
        for node in nodes:
            while node >= 0 and node not in keep:
                keep.add(node)
                node = self.parents[node]
        return keep


class DynamicTreeDrafter(BeamDrafter):
    """A dynamic draft tree (EAGLE-2, Li et al. 2024, section 4): the draft's beam search of `depth`
    tokens with `width` beams grows candidates where the draft is confident, then the `num_nodes` nodes
    with the highest joint log q over all depths are verified as one tree. A node scores no higher than
    its parent (log q <= 0), so the chosen set is a tree; a confident draft yields a long chain, an
    unsure one a bushy tree, per sequence and per round. Children are deterministic (top-k), so
    verification is exact match (greedy) or one-hot rejection (sampling): lossless either way.

    When greedy, nodes are scored with the draft's logits divided by `temperature`, the calibrated
    temperature (acceptance.json `draft_temperature`) at which the draft's probability of a token best
    predicts the target's greedy choice, i.e. greedy acceptance; raw log q ranks deep chains too low
    when the draft is under-confident. When sampling, one-hot acceptance of x is p(x), which the warped
    draft distribution already estimates.
    """

    def __init__(self, backend: Backend, num_nodes: int, width: int, depth: int, bucket: int = 128,
                 temperature: float = 1.0):
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        super().__init__(backend, width, depth, bucket)
        self.num_nodes = num_nodes
        self.temperature = temperature

    def _log_probs(self, logits, params):
        if params is None or params.greedy:
            return log_probs(logits / self.temperature, params)
        return log_probs(logits, params)

    def _expand(self, nodes: SearchNodes) -> list[int]:
        # A node scores no higher than its parent, and ties go to earlier nodes, so a node that does not beat
        # the num_nodes-th best score found so far has no descendant that can be chosen: feeding it is
        # wasted draft work. Search stops for a sequence when no node of its level beats it; the chosen
        # tree is the same as a full search's (tested).
        if len(nodes.scores) < self.num_nodes:
            return nodes.level
        bar = np.partition(np.asarray(nodes.scores), -self.num_nodes)[-self.num_nodes]
        return [i for i in nodes.level if nodes.scores[i] > bar]

    def _select(self, nodes: SearchNodes) -> set[int]:
        # highest joint log q first; ties go to the shallower (earlier) node, so ancestors come first
        order = sorted(range(len(nodes.tokens)), key=lambda i: (-nodes.scores[i], i))
        return nodes.closure(order[: self.num_nodes])
