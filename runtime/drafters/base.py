"""Drafters propose a DraftTree per sequence; each owns whatever state it drafts from.

Protocol (the Scheduler calls these, in order, on the live sequences `seqs`):
    start(seqs)                      once, after the prompts are known
    admit(new)                       sequences `new` joined the batch after the live ones (continuous batching)
    propose(seqs, params, rng)       -> one DraftTree per sequence
    target_logits(logits, rows)      the target step's logits [B, T, V] as its runner holds them (on a device
                                     backend, a tensor there) and each sequence's step row of every node of the
                                     drafter's tree (root first; None: row i + 1 for node i): drafters that draft
                                     from the target's own outputs read them here (PPD's prompt tokens)
    target_hidden(hidden, rows, first=0)  the target's hidden states [B, T, H] (where its runner holds them) and each
                                     sequence's step rows the target committed, in order: every prefill row, then
                                     each round's root and accepted path; `first`: the batch row of hidden's first
                                     sequence (admissions). Drafters that draft from them read them here (a head)
    commit(seqs, verdicts)           after verification, before the emitted tokens are appended
    keep(rows)                       sequences at other rows finished and left the batch

`start`, `admit` and `propose` are template methods: the base class times them and counts the model steps they
made (`num_calls`, `seconds`, `backend_seconds` describe the last call); subclasses implement `_start`
`_admit` and `_propose`.

ModelDrafter runs the draft step graph in its own KVCache. Invariant between rounds: the draft cache
holds K/V for seq.tokens[:cache.lengths[b]]; everything after that is "pending" and is fed in the next
round's first draft step. That is how the bonus-token gap is closed: the draft never saw the bonus
token (and, when every drafted token was accepted, never computed K/V for the last one), so the next
round feeds those one or two tokens before drafting anew.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager

import numpy as np

from specrt.runtime.backends import Runner
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.step_inputs import admit, feed_rows, pack_features, pack_step, prefill
from specrt.runtime.tree import DraftTree


class Drafter(ABC):
    runner: Runner | None = None  # the draft model's runner (model drafters only)
    num_calls = 0  # model steps made by the last start() / propose()
    seconds = 0.0  # wall time of the last start() / propose()
    backend_seconds = 0.0  # of which inside model steps

    def start(self, seqs) -> None:
        with self._timed():
            self._start(seqs)

    def admit(self, new) -> None:
        with self._timed():
            self._admit(new)

    def propose(self, seqs, params: SamplingParams, rng) -> list[DraftTree]:
        """One DraftTree per sequence; `rng`: one Generator for the batch, or a list of one per sequence (rng_of)."""
        with self._timed():
            trees = self._propose(seqs, params, rng)
        return trees

    def _start(self, seqs) -> None:
        pass

    @abstractmethod
    def _admit(self, new) -> None:
        """Take on sequences that joined the batch after the live ones (rows len(live) ...)."""

    @abstractmethod
    def _propose(self, seqs, params: SamplingParams, rng: np.random.Generator) -> list[DraftTree]:
        ...

    def target_logits(self, logits, rows=None) -> None:
        """The target's logits of the round's step [B, T, V] where they lie, valid until its next step, and the step
        rows of this drafter's nodes (module docstring; drafters that read them: reads_target_logits)."""

    @property
    def reads_target_logits(self) -> bool:
        """Whether target_logits reads them (the scheduler hands them over; what crosses to the host is the
        drafter's to choose)."""
        return type(self).target_logits is not Drafter.target_logits

    def target_hidden(self, hidden, rows, first: int = 0) -> None:
        """The target's hidden states of the rows it committed (module docstring; drafters that read them:
        reads_target_hidden)."""

    @property
    def reads_target_hidden(self) -> bool:
        return type(self).target_hidden is not Drafter.target_hidden

    def commit(self, seqs, verdicts) -> None:
        pass

    def keep(self, rows) -> None:
        pass

    def close(self) -> None:
        """Give back the draft model's runner (the call is over)."""
        if self.runner is not None:
            self.runner.close()

    def usage(self) -> tuple[int, float]:
        """(model steps, seconds inside them) since creation."""
        r = self.runner
        return (r.num_steps, r.busy_seconds) if r is not None else (0, 0.0)

    @contextmanager
    def _timed(self):
        t0, (steps0, busy0) = time.perf_counter(), self.usage()
        yield
        steps, busy = self.usage()
        self.num_calls, self.backend_seconds = steps - steps0, busy - busy0
        self.seconds = time.perf_counter() - t0


class ModelDrafter(Drafter):
    """A drafter that runs a draft model in its own KVCache.

    Each round feeds the pending tokens first (`_feed_pending`), then writes drafted nodes as scratch rows
    after them (`_step_nodes`); subclasses record in `_slots[b, i]` the scratch slot of node i of the tree
    they return (-1 if it was never fed). `commit` keeps the pending rows and compacts the accepted path's
    fed nodes to follow them.
    """

    def __init__(self, runner: Runner, bucket: int = 128):
        self.runner = runner
        self.bucket = bucket
        self.cache = None
        self._anchor = None  # [B] draft cache length after the pending tokens (scratch rows start here)
        self._slots = None  # [B, N] scratch slot of each node of the returned trees, -1 if not fed

    def _start(self, seqs) -> None:
        """Prefill every prompt but its last token (that one is pending, fed in the first round)."""
        self.cache = self.runner.new_cache(len(seqs), self.bucket)
        prefill(self.runner, self.cache, [s.tokens[:-1] for s in seqs])

    def _admit(self, new) -> None:
        admit(self.runner, self.cache, [s.tokens[:-1] for s in new])

    def _feed_pending(self, seqs, head: str = "logits") -> np.ndarray:
        """Feed each sequence's tokens the draft has not seen; returns the root's logits [B, V], or what `head` keeps
        of them (Runner.step: argmax [B], a TopK [B, k])."""
        cache = self.cache
        pending = [s.tokens[int(cache.lengths[b]):] for b, s in enumerate(seqs)]
        root = feed_rows(self.runner, cache, pending, head, last=True)  # only the last rows leave the device
        self._anchor = cache.lengths.copy()
        return root

    def _step_nodes(self, rows, depths, vis, blocks, head: str = "logits", features=None):
        """Feed one level of scratch nodes: rows[b] [n_b] tokens at depths[b] [n_b] (>= 1) below the root,
        each seeing the scratch rows marked in vis[b] [n_b, scratch rows so far] (None: all of them) and,
        among the new tokens, what blocks[b] [n_b, n_b] says (one array: the same for every sequence).
        `rows` may also be one [B, n] array of a "device-argmax" head's tokens (pack_step). `features`: a draft
        head's, one [n_b, H] array per sequence. Returns (logits [B, max n_b, V], or what `head` keeps of them
        (Runner.step: e.g. their argmax [B, max n_b]), first slot [B])."""
        cache, batch = self.cache, len(rows)
        first_slot = cache.lengths.copy()
        cache.reserve(int(max(first_slot + np.asarray([len(r) for r in rows]))))
        positions = [self._anchor[b] - 1 + depths[b] for b in range(batch)]
        scratch = None if vis is None else [(int(self._anchor[b]), vis[b]) for b in range(batch)]
        blocks = [blocks] * batch if isinstance(blocks, np.ndarray) else blocks
        ids, pos, mask = pack_step(cache, rows, positions, blocks, scratch)
        fed = {} if features is None else {"features": pack_features(features, ids.shape[1])}
        logits, new_kv = self.runner.step(ids, pos, mask, cache, head, **fed)
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
