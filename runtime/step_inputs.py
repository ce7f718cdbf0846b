"""Pack per-sequence rows into one batched step (specrt.contract) without padding the KV cache.

Each sequence b brings its own rows: tokens, positions and a [n_b, n_b] mask over its new tokens
(None = causal). T = max n_b; rows past n_b are holes (token 0, position 0, seeing only themselves):
they produce finite garbage that nobody reads and nobody commits. Past slots visible to sequence b
are [0, cache.lengths[b]), unless `scratch[b] = (anchor, vis)` says that slots [anchor, lengths[b])
hold scratch rows (draft tree nodes) of which row t sees only those with vis[t] True.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.runtime.kv_cache import KVCache


def feed_rows(runner, cache: KVCache, rows: Sequence[np.ndarray]) -> np.ndarray:
    """Feed each sequence's rows causally after its cached prefix and append all their K/V.

    Used for prefill and for draft-model steps; returns logits [B, T, V] (valid until the runner's
    next step).
    """
    counts = [len(r) for r in rows]
    cache.reserve(int(max(cache.lengths + np.asarray(counts))))
    positions = [cache.lengths[b] + np.arange(n) for b, n in enumerate(counts)]
    ids, pos, mask = pack_step(cache, rows, positions)
    logits, new_kv = runner.step(ids, pos, mask, cache)
    cache.append(new_kv, counts)
    return logits


def pack_step(cache: KVCache, tokens: Sequence[np.ndarray], positions: Sequence[np.ndarray],
              blocks: Sequence[np.ndarray | None] | None = None,
              scratch: Sequence[tuple[int, np.ndarray] | None] | None = None):
    """Returns input_ids [B, T], position_ids [B, T], attention_mask [B, T, S + T] (S = cache.capacity)."""
    batch = len(tokens)
    counts = [len(t) for t in tokens]
    num_tokens = max(counts)
    capacity = cache.capacity
    mask = np.empty((batch, num_tokens, capacity + num_tokens), dtype=bool)
    # past: one vectorised comparison, no per-slot Python work
    np.less(cache.slot_index[None, None, :], cache.lengths[:, None, None], out=mask[:, :, :capacity])
    causal = _tri(num_tokens)
    if scratch is not None:
        for b, sc in enumerate(scratch):
            if sc is not None:
                anchor, vis = sc  # vis: [n_b, lengths[b] - anchor]
                mask[b, : len(vis), anchor:anchor + vis.shape[1]] = vis
    if min(counts) == num_tokens and (blocks is None or all(b is None for b in blocks)):  # no holes, all causal
        mask[:, :, capacity:] = causal
        return np.stack(tokens).astype(np.int64, copy=False), np.stack(positions).astype(np.int64, copy=False), mask
    ids = np.zeros((batch, num_tokens), dtype=np.int64)
    pos = np.zeros((batch, num_tokens), dtype=np.int64)
    mask[:, :, capacity:] = False
    for b in range(batch):
        n = counts[b]
        ids[b, :n] = tokens[b]
        pos[b, :n] = positions[b]
        block = blocks[b] if blocks is not None and blocks[b] is not None else causal[:n, :n]
        mask[b, :n, capacity:capacity + n] = block
        if n < num_tokens:
            mask[b, n:, :capacity] = False
            idx = np.arange(n, num_tokens)
            mask[b, idx, capacity + idx] = True
    return ids, pos, mask


_TRI: dict[int, np.ndarray] = {}


def _tri(n: int) -> np.ndarray:
    """Lower-triangular [n, n] bool (read-only, cached)."""
    t = _TRI.get(n)
    if t is None:
        t = _TRI[n] = np.tri(n, dtype=bool)
        t.flags.writeable = False
    return t
