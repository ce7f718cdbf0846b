"""A draft head's ranks along a text, depth by depth (EAGLE; calibration of a bundle whose draft is a head).

A draft model fed the true tokens guesses the same at depth d of a round as teacher-forced at that position, so one
teacher-forced step over a text gives every depth's ranks (acceptance.draft_ranks). A head does not: below the first
depth it reads its own guess of the hidden state, not the target's. Its guesses along an accepted path are those of
a chain fed the true tokens beside its own hidden outputs, and every chain of a text is computed depth by depth, each
depth one step over every start at once (the all-at-once "training-time test" of EAGLE-3, here through the step
contract's general mask):

    depth 1   the head's entries q = 0 .. N - 2 (token x_{q+1} beside the target's hidden state n_q), each seeing
              the entries before it: the head's cache of the text; entry q guesses x_{q+2} and gives g1_q
    depth d   one scratch row per start q: token x_{q+d} beside g(d-1)_q at position q + d - 1, seeing the text's
              entries <= q and its own chain's rows of depths 2 .. d - 1; it guesses x_{q+d+1} and gives gd_q

`chain_ranks` returns ranks [D, T]: ranks[d, s] is the rank of output token s + d (s = 0: the first one after the
prompt) among depth d + 1's guesses of the chain whose first guess is output token s, or a rank past any table
(HEAD_MISS) where the text ends first. acceptance.depth_rank_table reads it as it reads a draft model's ranks.
"""

from __future__ import annotations

import numpy as np

HEAD_MISS = np.iinfo(np.int32).max  # a chain that runs past the text: no guess there to rank


def _ranks(logits: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Rank of true[i] among logits[i] (0: the argmax)."""
    chosen = logits[np.arange(len(true)), true]
    return (logits > chosen[:, None]).sum(axis=-1)


def target_hidden(target, tokens: np.ndarray) -> np.ndarray:
    """The target's last hidden states [N, H] of `tokens` (teacher-forced, in its step sizes)."""
    from specrt.runtime.drafters.eagle import host_rows
    from specrt.runtime.step_inputs import prefill

    rows = []
    prefill(target, target.new_cache(1), [tokens],
            on_hidden=lambda hidden, at, first=0: rows.extend(host_rows(hidden, at)))
    return np.concatenate(rows)


def chain_ranks(target, head, tokens: list[int], first: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(ranks [max_depth, len(tokens) - first] (module docstring), the depth-1 logits of every output token [T, V]:
    teacher-forced, as acceptance.draft_ranks' are). `target`, `head`: runners of the bundle's target and head."""
    from specrt.runtime.drafters.eagle import host_rows
    from specrt.runtime.step_inputs import feed_rows

    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    entries = n - 1  # entry q: x_{q+1} beside n_q
    hidden = target_hidden(target, tokens[:-1])  # [N - 1, H]
    cache = head.new_cache(1)
    size = head.max_step_tokens or entries
    logits, outs = [], []
    for i in range(0, entries, size):
        rows = feed_rows(head, cache, [tokens[i + 1:i + 1 + size]], features=[hidden[i:i + size]])
        logits.append(np.array(rows[0], np.float32))
        outs += host_rows(head.last_hidden, [np.arange(min(size, entries - i))])
    logits, last = np.concatenate(logits), np.concatenate(outs)  # [N - 1, V], [N - 1, H]
    out = n - first
    ranks = np.full((max_depth, out), HEAD_MISS, dtype=np.int64)
    starts = np.arange(first - 2, n - 2)  # the entry whose depth-1 guess is output token s, for every s
    valid = starts >= 0
    ranks[0, valid] = _ranks(logits[starts[valid]], tokens[starts[valid] + 2])
    for d in range(2, max_depth + 1):  # a row per start q, token x_{q+d} beside its chain's last output
        guesses, outs = [], []
        for i in range(0, entries, size):  # in steps the backend takes; the chunks' rows land in order, so start q's
            q = np.arange(i, min(i + size, entries))  # depth-k row sits at slot entries * (k - 1) + q
            cache.reserve(int(cache.lengths[0]) + len(q))
            mask = np.zeros((1, len(q), cache.capacity + len(q)), dtype=bool)
            mask[0, :, :entries] = np.arange(entries)[None, :] <= q[:, None]  # the text's entries <= q ...
            for k in range(d - 2):  # ... its chain's rows of depths 2 .. d - 1 ...
                mask[0, np.arange(len(q)), entries * (k + 1) + q] = True
            mask[0, np.arange(len(q)), cache.capacity + np.arange(len(q))] = True  # ... and itself
            ids = np.where(q + d < n, tokens[np.minimum(q + d, n - 1)], 0)[None]
            step, new_kv = head.step(ids, (q + d - 1)[None], mask, cache, features=last[q][None])
            cache.append(new_kv, [len(q)])
            guesses.append(np.array(step[0], np.float32))
            outs += host_rows(head.last_hidden, [np.arange(len(q))])
        step, last = np.concatenate(guesses), np.concatenate(outs)
        keep = valid & (starts + d + 1 < n)  # row q guesses x_{q+d+1}: output token s + d - 1 of the chain from s
        ranks[d - 1, keep] = _ranks(step[starts[keep]], tokens[starts[keep] + d + 1])
    return ranks, logits[starts[valid]]
