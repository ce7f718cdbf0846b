"""Scheduler: the one decode loop. Every method is a Drafter + Verifier pair run by it.

Per round, for the live sequences of a batch: the drafter proposes one DraftTree each; one target step
scores root + nodes of every tree (ragged rows, no KV padding); the verifier picks each sequence's
accepted path and bonus token; the target cache appends only the root and the accepted path
(compacted), the drafter commits its own state; emitted tokens are appended, truncated at EOS and at
max_new_tokens. Finished sequences leave the batch independently, and with more sequences waiting than
`max_batch`, the next ones take their places between rounds (continuous batching): each is prefilled on
its own and joins the running batch, which no sequence waits out.

Padded batches (`padded=True`, benchmarking only) are the vanilla batched speculative decoding that EMS-SD
measures itself against: before every round, each sequence's target cache is padded with masked slots to the
batch's longest (after prefill, to the longest prompt; after verification, to the longest accepted), so the
padding costs attention and cache memory as it does there. Step inputs are [B, T] in both modes (the step
contract), padded to the widest tree with holes; unpadded, a backend that packs rows (OrtBackend) leaves the holes
out of its token-wise work (EMS-SD's unpadded input tokens), padded, the target's holes are computed as real rows
(KVCache.compute_holes). The draft model's cache and steps are never padded.

Invariant between rounds: the target cache holds K/V for seq.tokens[:-1]; the last token is the root.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from specrt.errors import InvalidRequestError
from specrt.runtime.backends import Runner
from specrt.runtime.drafters import Drafter
from specrt.runtime.sampling import SamplingParams, rng_of
from specrt.runtime.stats import RoundTimes, Stats
from specrt.runtime.step_inputs import admit, pack_step, prefill
from specrt.runtime.tree import DraftTree
from specrt.runtime.verify import Verdict, Verifier


class SeqState:
    """One request's tokens in a preallocated buffer (appends never copy the history)."""

    def __init__(self, index: int, prompt: Sequence[int], max_new_tokens: int, slack: int):
        self.index = index  # position in the caller's list of prompts
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self._buf = np.zeros(len(prompt) + max_new_tokens + slack, dtype=np.int64)
        self._buf[: len(prompt)] = prompt
        self._len = len(prompt)
        self.stats = Stats()
        self.finished = False
        self.finish_reason = None  # "eos", "length" or "cancelled"
        self.cancelled = False  # set from any thread: the sequence leaves the batch at the end of the round
        self.started = None  # time.perf_counter() its request began (Server), else the run's
        self.rng = None  # its own np.random.Generator (a Server request's seed), else the run's

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._len]

    @property
    def new_tokens(self) -> np.ndarray:
        return self._buf[self.prompt_len: self._len]

    def extend(self, emitted: Sequence[int], eos_id: int | None) -> list[int]:
        """Append emitted tokens, stopping after EOS or at max_new_tokens; returns what was appended."""
        room = self.max_new_tokens - (self._len - self.prompt_len)
        out = list(emitted[:room])
        if eos_id is not None and eos_id in out:
            out = out[: out.index(eos_id) + 1]
            self.finished, self.finish_reason = True, "eos"
        self._buf[self._len: self._len + len(out)] = out
        self._len += len(out)
        if not self.finished and self._len - self.prompt_len >= self.max_new_tokens:
            self.finished, self.finish_reason = True, "length"
        return out


def compaction(finished: Sequence[bool]) -> list[int]:
    """Which old batch row each new row takes when the finished sequences leave: survivors at the front stay where
    they are and the last survivors fill the holes (KVCache.keep then copies one row per hole, not the batch)."""
    n = len(finished) - sum(finished)
    rows = list(range(n))
    holes = [b for b in range(n) if finished[b]]
    movers = [b for b in range(n, len(finished)) if not finished[b]]
    for hole, mover in zip(holes, movers):
        rows[hole] = mover
    return rows


class Waiting:
    """Sequences waiting for a place in the batch, in order. A list's sequences, or (Server) a queue that other
    threads `put` requests into while the scheduler runs; cancelled sequences are skipped."""

    def __init__(self, seqs: Sequence[SeqState] = ()):
        self._queue = deque(seqs)
        self._lock = threading.Lock()

    def put(self, seq: SeqState) -> None:
        with self._lock:
            self._queue.append(seq)

    def take(self, count: int) -> list[SeqState]:
        """Up to `count` waiting sequences, first come first served (cancelled ones are dropped, finished)."""
        out, dropped = [], []
        with self._lock:
            while self._queue and len(out) < count:
                s = self._queue.popleft()
                (dropped if s.cancelled else out).append(s)
        for s in dropped:
            s.finished, s.finish_reason = True, "cancelled"
            self.dropped(s)
        return out

    def remove(self, seq: SeqState) -> bool:
        """Take `seq` out of the queue; False if it is not waiting (it runs, or ran)."""
        with self._lock:
            try:
                self._queue.remove(seq)
            except ValueError:
                return False
        return True

    def dropped(self, seq: SeqState) -> None:
        """A cancelled sequence left the queue without running (Server finishes its request here)."""

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)


class Scheduler:
    def __init__(self, target: Runner, drafter: Drafter | None, verifier: Verifier, eos_id: int | None, bucket: int = 128,
                 padded: bool = False):
        self.target = target
        self.padded = padded
        self.drafter = drafter
        self.verifier = verifier
        self.eos_id = eos_id
        self.bucket = bucket

    def close(self) -> None:
        """Give back the runners (the call is over)."""
        self.target.close()
        if self.drafter is not None:
            self.drafter.close()

    def run(self, seqs: "list[SeqState] | Waiting", params: SamplingParams, rng: np.random.Generator,
            max_batch: int | None = None, started: float | None = None,
            on_round: Callable[[int], None] | None = None) -> Iterator[tuple[SeqState, list[int]]]:
        """Decode the sequences, at most `max_batch` at once (default: all of a list): whenever the batch has
        room, the next waiting ones take their places at once (continuous batching: prefilled and admitted
        between rounds). `seqs`: a list, or a Waiting that requests arrive in while this runs (Server); the run
        ends when no sequence is live and none waits. Yields (sequence, tokens appended this round) as they come;
        a sequence whose `cancelled` is set leaves the batch at the end of the round with finish_reason
        "cancelled". `started`: when the caller's request began (time.perf_counter(); default now), what each
        sequence's `seconds.first` and `seconds.finished` count from, unless the sequence has its own `started`.
        `on_round(n)`: called after each decode round with the number of sequences it held."""
        t_start = time.perf_counter()
        started = t_start if started is None else started
        waiting = seqs if isinstance(seqs, Waiting) else Waiting(seqs)
        max_batch = max_batch or waiting.pending()
        live = waiting.take(max_batch)
        if not live:
            return
        ran = list(live)
        cache = self.target.new_cache(len(live), self.bucket)
        cache.compute_holes = self.padded
        hidden = self._hidden_reader()
        t0 = time.perf_counter()
        steps = prefill(self.target, cache, [s.tokens[:-1] for s in live], on_hidden=hidden)
        if self.drafter is not None:
            self.drafter.start(live)
        self._prefilled(live, steps, t0)
        # what of the target's logits crosses to the host each round: what the verifier reads (each row's argmax for
        # greedy verification: on a GPU the logits stay there)
        head = self.verifier.head
        while live:
            t_round = time.perf_counter()
            if self.padded:
                for s, n in zip(live, cache.pad_to(int(cache.lengths.max()))):
                    s.stats.padded += int(n)
            # each sequence draws from its own generator where it has one: its tokens then do not depend on the batch
            rngs = rng if all(s.rng is None for s in live) else [rng if s.rng is None else s.rng for s in live]
            trees, times = self._draft(live, params, rngs)
            verdicts = self._verify(live, cache, trees, params, rngs, head, times)
            positions = [len(s.new_tokens) for s in live]
            appended = self._accept(live, trees, verdicts, started)
            times.total = time.perf_counter() - t_round
            if on_round is not None:
                on_round(len(live))
            for s, t, v, position in zip(live, trees, verdicts, positions):
                s.stats.add_round(len(t), len(v.path), position, times)
            for s, out in zip(live, appended):
                yield s, out
            keep = compaction([s.finished for s in live])
            if len(keep) < len(live):
                live = [live[b] for b in keep]
                cache.keep(keep)
                if self.drafter is not None:
                    self.drafter.keep(keep)
            new = waiting.take(max_batch - len(live)) if len(live) < max_batch else []
            if new:
                t0 = time.perf_counter()
                steps = admit(self.target, cache, [s.tokens[:-1] for s in new], on_hidden=hidden)
                if self.drafter is not None:
                    self.drafter.admit(new)
                self._prefilled(new, steps, t0)
                live += new
                ran += new
        for s in ran:
            s.stats.seconds.total = time.perf_counter() - t_start

    def _hidden_reader(self):
        """The drafter's target_hidden where it reads the target's hidden states (a draft head), else None; refused
        where the target's steps do not give them."""
        if self.drafter is None or not self.drafter.reads_target_hidden:
            return None
        if not self.target.gives_hidden:
            raise InvalidRequestError(f"this draft head reads the target's hidden states: the target's step on the "
                                      f"{self.target.backend.name} backend does not give them (export the bundle with "
                                      "the head as its draft; run it on the ort or torch backend)")
        return self.drafter.target_hidden

    def _draft(self, live: list[SeqState], params: SamplingParams, rngs) -> tuple[list[DraftTree], RoundTimes]:
        """Each live sequence's draft tree for this round, and what drafting cost."""
        if self.drafter is None:
            return [DraftTree.empty()] * len(live), RoundTimes()
        trees = self.drafter.propose(live, params, rngs)
        d = self.drafter
        return trees, RoundTimes(draft=d.seconds, draft_model=d.backend_seconds, draft_calls=d.num_calls)

    def _verify(self, live: list[SeqState], cache, trees: list[DraftTree], params: SamplingParams, rngs, head,
                times: RoundTimes) -> list[Verdict]:
        """One target step over every sequence's last token and tree (ragged, no padding), each tree verified, the
        accepted rows' K/V committed to the cache (and the drafter told)."""
        rows = [np.concatenate(([s.tokens[-1]], t.tokens)) for s, t in zip(live, trees)]
        cache.reserve(int(max(cache.lengths + np.asarray([len(r) for r in rows]))))
        start = cache.positions()
        positions = [start[b] + t.depths() for b, t in enumerate(trees)]
        blocks = [None if t.is_chain else t.mask() for t in trees]
        ids, pos, mask = pack_step(cache, rows, positions, blocks)
        t1 = time.perf_counter()
        logits, new_kv = self.target.step(ids, pos, mask, cache, head)
        times.target = time.perf_counter() - t1
        verdicts = [self.verifier.verify(t, logits[b, : len(t) + 1], params, rng_of(rngs, b))
                    for b, t in enumerate(trees)]
        if all(t.is_chain for t in trees):  # accepted rows are a prefix: one slice copy each
            cache.append(new_kv, [len(v.path) + 1 for v in verdicts])
        else:
            for b, v in enumerate(verdicts):
                cache.append_rows(new_kv, b, [0] + [n + 1 for n in v.path])
        if self.drafter is not None:
            if self.drafter.reads_target_logits:  # a drafter that reads them takes them where they lie
                self.drafter.target_logits(self.target.last_logits)
            if self.drafter.reads_target_hidden:  # the rows committed: the root's and the accepted path's
                self.drafter.target_hidden(self.target.last_hidden, [np.asarray([0] + [n + 1 for n in v.path])
                                                                     for v in verdicts])
            self.drafter.commit(live, verdicts)
        return verdicts

    def _accept(self, live: list[SeqState], trees: list[DraftTree], verdicts: list[Verdict],
                started: float) -> list[list[int]]:
        """Each sequence's accepted path and bonus token appended (up to its end token or limit); the tokens each
        got, its first and finishing times noted."""
        appended = []
        for s, t, v in zip(live, trees, verdicts):
            out = s.extend([int(x) for x in t.tokens[v.path]] + [v.bonus], self.eos_id)
            appended.append(out)
            if s.cancelled and not s.finished:
                s.finished, s.finish_reason = True, "cancelled"
            since = started if s.started is None else s.started
            if out and len(out) == len(s.new_tokens):  # its first tokens
                s.stats.seconds.first = time.perf_counter() - since
            if s.finished:
                s.stats.seconds.finished = time.perf_counter() - since
        return appended

    def _prefilled(self, new: list[SeqState], steps: int, t0: float) -> None:
        """Count the prefill of sequences that joined the batch (target steps, draft steps, seconds)."""
        draft_calls = self.drafter.num_calls if self.drafter is not None else 0
        for s in new:
            s.stats.target_calls += steps
            s.stats.draft_calls += draft_calls
            s.stats.prefill_draft_calls += draft_calls
            s.stats.seconds.prefill += time.perf_counter() - t0
