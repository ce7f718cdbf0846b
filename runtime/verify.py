"""Verifiers: from the target's logits over a DraftTree, the accepted path and the bonus token.

`logits` rows follow the tree's step rows: row 0 is the root, row i + 1 is node i (see tree.py).

- GreedyVerifier: follow the child whose token equals the target's argmax; bonus = argmax after the
  path. Output is token-identical to greedy autoregressive decoding.
- RejectionVerifier: lossless sampling (Leviathan et al. 2023; Chen et al. 2023), in SpecInfer's
  multi-round form over siblings: at each node, try its children in order, accepting child x with
  probability min(1, p(x) / q(x)); after a rejection p becomes norm(max(p - q, 0)). When no child is
  accepted the bonus is sampled from the current p. For a chain this is exactly the classic rule, and
  emitted tokens are distributed as the target's warped distribution.
  Deterministic drafts (top-k children, n-grams; `draft_probs is None`) are one-hot proposals: trying
  children in order with q = one-hot is the same as drawing y ~ p and following the child whose token
  is y, if any; otherwise y is the bonus. Also lossless.
- TypicalVerifier: typical acceptance (Medusa, Cai et al. 2024; one of PPD's two verification schemes).
  Not lossless: it keeps drafted tokens the target finds plausible, not only those it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.runtime.sampling import SamplingParams, log_probs, sample, warp
from specrt.runtime.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted nodes, root to leaf
    bonus: int  # token emitted by the target after the path
    beyond: int = 0  # (MergedDrafter, to each drafter) accepted nodes past the end of `path` that lie in other trees


class Verifier(Protocol):
    """What every verifier does: from the target's logits over a DraftTree (row 0 the root, row i + 1 node i), the
    accepted path and the bonus token (runtime/reference.py shows the greedy case in one loop)."""

    head: str  # what it reads of the target's logits (Runner.step's head): "argmax" or whole "logits"

    def verify(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams,
               rng: np.random.Generator) -> Verdict: ...


class GreedyVerifier:
    head = "argmax"  # what it reads of the target's logits (Runner.step): each row's argmax, nothing more

    def verify(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Verdict:
        """`logits`: [N + 1, V], or their argmax [N + 1] (head "argmax")."""
        best = logits if logits.ndim == 1 else logits.argmax(axis=-1)  # [N + 1]
        path: list[int] = []
        node = -1
        if tree.is_chain:
            matches = tree.tokens == best[:-1]
            num = len(tree) if matches.all() else int(np.argmin(matches))
            return Verdict(list(range(num)), int(best[num]))
        if tree.spec is not None:  # every root-to-leaf path at once (Medusa-style retrieve indices)
            rows = tree.spec.retrieve  # [leaves, depth]
            parent_rows = np.concatenate([np.zeros((len(rows), 1), np.int64), rows[:, :-1]], axis=1)
            ok = (rows > 0) & (tree.tokens[rows - 1] == best[np.maximum(parent_rows, 0)])
            lengths = np.cumprod(ok, axis=1).sum(axis=1)
            leaf = int(np.argmax(lengths))
            num = int(lengths[leaf])
            path = (rows[leaf, :num] - 1).tolist()
            return Verdict(path, int(best[rows[leaf, num - 1]] if num else best[0]))
        while True:
            hit = [c for c in tree.children(node) if tree.tokens[c] == best[node + 1]]
            if not hit:
                return Verdict(path, int(best[node + 1]))
            node = int(hit[0])
            path.append(node)


class RejectionVerifier:
    head = "logits"  # whole rows: it warps them into distributions

    def verify(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Verdict:
        if tree.draft_probs is None:
            return self._one_hot(tree, logits, params, rng)
        path: list[int] = []
        node = -1
        while True:
            p = warp(logits[node + 1], params)
            accepted = None
            for child in tree.children(node):
                x = int(tree.tokens[child])
                q = tree.draft_probs[child]
                if q[x] > 0 and rng.random() * q[x] < p[x]:  # accept with prob min(1, p(x)/q(x))
                    accepted = int(child)
                    break
                residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                if total <= 0:  # p == q on the support: any residual draw is as good as p
                    break
                p = residual / total
            if accepted is None:
                return Verdict(path, sample(p, rng))
            node = accepted
            path.append(node)

    @staticmethod
    def _one_hot(tree: DraftTree, logits, params, rng) -> Verdict:
        path: list[int] = []
        node = -1
        while True:
            y = sample(warp(logits[node + 1], params), rng)
            hit = [c for c in tree.children(node) if tree.tokens[c] == y]
            if not hit:
                return Verdict(path, y)
            node = int(hit[0])
            path.append(node)


class JointLikelihoodVerifier:
    """MTAD / MJSD (../shared/papers/mtad-*.txt, mjsd-*.txt): accept the *longest* drafted prefix
    x_1..x_j with min(1, p(x_1:j) / q(x_1:j)) > tau, even when a shorter prefix failed, where p and q
    are the target's and the draft's joint likelihoods of the prefix; then the bonus token from the
    target at the next position: its argmax when greedy (MJSD), a sample of the warped distribution
    otherwise (MTAD). Not lossless: it trades exactness for joint likelihood. tau = 1 accepts nothing.

    The draft may be a tree of several beams (BeamDrafter num_verified > 1): every node is the end of a
    prefix of some beam, so the accepted prefix is the deepest passing node of the whole tree; among
    equally deep ones, the one the target likes best (highest p).
    """

    head = "logits"  # whole rows: the target's likelihoods

    def __init__(self, tau: float):
        if not 0 <= tau <= 1:
            raise ValueError(f"tau must be in [0, 1], got {tau}")
        self.tau = tau

    def passing(self, logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
        """Which prefixes have min(1, p / q) > tau, from their joint log-likelihoods."""
        if self.tau >= 1:
            return np.zeros(len(logp), dtype=bool)
        ratio = np.minimum(0.0, logp - logq)  # log min(1, p/q)
        return ratio > (np.log(self.tau) if self.tau > 0 else -np.inf)

    def accepted_length(self, logp: np.ndarray, logq: np.ndarray) -> int:
        """Longest j with min(1, p_j / q_j) > tau, from per-prefix joint log-likelihoods [gamma] of a chain."""
        passing = np.flatnonzero(self.passing(logp, logq))
        return int(passing[-1]) + 1 if len(passing) else 0

    def verify(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Verdict:
        if len(tree) and tree.joint_logq is None:
            raise ValueError("joint-likelihood verification needs the draft's joint log-likelihoods")
        path: list[int] = []
        if len(tree):
            logprobs = log_probs(logits[: len(tree)], params)  # [N, V] the rows that are parents of some node
            step = logprobs[tree.parents + 1, tree.tokens]  # [N] log p(node | its ancestors)
            if tree.is_chain:
                logp = np.cumsum(step)
            else:
                logp = step.copy()
                for i, parent in enumerate(tree.parents):  # parents come first
                    if parent >= 0:
                        logp[i] += logp[parent]
            ok = np.flatnonzero(self.passing(logp, tree.joint_logq))
            if len(ok):
                depth = tree.depths()[ok + 1]
                best = ok[np.lexsort((-logp[ok], -depth))[0]]  # deepest, then likeliest under the target
                node = int(best)
                while node >= 0:
                    path.append(node)
                    node = int(tree.parents[node])
                path.reverse()
        row = logits[path[-1] + 1 if path else 0]
        bonus = int(row.argmax()) if params.greedy else sample(warp(row, params), rng)
        return Verdict(path, bonus)


class TypicalVerifier:
    """Typical acceptance: drafted token x below a node is accepted where the target's warped probability there
    passes p(x) > min(epsilon, delta * exp(-H(p))), H the entropy of p (Medusa's criterion, Cai et al. 2024,
    used by PPD; defaults epsilon 0.09 and delta 0.3 as in Medusa's released code). Low-entropy rows demand
    a likely token, high-entropy rows (where many continuations are fine) take less likely ones too.

    Every node whose ancestors all pass is a candidate end; the deepest wins (ties: the likeliest under the
    target). The bonus is sampled from p truncated to the tokens that pass the same threshold, so every emitted
    token passes it; the argmax always does (p_max >= exp(-H) >= delta * exp(-H) for delta <= 1). Needs
    temperature > 0: at temperature 0 the exact-match verifier is the method. Not lossless: the emitted
    distribution is not the target's, and a draft changes what is emitted.
    """

    head = "logits"  # whole rows: their entropy and probabilities

    def __init__(self, epsilon: float, delta: float):
        if not 0 < epsilon <= 1 or not 0 < delta <= 1:
            raise ValueError(f"typical acceptance needs epsilon and delta in (0, 1], got {epsilon}, {delta}")
        self.epsilon, self.delta = epsilon, delta

    def thresholds(self, probs: np.ndarray) -> np.ndarray:
        """[...] the acceptance threshold of each distribution [..., V]."""
        q = probs.astype(np.float32)  # a threshold needs no float64 logs (2x faster over a vocabulary row)
        neg_entropy = (q * np.log(np.maximum(q, np.finfo(np.float32).tiny))).sum(axis=-1)  # 0 log 0 = 0
        return np.minimum(self.epsilon, self.delta * np.exp(neg_entropy.astype(np.float64)))

    def verify(self, tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Verdict:
        if params.greedy:
            raise ValueError("typical acceptance needs temperature > 0 (greedy decoding verifies by exact match)")
        path: list[int] = []
        rows = tree.parents + 1  # the row whose distribution scores each node
        used = np.unique(np.append(rows, 0))
        probs = warp(logits[used], params)  # [R, V], each row warped once
        limits = self.thresholds(probs)
        if len(tree):
            where = np.searchsorted(used, rows)
            vocab = probs.shape[-1]
            ok = tree.tokens < vocab  # ids past the vocabulary (PPD's prompt tokens) are never accepted
            p = np.zeros(len(tree))
            p[ok] = probs[where[ok], tree.tokens[ok]]
            ok &= p > limits[where]
            alive, logp = ok.copy(), np.where(ok, np.log(np.where(ok, p, 1.0)), -np.inf)
            for i, parent in enumerate(tree.parents):  # parents come first
                if parent >= 0 and alive[i]:
                    alive[i] = alive[parent]
                    logp[i] += logp[parent]
            ends = np.flatnonzero(alive)
            if len(ends):
                depth = tree.depths()[ends + 1]
                node = int(ends[np.lexsort((-logp[ends], -depth))[0]])
                while node >= 0:
                    path.append(node)
                    node = int(tree.parents[node])
                path.reverse()
        end = path[-1] + 1 if path else 0
        at = int(np.searchsorted(used, end))
        if at < len(used) and used[at] == end:  # the bonus row is a parent row: warped already
            p, limit = probs[at], limits[at]
        else:
            p = warp(logits[end], params)
            limit = self.thresholds(p)
        keep = p > limit
        if keep.any():  # not for a uniform p with delta = 1, where nothing passes strictly
            p = np.where(keep, p, 0.0)
        return Verdict(path, sample(p / p.sum(), rng))


def make_verifier(params: SamplingParams):
    return GreedyVerifier() if params.greedy else RejectionVerifier()
