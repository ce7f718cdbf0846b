"""BeamDrafter: the draft model's beam search for MTAD / MJSD (../shared/papers/mtad-*.txt, mjsd-*.txt).

Per round and sequence: W beams grown for gamma tokens by deterministic beam search on the draft's
log-likelihood log q (warped like the target when sampling, raw when greedy). Beam nodes are scratch
rows in the draft's KV cache, fed one depth per step (W tokens, each seeing only its own ancestors),
so a round costs gamma draft steps of W tokens, like a W-wide tree. The best beam (highest joint
log q) is returned as a chain with its per-prefix joint log-likelihoods, for JointLikelihoodVerifier.
The last depth is never fed; after verification the accepted prefix of the best beam is compacted
into place like any accepted tree path (ModelDrafter.commit).
"""

from __future__ import annotations

import time

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
    def __init__(self, backend: Backend, num_beams: int, gamma: int, bucket: int = 128):
        if num_beams < 1 or gamma < 1:
            raise ValueError(f"num_beams and gamma must be >= 1, got {num_beams} and {gamma}")
        super().__init__(backend, bucket)
        self.num_beams = num_beams
        self.gamma = gamma

    def propose(self, seqs, params, rng):
        t0, busy0 = time.perf_counter(), self.backend.busy_seconds
        batch, width = len(seqs), self.num_beams
        root = log_probs(self._feed_pending(seqs), params)  # [B, V]
        # all nodes of all depths, per sequence: token, parent node (-1 = root), joint log q, scratch slot
        tokens, parents, scores, slots = [], [], [], []
        level = []  # node ids of the current depth, per sequence
        for b in range(batch):
            _, tok, sc = top_beams(np.zeros(1), root[b][None], width)
            tokens.append(list(tok))
            parents.append([-1] * len(tok))
            scores.append(list(sc))
            slots.append([-1] * len(tok))
            level.append(list(range(len(tok))))
        calls = 1
        for depth in range(1, self.gamma):
            n = len(level[0])
            vis = []
            for b in range(batch):  # each beam node sees its own fed ancestors among the scratch rows
                fed = [i for i in range(len(tokens[b])) if slots[b][i] >= 0]
                col = {node: j for j, node in enumerate(fed)}
                v = np.zeros((n, len(fed)), dtype=bool)
                for t, node in enumerate(level[b]):
                    p = parents[b][node]
                    while p >= 0:
                        v[t, col[p]] = True
                        p = parents[b][p]
                vis.append(v)
            rows = [np.asarray([tokens[b][i] for i in level[b]], dtype=np.int64) for b in range(batch)]
            logits, first = self._step_nodes(rows, [np.full(n, depth)] * batch, vis, np.eye(n, dtype=bool))
            calls += 1
            for b in range(batch):
                for t, node in enumerate(level[b]):
                    slots[b][node] = int(first[b]) + t
                logq = log_probs(logits[b, :n], params)  # [n, V]
                par, tok, sc = top_beams(np.asarray([scores[b][i] for i in level[b]]), logq, width)
                start = len(tokens[b])
                tokens[b] += tok.tolist()
                parents[b] += [level[b][int(p)] for p in par]
                scores[b] += sc.tolist()
                slots[b] += [-1] * len(tok)
                level[b] = list(range(start, start + len(tok)))
        trees = []
        self._slots = np.full((batch, self.gamma), -1, dtype=np.int64)
        for b in range(batch):
            best = max(level[b], key=lambda i: scores[b][i])  # the highest joint log q at full depth
            path = []
            while best >= 0:
                path.append(best)
                best = parents[b][best]
            path.reverse()
            self._slots[b, : len(path)] = [slots[b][i] for i in path]
            trees.append(DraftTree(np.asarray([tokens[b][i] for i in path], dtype=np.int64),
                                   np.arange(-1, len(path) - 1), None, True,
                                   joint_logq=np.asarray([scores[b][i] for i in path])))
        self.num_calls = calls
        self.seconds = time.perf_counter() - t0
        self.backend_seconds = self.backend.busy_seconds - busy0
        return trees
