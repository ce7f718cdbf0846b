"""BeamDrafter: the draft model's beam search for MTAD / MJSD (../shared/papers/mtad-*.txt, mjsd-*.txt).

Per round and sequence: W beams grown for gamma tokens on the draft's log-likelihood log q. Greedy (MJSD):
deterministic beam search on the raw q, the W likeliest extensions kept at each depth. Sampling (MTAD,
temperature > 0): beam sampling as the MTAD paper defines it (section 2.1, eq. 2), W extensions drawn
without replacement in proportion to their joint warped likelihood (the Gumbel-top-W trick), so the
drafts, and not only the bonus token, follow the sampling temperature.

Beam nodes are scratch rows in the draft's KV cache, fed one depth per step (W tokens, each seeing only
its own ancestors), so a round costs gamma draft steps of W tokens, like a W-wide tree. The best beam
(highest joint log q) is returned as a chain with its per-prefix joint log-likelihoods, for
JointLikelihoodVerifier; with `num_verified` = k > 1 the top k beams are returned as one tree (shared
prefixes merged), which the target verifies in one step (the MTAD paper's stated future work, section
3.3). The last depth is never fed; after verification the accepted path is compacted into place like
any accepted tree path (ModelDrafter.commit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.runtime.backends import Runner
from specrt.runtime.backends.base import TopK, TopLogProbs
from specrt.runtime.drafters.base import ModelDrafter
from specrt.runtime.sampling import log_probs, rng_of, top_k
from specrt.runtime.tree import DraftTree


def top_beams(scores: np.ndarray, logq: np.ndarray | TopK, width: int,
              rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best `width` extensions of beams with joint log-likelihoods scores [W0] by next-token logq [W0, V] (or each
    beam's best >= `width` tokens only, a TopK: the same best extensions); with `rng` (whole rows only), `width`
    extensions sampled without replacement in proportion to exp(joint log-likelihood).

    Returns (parent beam [width], token [width], new joint log-likelihood [width]), best (or first drawn) first."""
    tokens = None
    if isinstance(logq, TopK):
        logq, tokens = logq.values, logq.tokens
    cand = scores[:, None] + logq  # [W0, V] (or [W0, k])
    flat = cand.ravel()
    # never extend with a token the (warped) draft gives probability 0: its joint q would be 0
    k = min(width, int(np.isfinite(flat).sum()))
    key = flat if rng is None else flat + rng.gumbel(size=flat.shape)  # -inf stays -inf
    top = top_k(key, k)
    parent, column = top // logq.shape[1], top % logq.shape[1]
    return parent, column if tokens is None else tokens[parent, column], flat[top]


class BeamDrafter(ModelDrafter):
    sample_beams = True  # beam sampling when the request samples (MTAD); DynamicTreeDrafter keeps top-k
    temperature = 1.0  # greedy search scores log softmax(logits / temperature) (DynamicTreeDrafter: calibrated)

    def __init__(self, runner: Runner, num_beams: int, gamma: int, bucket: int = 128, num_verified: int = 1):
        if num_beams < 1 or gamma < 1:
            raise ValueError(f"num_beams and gamma must be >= 1, got {num_beams} and {gamma}")
        if not 1 <= num_verified <= num_beams:
            raise ValueError(f"num_verified must be in [1, num_beams={num_beams}], got {num_verified}")
        super().__init__(runner, bucket)
        self.num_beams = num_beams
        self.gamma = gamma
        self.num_verified = num_verified

    def _propose(self, seqs, params, rng):
        sampling = self.sample_beams and not params.greedy
        nodes = self._search(seqs, params, rng if sampling else None)
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
        return trees

    def _log_probs(self, logits: np.ndarray | TopK, params) -> np.ndarray | TopK:
        """log q of the next token [..., V], greedy at `temperature`, else warped as the request samples; a TopK (the
        step's TopLogProbs head) is that already."""
        if isinstance(logits, TopK):
            return logits
        if params is None or params.greedy:
            return log_probs(logits / self.temperature, params)
        return log_probs(logits, params)

    def _head(self, params, sampling: bool):
        """What the search reads of each draft step: the `num_beams` likeliest tokens' log q at `temperature` where
        it searches deterministically and greedily and the logits lie on a device (computed there: only those cross
        to the host), else the whole logits (host arrays already: ranking them there first only adds host work)."""
        greedy = not sampling and (params is None or params.greedy)
        return TopLogProbs(self.num_beams, self.temperature) if greedy and not self.runner.backend.host_logits \
            else "logits"

    def _select(self, nodes: "SearchNodes") -> set[int]:
        """The top `num_verified` beams at full depth (highest joint log q first) with their ancestors."""
        return nodes.closure(sorted(nodes.level, key=lambda i: -nodes.scores[i])[: self.num_verified])

    def _expand(self, nodes: "SearchNodes") -> list[int]:
        """The nodes of the deepest level to feed and extend (beam search: all of them)."""
        return nodes.level

    def _search(self, seqs, params, rng) -> list["SearchNodes"]:
        """Beam search (beam sampling with `rng`) of gamma tokens per sequence; every node kept at every depth."""
        batch, width = len(seqs), self.num_beams
        head = self._head(params, rng is not None)
        root = self._log_probs(self._feed_pending(seqs, head), params)  # [B, V] (or a TopK [B, k])
        found = []
        for b in range(batch):
            _, tok, sc = top_beams(np.zeros(1), root[b][None], width, None if rng is None else rng_of(rng, b))
            found.append(SearchNodes(list(tok), [-1] * len(tok), list(sc), [-1] * len(tok), list(range(len(tok))),
                                     np.zeros((width * self.gamma, width * self.gamma), dtype=bool), []))
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
                                             [np.eye(len(r), dtype=bool) for r in rows], head)
            for b, (f, e) in enumerate(zip(found, expand)):
                n = len(e)
                for t, node in enumerate(e.tolist()):
                    f.slots[node] = int(first[b]) + t
                f.fed += e.tolist()
                if not n:
                    f.level = []
                    continue
                logq = self._log_probs(logits[b, :n], params)  # [n, V] (or a TopK [n, k])
                par, tok, sc = top_beams(np.asarray(f.scores)[e], logq, width, None if rng is None else rng_of(rng, b))
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
        return found


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
