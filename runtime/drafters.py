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


class DraftModelDrafter(Drafter):
    """Fills a TreeSpec with the draft model, one draft step per tree level.

    Level 0 feeds the pending tokens; the root's children are the draft's top-k tokens after them. Each
    later step feeds the nodes of one depth that have children in the spec: they are scratch rows in the
    draft cache (after the pending tokens), each seeing the committed prefix, its ancestors and itself;
    their top-k tokens become their children. A chain spec with temperature > 0 samples each token from
    the warped draft distribution q instead (and records q for lossless rejection sampling); trees use
    deterministic top-k children, verified against one-hot drafts.
    """

    def __init__(self, backend: Backend, spec: TreeSpec, bucket: int = 128):
        self.backend = backend
        self.spec = spec
        self.bucket = bucket
        self.cache = None
        self._base = None  # [B] cache lengths before this round
        self._anchor = None  # [B] cache lengths after the pending tokens (first scratch slot)
        self._slots = None  # [B, N] scratch slot of each fed node, -1 if not fed
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
        spec, cache, batch = self.spec, self.cache, len(seqs)
        self._base = cache.lengths.copy()
        pending = [s.tokens[int(cache.lengths[b]):] for b, s in enumerate(seqs)]
        logits = feed_rows(self.backend, cache, pending)
        self._anchor = cache.lengths.copy()
        tokens = np.zeros((batch, len(spec)), dtype=np.int64)
        sampled = spec.is_chain and not params.greedy
        probs = np.zeros((batch, len(spec), logits.shape[-1])) if sampled else None
        root_rows = logits[np.arange(batch), [len(p) - 1 for p in pending]][:, None]  # [B, 1, V]
        self._fill(np.array([-1]), root_rows, tokens, probs, params, rng)
        self._slots = np.full((batch, len(spec)), -1, dtype=np.int64)
        calls = 1
        for expand, vis, block in self._plan:
            rows = [tokens[b, expand] for b in range(batch)]
            positions = [self._anchor[b] - 1 + spec.depths[expand] for b in range(batch)]
            first_slot = cache.lengths.copy()
            cache.reserve(int(max(first_slot)) + len(expand))
            ids, pos, mask = pack_step(cache, rows, positions, [block] * batch,
                                       None if spec.is_chain else [(int(a), vis) for a in self._anchor])
            logits, new_kv = self.backend.step(ids, pos, mask, cache)
            cache.append(new_kv, [len(expand)] * batch)
            self._slots[:, expand] = first_slot[:, None] + np.arange(len(expand))[None, :]
            calls += 1
            self._fill(expand, logits[:, : len(expand)], tokens, probs, params, rng)
        self.num_calls = calls
        self.seconds = time.perf_counter() - t0
        self.backend_seconds = self.backend.busy_seconds - busy0
        if spec.is_chain:
            return [DraftTree.chain(tokens[b], None if probs is None else probs[b]) for b in range(batch)]
        return [DraftTree(tokens[b], spec.parents, None, spec=spec) for b in range(batch)]

    def commit(self, seqs, verdicts) -> None:
        """Keep K/V of the pending tokens and of the accepted path's nodes that were fed (compacted)."""
        for b, verdict in enumerate(verdicts):
            slots = []
            for node in verdict.path:
                if self._slots[b, node] < 0:
                    break  # a leaf of the spec: never fed, it stays pending with the bonus token
                slots.append(int(self._slots[b, node]))
            self.cache.compact(b, int(self._anchor[b]), slots)

    def keep(self, rows) -> None:
        self.cache.keep(rows)
