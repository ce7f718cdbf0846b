"""Speculative decoding of one sequence in one loop: the reference to read first, and the oracle the tests hold the
runtime to. Greedy, a draft model proposing a chain of k tokens, the target verifying them in one step:

    draft   the draft reads what it has not read yet and guesses k tokens, one step each (its own guesses fed back)
    verify  the target reads the last committed token and the k guesses in one step: its argmax after each
    accept  the guesses up to the first that differs from the target's argmax there, then the target's own token
            (the correction, or the bonus after k accepted); both caches keep only the accepted rows (a length)

The Scheduler does the same for a ragged batch, trees instead of chains, any Drafter and Verifier and every backend
(runtime/scheduler.py); its tokens for method "sd" at temperature 0 are these."""

from __future__ import annotations

import numpy as np

from specrt.runtime.backends import Backend
from specrt.runtime.step_inputs import feed_rows, prefill


def reference_sd(target: Backend, draft: Backend, prompt: list[int], max_new_tokens: int, k: int = 4,
                 eos_id: int | None = None) -> list[int]:
    """The new tokens of greedy draft-model speculative decoding: those of greedy autoregressive decoding."""
    t, d = target.runner(), draft.runner()
    t_cache, d_cache = t.new_cache(1), d.new_cache(1)
    text = list(prompt)  # committed tokens; both caches hold K/V of at most text[:-1]
    prefill(t, t_cache, [np.array(text[:-1], np.int64)])
    new: list[int] = []
    while len(new) < max_new_tokens and (eos_id is None or eos_id not in new):
        unread, guesses = text[int(d_cache.lengths[0]):], []
        for _ in range(k):  # draft
            guesses.append(int(feed_rows(d, d_cache, [np.array(unread, np.int64)], "argmax", last=True)[0]))
            unread = guesses[-1:]
        top = feed_rows(t, t_cache, [np.array([text[-1], *guesses], np.int64)], "argmax")[0]  # verify
        n = next((i for i, g in enumerate(guesses) if g != top[i]), k)  # accept
        text += guesses[:n] + [int(top[n])]
        new += guesses[:n] + [int(top[n])]
        t_cache.truncate(0, len(text) - 1)
        d_cache.truncate(0, min(int(d_cache.lengths[0]), len(text) - 1))
    new = new[:max_new_tokens]
    return new[:new.index(eos_id) + 1] if eos_id in new else new
