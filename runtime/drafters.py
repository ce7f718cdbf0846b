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
from specrt.runtime.step_inputs import feed_rows
from specrt.runtime.tree import DraftTree


class Drafter(ABC):
    num_calls = 0  # model calls made by the last propose()
    seconds = 0.0  # wall time spent in the last start()/propose()
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
    """A chain of `num_draft_tokens` tokens from a small draft model (greedy or sampled from warped q)."""

    def __init__(self, backend: Backend, num_draft_tokens: int, bucket: int = 128):
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.backend = backend
        self.num_draft_tokens = num_draft_tokens
        self.bucket = bucket
        self.cache = None
        self._base = None  # [B] cache lengths before this round's drafting

    def start(self, seqs) -> None:
        """Prefill every prompt but its last token (that one is pending, fed in the first round)."""
        t0 = time.perf_counter()
        self.cache = self.backend.new_cache(len(seqs), self.bucket)
        feed = [s.tokens[:-1] for s in seqs]
        if max(len(f) for f in feed):
            feed_rows(self.backend, self.cache, feed)
        self.seconds = time.perf_counter() - t0

    def propose(self, seqs, params, rng):
        t0, busy0 = time.perf_counter(), self.backend.busy_seconds
        cache = self.cache
        self._base = cache.lengths.copy()
        feeds = [s.tokens[int(cache.lengths[b]):] for b, s in enumerate(seqs)]
        last_rows = [len(f) - 1 for f in feeds]
        drafted = [[] for _ in seqs]
        probs = [[] for _ in seqs] if not params.greedy else None
        for j in range(self.num_draft_tokens):
            logits = feed_rows(self.backend, cache, feeds)
            rows = logits[np.arange(len(seqs)), last_rows]  # [B, V] next-token logits
            if params.greedy:
                nxt = rows.argmax(axis=-1)
            else:
                q = warp(rows, params)
                nxt = [sample(q[b], rng) for b in range(len(seqs))]
                for b in range(len(seqs)):
                    probs[b].append(q[b])
            for b in range(len(seqs)):
                drafted[b].append(int(nxt[b]))
            if j + 1 < self.num_draft_tokens:
                feeds = [np.asarray([t[-1]], dtype=np.int64) for t in drafted]
                last_rows = [0] * len(seqs)
        self.num_calls = self.num_draft_tokens
        self.seconds = time.perf_counter() - t0
        self.backend_seconds = self.backend.busy_seconds - busy0
        return [DraftTree.chain(drafted[b], None if probs is None else np.stack(probs[b])) for b in range(len(seqs))]

    def commit(self, seqs, verdicts) -> None:
        """Keep K/V of the fed pending tokens and of accepted drafts whose K/V were computed."""
        for b, (seq, verdict) in enumerate(zip(seqs, verdicts)):
            pending = len(seq.tokens) - int(self._base[b])
            valid = pending + min(len(verdict.path), self.num_draft_tokens - 1)
            self.cache.truncate(b, int(self._base[b]) + valid)

    def keep(self, rows) -> None:
        self.cache.keep(rows)
