"""Drafters propose a DraftTree per sequence; each owns whatever state it drafts from.

Protocol (the Scheduler calls these, in order, on the live sequences `seqs`):
    start(seqs)                      once, after the prompts are known
    propose(seqs, params, rng)       -> one DraftTree per sequence
    commit(seqs, verdicts)           after verification, before the emitted tokens are appended
    keep(rows)                       sequences at other rows finished and left the batch

DraftModelDrafter runs the draft step graph in its own KVCache. Invariant between rounds: the draft
cache holds K/V for seq.tokens[:cache.lengths[b]]; everything after that is "pending" and is fed in
the next round's first draft step. That is how the bonus-token gap is closed: the draft never saw
the bonus token (and, when every drafted token was accepted, never computed K/V for the last one),
so the next round feeds those one or two tokens before drafting anew.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

from specrt.runtime.backends import Backend
from specrt.runtime.sampling import SamplingParams, sample, warp
from specrt.runtime.step_inputs import feed_rows, pack_step
from specrt.runtime.tree import DraftTree, TreeSpec


class Drafter(ABC):
    num_calls = 0  # model calls made by the last start() / propose()
    seconds = 0.0  # wall time spent in the last start() / propose()
    backend_seconds = 0.0  # of which inside model calls

    def start(self, seqs) -> None:
        pass

    @abstractmethod
    def propose(self, seqs, params: SamplingParams, rng: np.random.Generator) -> list[DraftTree]:
        ...

    def commit(self, seqs, verdicts) -> None:
        pass

    def keep(self, rows) -> None:
        pass


class ModelDrafter(Drafter):
    """A drafter that runs a draft model in its own KVCache.

    Each round feeds the pending tokens first (`_feed_pending`), then writes drafted nodes as scratch rows
    after them (`_step_nodes`); subclasses record in `_slots[b, i]` the scratch slot of node i of the tree
    they return (-1 if it was never fed). `commit` keeps the pending rows and compacts the accepted path's
    fed nodes to follow them.
    """

    def __init__(self, backend: Backend, bucket: int = 128):
        self.backend = backend
        self.bucket = bucket
        self.cache = None
        self._anchor = None  # [B] cache lengths after the pending tokens (first scratch slot)
        self._slots = None  # [B, N] scratch slot of each node of the returned trees, -1 if not fed

    def start(self, seqs) -> None:
        """Prefill every prompt but its last token (that one is pending, fed in the first round)."""
        t0 = time.perf_counter()
        self.cache = self.backend.new_cache(len(seqs), self.bucket)
        feed = [s.tokens[:-1] for s in seqs]
        self.num_calls = 0
        if max(len(f) for f in feed):
            feed_rows(self.backend, self.cache, feed)
            self.num_calls = 1
        self.seconds = time.perf_counter() - t0

    def _feed_pending(self, seqs) -> np.ndarray:
        """Feed each sequence's tokens the draft has not seen; returns the root's logits [B, V]."""
        cache = self.cache
        pending = [s.tokens[int(cache.lengths[b]):] for b, s in enumerate(seqs)]
        logits = feed_rows(self.backend, cache, pending)
        self._anchor = cache.lengths.copy()
        return logits[np.arange(len(seqs)), [len(p) - 1 for p in pending]]

    def _step_nodes(self, rows, depths, vis, blocks):
        """Feed one level of scratch nodes: rows[b] [n_b] tokens at depths[b] [n_b] (>= 1) below the root,
        each seeing the scratch rows marked in vis[b] [n_b, scratch rows so far] (None: all of them) and,
        among the new tokens, what blocks[b] [n_b, n_b] says (one array: the same for every sequence).
        Returns (logits [B, max n_b, V], first slot [B])."""
        cache, batch = self.cache, len(rows)
        first_slot = cache.lengths.copy()
        cache.reserve(int(max(first_slot + np.asarray([len(r) for r in rows]))))
        positions = [self._anchor[b] - 1 + depths[b] for b in range(batch)]
        scratch = None if vis is None else [(int(self._anchor[b]), vis[b]) for b in range(batch)]
        blocks = [blocks] * batch if isinstance(blocks, np.ndarray) else blocks
        ids, pos, mask = pack_step(cache, rows, positions, blocks, scratch)
        logits, new_kv = self.backend.step(ids, pos, mask, cache)
        cache.append(new_kv, [len(r) for r in rows])
        return logits, first_slot

    def commit(self, seqs, verdicts) -> None:
        for b, verdict in enumerate(verdicts):
            slots = []
            for node in verdict.path:
                if self._slots[b, node] < 0:
                    break  # never fed (a leaf): it stays pending with the bonus token
                slots.append(int(self._slots[b, node]))
            self.cache.compact(b, int(self._anchor[b]), slots)

    def keep(self, rows) -> None:
        self.cache.keep(rows)


class DraftModelDrafter(ModelDrafter):
    """Fills a TreeSpec with the draft model, one draft step per tree level.

    Level 0 feeds the pending tokens; the root's children are the draft's top-k tokens after them. Each
    later step feeds the nodes of one depth that have children in the spec: they are scratch rows in the
    draft cache (after the pending tokens), each seeing the committed prefix, its ancestors and itself;
    their top-k tokens become their children. A chain spec with temperature > 0 samples each token from
    the warped draft distribution q instead (and records q for lossless rejection sampling); trees use
    deterministic top-k children, verified against one-hot drafts.
    """

    def __init__(self, backend: Backend, spec: TreeSpec, bucket: int = 128):
        super().__init__(backend, bucket)
        self.spec = spec
        # per level d >= 1: nodes fed (those with children) and their visibility of earlier fed nodes
        self._plan = []
        fed: list[int] = []
        anc = spec.row_mask[1:, 1:]  # [N, N] ancestor-or-self
        for level in spec.levels[:-1]:
            expand = np.asarray([i for i in level if spec.num_children[i + 1] > 0], dtype=np.int64)
            vis = anc[np.ix_(expand, np.asarray(fed, dtype=np.int64))] if fed else np.zeros((len(expand), 0), bool)
            self._plan.append((expand, vis, np.eye(len(expand), dtype=bool)))
            fed += expand.tolist()
        self._children = [spec.children(i) for i in range(-1, len(spec))]  # [N + 1] by parent (root first)

    def _fill(self, parents: np.ndarray, rows: np.ndarray, tokens: np.ndarray, probs, params, rng) -> None:
        """Set the tokens of the children of `parents` (node ids, -1 = root) from their next-token
        logits rows [B, len(parents), V], all parents of one level at once."""
        kids = [self._children[p + 1] for p in parents]
        if probs is not None:  # sampled chain: one child, drawn from q
            q = warp(rows[:, 0], params)
            for b in range(len(rows)):
                tokens[b, kids[0][0]] = sample(q[b], rng)
                probs[b, kids[0][0]] = q[b]
            return
        child = np.concatenate(kids)  # [M] children of this level's parents
        which = np.repeat(np.arange(len(parents)), [len(k) for k in kids])  # [M] their parent's row
        rank = self.spec.ranks[child]  # [M]
        k = int(rank.max()) + 1
        if k == 1:
            tokens[:, child] = rows.argmax(axis=-1)[:, which]
            return
        top = np.argpartition(-rows, k - 1, axis=-1)[..., :k]  # [B, P, k] unordered
        order = np.argsort(-np.take_along_axis(rows, top, axis=-1), axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)  # [B, P, k] best first
        tokens[:, child] = top[:, which, rank]

    def propose(self, seqs, params, rng):
        t0, busy0 = time.perf_counter(), self.backend.busy_seconds
        spec, batch = self.spec, len(seqs)
        root = self._feed_pending(seqs)
        tokens = np.zeros((batch, len(spec)), dtype=np.int64)
        sampled = spec.is_chain and not params.greedy
        probs = np.zeros((batch, len(spec), root.shape[-1])) if sampled else None
        self._fill(np.array([-1]), root[:, None], tokens, probs, params, rng)
        self._slots = np.full((batch, len(spec)), -1, dtype=np.int64)
        for expand, vis, block in self._plan:
            logits, first_slot = self._step_nodes([tokens[b, expand] for b in range(batch)],
                                                  [spec.depths[expand]] * batch,
                                                  None if spec.is_chain else [vis] * batch, block)
            self._slots[:, expand] = first_slot[:, None] + np.arange(len(expand))[None, :]
            self._fill(expand, logits[:, : len(expand)], tokens, probs, params, rng)
        self.num_calls = 1 + len(self._plan)
        self.seconds = time.perf_counter() - t0
        self.backend_seconds = self.backend.busy_seconds - busy0
        if spec.is_chain:
            return [DraftTree.chain(tokens[b], None if probs is None else probs[b]) for b in range(batch)]
        return [DraftTree(tokens[b], spec.parents, None, spec=spec) for b in range(batch)]
