"""Pack per-sequence rows into one batched step (specrt.contract) without padding the KV cache.

Each sequence b brings its own rows: tokens, positions and a [n_b, n_b] mask over its new tokens
(None = causal). T = max n_b; rows past n_b are holes (token 0 at contract.HOLE_POSITION, seeing only
themselves): nobody reads or commits them, and a backend that packs rows (Backend.packs_rows) leaves them out
of its token-wise work. A padded batch's holes (KVCache.compute_holes) sit at position 0 instead and are
computed. Past slots visible to sequence b are [0, cache.lengths[b]) (less the padding slots of a padded
cache: KVCache.pad_to), unless `scratch[b] = (anchor, vis)` says that slots [anchor, lengths[b])
hold scratch rows (draft tree nodes) of which row t sees only those with vis[t] True. With a sliding
window W (cache.window), a row at position p sees only past slots s with p - s < W (slot s holds
position s; scratch rows sit at the end, well inside any window) and new tokens at positions q with
p - q < W.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.contract import HOLE_POSITION
from specrt.runtime.kv_cache import KVCache

# Prompt tokens per sequence per prefill step: bounded step shapes keep backend memory flat whatever the
# prompt lengths (specrt bench soak).
PREFILL_CHUNK = 256


def feed_rows(runner, cache: KVCache, rows: Sequence[np.ndarray], head="logits", last: bool = False,
              features: Sequence[np.ndarray] | None = None, on_hidden=None):
    """Feed each sequence's rows causally after its cached prefix and append all their K/V.

    Used for prefill and for draft-model steps; returns logits [B, T, V] (valid until the runner's
    next step), or what `head` keeps of them (Runner.step); `last`: of each sequence's last row only ([B, V]).
    `features`: a draft head's, one [n_b, H] array per sequence (pack_features); `on_hidden(hidden, rows)`: called
    after the step with its hidden states (Runner.last_hidden) and each sequence's rows, where the runner gives them.
    """
    counts = [len(r) for r in rows]
    cache.reserve(int(max(cache.lengths + np.asarray(counts))))
    start = cache.positions()
    positions = [start[b] + np.arange(n) for b, n in enumerate(counts)]
    ids, pos, mask = pack_step(cache, rows, positions)
    fed = {} if features is None else {"features": pack_features(features, ids.shape[1])}
    logits, new_kv = runner.step(ids, pos, mask, cache, head, [n - 1 for n in counts] if last else None, **fed)
    cache.append(new_kv, counts)
    if on_hidden is not None and runner.last_hidden is not None:
        on_hidden(runner.last_hidden, [np.arange(n) for n in counts])
    return logits


def pack_features(features: Sequence[np.ndarray], num_tokens: int) -> np.ndarray:
    """[B, num_tokens, H] float32 of one [n_b, H] array per sequence (n_b <= num_tokens), zeros in the holes; of one
    tensor per sequence (a head's own hidden outputs on a torch backend), a tensor where they lie."""
    width = max(f.shape[-1] for f in features)
    out = np.zeros((len(features), num_tokens, width), np.float32) if isinstance(features[0], np.ndarray) else \
        features[0].new_zeros((len(features), num_tokens, width))
    for b, f in enumerate(features):
        out[b, :len(f)] = f
    return out


def prefill(runner, cache: KVCache, rows: Sequence[np.ndarray], chunk: int | None = None, features=None,
            on_hidden=None) -> int:
    """Feed each sequence's rows after its cached prefix, `chunk` tokens per sequence per step (default
    PREFILL_CHUNK, or the runner's max_step_tokens if smaller; 0: all in one step), appending their K/V;
    logits are not kept. Returns the number of steps. `features` (a draft head's: one [len(rows[b]), H] array per
    sequence) and `on_hidden(hidden, rows)`, where the runner gives hidden states: as feed_rows, chunk by chunk (the
    rows of each chunk counted from the chunk's first).

    Chunks bound a step's shape whatever the prompt length, so the backend's working memory is bounded
    too (an ONNX Runtime arena sized by a 1900-token prefill stays that size)."""
    longest = max(len(r) for r in rows)
    if not longest:
        return 0
    size = (PREFILL_CHUNK if chunk is None else chunk) or longest
    size = min(size, getattr(runner, "max_step_tokens", None) or size)
    for start in range(0, longest, size):
        fed = None if features is None else [f[start:start + size] for f in features]
        feed_rows(runner, cache, [r[start:start + size] for r in rows], "discard", features=fed,  # no logits to host
                  on_hidden=on_hidden)
    return -(-longest // size)


def admit(runner, cache: KVCache, rows: Sequence[np.ndarray], features=None, on_hidden=None) -> int:
    """Add one sequence per entry of `rows` after the cache's sequences, their rows prefilled (continuous
    batching); returns the prefill steps. The running sequences are not stepped: a dynamic cache prefills the
    new ones in a cache of their own, then takes it over; a static one (fixed addresses) prefills each alone in
    its engine's admission cache (Runner.admission_cache: a store of its own whose slots are then copied in, or
    the batch store's next free row). An engine without one prefills them in place, the running sequences
    stepped as empty rows (a step as wide as the whole batch). `features`, `on_hidden`: as prefill's, for the new
    sequences (on_hidden takes `first=` too: the batch row of the step's first sequence)."""
    if cache.is_static and not runner.backend.admits_alone:
        old = cache.batch
        cache.add_rows(len(rows))
        fed = None if features is None else [np.zeros((0, features[0].shape[-1]), np.float32)] * old + list(features)
        return prefill(runner, cache, [np.zeros(0, np.int64)] * old + list(rows), features=fed,
                       on_hidden=on_hidden and (lambda hidden, at: on_hidden(hidden, at, first=0)))
    steps, first = 0, cache.batch
    groups = [[b] for b in range(len(rows))] if cache.is_static else [list(range(len(rows)))]  # admission: one each
    for group in groups:
        fresh = runner.admission_cache(cache) if cache.is_static else runner.new_cache(len(group), cache.bucket)
        fresh.compute_holes = cache.compute_holes
        tap = on_hidden and (lambda hidden, at, f=first + group[0]: on_hidden(hidden, at, first=f))
        steps += prefill(runner, fresh, [rows[b] for b in group], features=features and [features[b] for b in group],
                         on_hidden=tap)
        cache.extend(fresh)
    return steps


def sequence_logits(runner, tokens: np.ndarray) -> np.ndarray:
    """Next-token logits [T, V] after every prefix of one sequence (teacher forcing), in steps a backend takes
    (at most its max_step_tokens each)."""
    cache = runner.new_cache(1)
    size = runner.max_step_tokens or len(tokens)
    return np.concatenate([feed_rows(runner, cache, [tokens[i:i + size]])[0].copy()
                           for i in range(0, len(tokens), size)])


def pack_step(cache: KVCache, tokens: Sequence[np.ndarray], positions: Sequence[np.ndarray],
              blocks: Sequence[np.ndarray | None] | None = None,
              scratch: Sequence[tuple[int, np.ndarray] | None] | None = None):
    """Returns input_ids [B, T], position_ids [B, T], attention_mask [B, T, S + T] (S = cache.capacity).

    `tokens` may also be one [B, n] array of a "device-argmax" head's tokens (Runner.step: n rows for every sequence,
    where the logits lie): it is input_ids as it stands, the host building only positions and the mask."""
    device_ids = None
    if not isinstance(tokens, (list, tuple, np.ndarray)):
        device_ids, tokens = tokens, [np.zeros(tokens.shape[1], np.int64)] * tokens.shape[0]
    batch = len(tokens)
    counts = [len(t) for t in tokens]
    num_tokens = max(counts)
    capacity = cache.capacity
    mask = np.empty((batch, num_tokens, capacity + num_tokens), dtype=bool)
    # past: one vectorised comparison, no per-slot Python work
    np.less(cache.slot_index[None, None, :], cache.lengths[:, None, None], out=mask[:, :, :capacity])
    if cache.valid is not None:  # a padded batch: its padding slots are seen by nobody
        mask[:, :, :capacity] &= cache.valid[:, None, :]
    causal = _tri(num_tokens)
    if scratch is not None:
        for b, sc in enumerate(scratch):
            if sc is not None:
                anchor, vis = sc  # vis: [n_b, lengths[b] - anchor]
                mask[b, : len(vis), anchor:anchor + vis.shape[1]] = vis
    if min(counts) == num_tokens and (blocks is None or all(b is None for b in blocks)):  # no holes, all causal
        mask[:, :, capacity:] = causal
        pos = np.stack(positions).astype(np.int64, copy=False)
        ids = np.stack(tokens).astype(np.int64, copy=False) if device_ids is None else device_ids
        return ids, pos, _windowed(mask, pos, cache)
    ids = np.zeros((batch, num_tokens), dtype=np.int64)
    pos = np.full((batch, num_tokens), 0 if cache.compute_holes else HOLE_POSITION, dtype=np.int64)
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
    return (ids if device_ids is None else device_ids), pos, _windowed(mask, pos, cache)


def _windowed(mask: np.ndarray, pos: np.ndarray, cache: KVCache) -> np.ndarray:
    """Hide past slots and new tokens outside the sliding window, in place (no-op without one)."""
    if cache.window is not None:
        oldest = pos[:, :, None] - cache.window  # [B, T, 1] a row sees positions above this
        mask[:, :, :cache.capacity] &= cache.slot_index[None, None, :] > oldest
        mask[:, :, cache.capacity:] &= pos[:, None, :] > oldest
    return mask


_TRI_CACHED = 256  # decode-step sizes are cached; prefill sizes (any prompt length) are not: memory stays flat
_TRI = np.tri(_TRI_CACHED, dtype=bool)
_TRI.flags.writeable = False


def _tri(n: int) -> np.ndarray:
    """Lower-triangular [n, n] bool (read-only; a view of one cached array for n <= _TRI_CACHED)."""
    return _TRI[:n, :n] if n <= _TRI_CACHED else np.tri(n, dtype=bool)
