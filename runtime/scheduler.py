"""Scheduler: the one decode loop. Every method is a Drafter + Verifier pair run by it.

Per round, for the live sequences of a batch: the drafter proposes one DraftTree each; one target step
scores root + nodes of every tree (ragged rows, no KV padding); the verifier picks each sequence's
accepted path and bonus token; the target cache appends only the root and the accepted path
(compacted), the drafter commits its own state; emitted tokens are appended, truncated at EOS and at
max_new_tokens. Finished sequences leave the batch independently, and with more sequences waiting than
`max_batch`, the next ones take their places between rounds (continuous batching): each is prefilled on
its own and joins the running batch, which no sequence waits out.

Invariant between rounds: the target cache holds K/V for seq.tokens[:-1]; the last token is the root.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from specrt.runtime.backends import Runner
from specrt.runtime.drafters import Drafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stats import Stats
from specrt.runtime.step_inputs import admit, pack_step, prefill
from specrt.runtime.tree import DraftTree


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
        self.finish_reason = None  # "eos" or "length"

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


class Scheduler:
    def __init__(self, target: Runner, drafter: Drafter | None, verifier, eos_id: int | None, bucket: int = 128):
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        self.eos_id = eos_id
        self.bucket = bucket

    def close(self) -> None:
        """Give back the runners (the call is over)."""
        self.target.close()
        if self.drafter is not None:
            self.drafter.close()

    def run(self, seqs: list[SeqState], params: SamplingParams, rng: np.random.Generator,
            max_batch: int | None = None, started: float | None = None) -> Iterator[tuple[SeqState, list[int]]]:
        """Decode the sequences, at most `max_batch` at once (default: all): whenever sequences finish, the next
        waiting ones take their places at once (continuous batching: prefilled and admitted between rounds).
        Yields (sequence, tokens appended this round) as they come. `started`: when the caller's request began
        (time.perf_counter(); default now), what each sequence's `seconds.finished` counts from."""
        t_start = time.perf_counter()
        started = t_start if started is None else started
        waiting = deque(seqs)
        live = [waiting.popleft() for _ in range(min(max_batch or len(seqs), len(seqs)))]
        max_batch = len(live)
        cache = self.target.new_cache(len(live), self.bucket)
        t0 = time.perf_counter()
        steps = prefill(self.target, cache, [s.tokens[:-1] for s in live])
        if self.drafter is not None:
            self.drafter.start(live)
        self._prefilled(live, steps, t0)
        while live:
            t_round = time.perf_counter()
            if self.drafter is not None:
                trees = self.drafter.propose(live, params, rng)
                t_draft, draft_calls = self.drafter.seconds, self.drafter.num_calls
                t_draft_model = self.drafter.backend_seconds
            else:
                trees, t_draft, draft_calls, t_draft_model = [DraftTree.empty()] * len(live), 0.0, 0, 0.0
            rows = [np.concatenate(([s.tokens[-1]], t.tokens)) for s, t in zip(live, trees)]
            cache.reserve(int(max(cache.lengths + np.asarray([len(r) for r in rows]))))
            positions = [cache.lengths[b] + t.depths() for b, t in enumerate(trees)]
            blocks = [None if t.is_chain else t.mask() for t in trees]
            ids, pos, mask = pack_step(cache, rows, positions, blocks)
            t1 = time.perf_counter()
            logits, new_kv = self.target.step(ids, pos, mask, cache)
            t_target = time.perf_counter() - t1
            verdicts = [self.verifier.verify(t, logits[b, : len(t) + 1], params, rng) for b, t in enumerate(trees)]
            if all(t.is_chain for t in trees):  # accepted rows are a prefix: one slice copy each
                cache.append(new_kv, [len(v.path) + 1 for v in verdicts])
            else:
                for b, v in enumerate(verdicts):
                    cache.append_rows(new_kv, b, [0] + [n + 1 for n in v.path])
            if self.drafter is not None:
                self.drafter.target_logits(logits)
                self.drafter.commit(live, verdicts)
            appended = []
            for s, t, v in zip(live, trees, verdicts):
                out = s.extend([int(x) for x in t.tokens[v.path]] + [v.bonus], self.eos_id)
                appended.append(out)
                if s.finished:
                    s.stats.seconds.finished = time.perf_counter() - started
            t_total = time.perf_counter() - t_round
            for s, t, v in zip(live, trees, verdicts):
                st = s.stats
                st.target_calls += 1
                st.drafted += len(t)
                st.drafted_hist[len(t)] += 1
                st.draft_calls += draft_calls
                st.accepted_hist[len(v.path)] += 1
                st.seconds.draft += t_draft
                st.seconds.target += t_target
                st.seconds.host += t_total - t_draft_model - t_target
            for s, out in zip(live, appended):
                yield s, out
            keep = [b for b, s in enumerate(live) if not s.finished]
            if len(keep) < len(live):
                live = [live[b] for b in keep]
                cache.keep(keep)
                if self.drafter is not None:
                    self.drafter.keep(keep)
                if waiting:
                    new = [waiting.popleft() for _ in range(min(max_batch - len(live), len(waiting)))]
                    t0 = time.perf_counter()
                    steps = admit(self.target, cache, [s.tokens[:-1] for s in new])
                    if self.drafter is not None:
                        self.drafter.admit(new)
                    self._prefilled(new, steps, t0)
                    live += new
        for s in seqs:
            s.stats.seconds.total = time.perf_counter() - t_start

    def _prefilled(self, new: list[SeqState], steps: int, t0: float) -> None:
        """Count the prefill of sequences that joined the batch (target steps, draft steps, seconds)."""
        draft_calls = self.drafter.num_calls if self.drafter is not None else 0
        for s in new:
            s.stats.target_calls += steps
            s.stats.draft_calls += draft_calls
            s.stats.prefill_draft_calls += draft_calls
            s.stats.seconds.prefill += time.perf_counter() - t0
