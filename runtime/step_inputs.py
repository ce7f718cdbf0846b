"""Pack per-sequence rows into one batched step (specrt.contract) without padding the KV cache.

Each sequence b brings its own rows: tokens, positions and a [n_b, n_b] mask over its new tokens
(None = causal). T = max n_b; rows past n_b are holes (token 0, position 0, seeing only themselves):
they produce finite garbage that nobody reads and nobody commits. Past slots visible to sequence b
are exactly [0, cache.lengths[b]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.runtime.kv_cache import KVCache


def pack_step(cache: KVCache, tokens: Sequence[np.ndarray], positions: Sequence[np.ndarray],
              blocks: Sequence[np.ndarray | None] | None = None):
    """Returns input_ids [B, T], position_ids [B, T], attention_mask [B, T, S + T] (S = cache.capacity)."""
    batch = len(tokens)
    num_tokens = max(len(t) for t in tokens)
    capacity = cache.capacity
    ids = np.zeros((batch, num_tokens), dtype=np.int64)
    pos = np.zeros((batch, num_tokens), dtype=np.int64)
    mask = np.zeros((batch, num_tokens, capacity + num_tokens), dtype=bool)
    # past: one vectorised comparison, no per-slot Python work
    mask[:, :, :capacity] = np.arange(capacity)[None, None, :] < cache.lengths[:, None, None]
    causal = np.tri(num_tokens, dtype=bool)
    for b in range(batch):
        n = len(tokens[b])
        ids[b, :n] = tokens[b]
        pos[b, :n] = positions[b]
        block = blocks[b] if blocks is not None and blocks[b] is not None else causal[:n, :n]
        mask[b, :n, capacity:capacity + n] = block
        if n < num_tokens:
            mask[b, n:, :capacity] = False
            idx = np.arange(n, num_tokens)
            mask[b, idx, capacity + idx] = True
    return ids, pos, mask
