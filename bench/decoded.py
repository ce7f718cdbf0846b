"""What one pass of an e2e row returns, and its two latencies measured the same way for every runtime.

A row's runner decodes every prompt once and returns Decoded: the new token ids, the target calls, the rows they
verified and the seconds by stage where the runtime says them (ours), and for each prompt two wall times taken
around the runtime, not inside it: from the prompt's start to its first new token (the time to first token: prefill
and the first round), and from then to its last. The time per output token (TPOT) is the second summed over prompts
/ the tokens after each first: it compares the decode loops of runtimes whose prefill differs, and its inverse is a
row's decode rate.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple


# Where a pass of ours spends its wall time, one partition: the prompts' prefill (target and draft), the target's
# decode steps, the draft model's steps, the rest of each round (drafting's host work, verification, cache
# bookkeeping), and what lies outside the rounds (tokenizing, setting up, detokenizing).
STAGES = ("prefill", "target", "draft_model", "host")


def stage_seconds(outputs) -> dict[str, float]:
    """The STAGES' seconds of a pass, summed over its outputs' stats (one prompt at a time: they add up)."""
    return {k: sum(getattr(o.stats.seconds, k) for o in outputs) for k in STAGES}


class Decoded(NamedTuple):
    outputs: list[list[int]]  # new token ids per prompt
    target_calls: int = 0  # target decode steps, prefill excluded (ours only)
    stage_seconds: dict[str, float] | None = None  # summed over prompts, keys STAGES (ours only)
    first_s: tuple[float, ...] = ()  # per prompt: seconds from its start to its first new token
    decode_s: tuple[float, ...] = ()  # per prompt: seconds from its first new token to its last
    rows: int = 0  # token rows the target's decode steps verified (drafts + 1 per step; ours only)


def joined(parts: "list[Decoded]") -> "Decoded":
    """The Decoded of one pass over several prompts from the Decoded of each (in prompt order)."""
    stages = [d.stage_seconds for d in parts]
    return Decoded([o for d in parts for o in d.outputs], sum(d.target_calls for d in parts),
                   {k: sum(s[k] for s in stages) for k in STAGES} if all(stages) else None,
                   tuple(t for d in parts for t in d.first_s), tuple(t for d in parts for t in d.decode_s),
                   sum(d.rows for d in parts))


class PromptClock:
    """Times one prompt: made when the prompt starts; `token()` at each new token (only the first counts)."""

    def __init__(self):
        self.start, self.first = time.perf_counter(), None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def done(self) -> tuple[float, float]:
        """(seconds to the first new token, seconds from it to now); a prompt without new tokens: (all, 0)."""
        end = time.perf_counter()
        first = end if self.first is None else self.first
        return first - self.start, end - first


def timed(prompts, decode_one) -> tuple[list[list[int]], tuple[float, ...], tuple[float, ...]]:
    """(outputs, first_s, decode_s) of `decode_one(prompt, clock) -> new token ids` over the prompts, one clock each."""
    outs, firsts, decodes = [], [], []
    for p in prompts:
        clock = PromptClock()
        outs.append(decode_one(p, clock))
        first, rest = clock.done()
        firsts.append(first)
        decodes.append(rest)
    return outs, tuple(firsts), tuple(decodes)


def latencies(d: Decoded) -> tuple[float | None, float | None]:
    """(median time to first token over prompts, time per output token), in ms; None where not measured."""
    if not d.first_s:
        return None, None
    after_first = sum(max(0, len(o) - 1) for o in d.outputs)
    tpot = 1e3 * sum(d.decode_s) / after_first if after_first else None
    return 1e3 * statistics.median(d.first_s), tpot
