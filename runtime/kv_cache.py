"""KVCache: the runtime-owned K/V of one model for a batch of sequences.

One buffer [L, 2, B, Hkv, S, D] (S = capacity) holds every layer's keys (index 0) and values (index 1);
`layer_views(l)` are contiguous [B, Hkv, S, D] slices bound in place as past_key.{l} / past_value.{l}.

Invariants:
- Sequence b's K/V occupies slots [0, lengths[b]); slots >= lengths[b] are garbage and every step's
  attention mask hides them. Rolling back drafted rows is `truncate` (moving a length): free.
- Only rows a caller chooses are written (`append`, `append_rows`): rejected drafts never enter.
- Capacity grows in buckets (multiples of `bucket`, capped at `max_capacity`), never per token;
  a growth copies the committed prefix once. Per-step work is independent of context length.
- The sequences are the first B rows of a store [L, 2, R, Hkv, S, D] with R >= B rows: `buffer` is that view.
  Sequences leaving the batch are compacted to the front in place (`keep`: only rows that move are copied, so
  a finishing sequence costs one row's copy, not the batch's), and sequences joining take free rows (the
  store doubles its rows when full), so continuous batching never copies the whole cache per request.
- A static cache (`static=` a preallocated [L, 2, Bmax, Hkv, C, D] store; static-shape engines, whose
  CUDA graphs read fixed addresses) never reallocates: its capacity is C from the start.
- Slot i of a sequence holds position i (committed rows are appended in order and accepted paths are
  compacted), which is how a sliding `window` becomes part of each step's mask.
- A step whose graph updates the cache itself (kv_update "inplace") has already written its T new rows at
  slots lengths[b] .. lengths[b] + T - 1 (garbage slots until committed); it returns `CacheRows` instead of
  new K/V, and committing them moves only the accepted rows that are not already in place.
- Padding (`pad_to`; the vanilla batched speculative decoding EMS-SD measures itself against, for
  benchmarking only): sequences are padded with masked slots up to a common length. `valid` [B, S] then says
  which slots hold a token (None while nothing was padded), slot i no longer holds position i, and
  `positions()` (lengths minus pad slots) is where each sequence's next token sits. A padded cache refuses a
  sliding window (its masks assume slot i holds position i). Such a batch's steps also compute their holes
  (`compute_holes`: a real position instead of contract.HOLE_POSITION), as vanilla batched decoding computes the
  padding tokens of its inputs.
- The store is an array of the backend's kind (numpy for ONNX Runtime, torch for TorchBackend); this
  module only slices and assigns, which both support. A store the cache gives up (grown past, or the cache
  dropped) goes to `release` where the backend gives one (OrtBackend: a StorePool, which hands its memory to
  the next store instead of back to the operating system).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from specrt.errors import InvalidRequestError


class StorePool:
    """Host memory of KV stores that caches gave up, kept for the next ones. A cache grows in buckets and every
    batch (a static batch, an admitted request's prefill cache) starts a new one; memory freshly mapped from the
    operating system costs a page fault per page when it is first written, which made cache growth a real part
    of a batched run (ad hoc, the inflated pair at batch 8 on 2 cores: 0.7 s of a 12 s static `bench batch`
    run). Keeps at most `keep` buffers (the largest), so what it holds is bounded by what the largest caches
    held; `allocate` hands out the smallest that fits, zero-filled as a fresh one. Thread-safe, and safe to
    `release` into from a garbage collector's finalizer at any point, even inside `allocate` on the same thread
    (a release only appends to a queue that the next allocate or release sorts under the lock). numpy only."""

    MIN_BYTES = 1 << 20  # smaller stores are cheap to map: not pooled

    def __init__(self, dtype, keep: int = 3):
        self.dtype = np.dtype(dtype)
        self.keep = keep
        self._free: list[np.ndarray] = []  # 1-D, each the whole memory of a store given up; under _lock
        self._returned: deque[np.ndarray] = deque()  # released, not yet sorted into _free (appends are atomic)
        self._lock = threading.Lock()

    def allocate(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        flat = None
        if size * self.dtype.itemsize >= self.MIN_BYTES:
            with self._lock:
                self._sort_returned()
                for i, candidate in enumerate(self._free):  # smallest first
                    if candidate.size >= size:
                        flat = self._free.pop(i)
                        break
        if flat is None:
            return np.zeros(shape, dtype=self.dtype)
        out = flat[:size].reshape(shape)
        out[...] = 0
        return out

    def release(self, store: np.ndarray) -> None:
        """Take back a store (or any array this pool handed out); the caller no longer uses it."""
        owner = store if store.base is None else store.base
        if owner.dtype != self.dtype or owner.nbytes < self.MIN_BYTES or not owner.flags.c_contiguous:
            return
        self._returned.append(owner.reshape(-1))
        if self._lock.acquire(blocking=False):  # else whoever holds it sorts it in
            try:
                self._sort_returned()
            finally:
                self._lock.release()

    def _sort_returned(self) -> None:
        """(Under the lock.) Move released stores into _free, once each, and keep the largest `keep`."""
        while self._returned:
            flat = self._returned.popleft()
            if not any(np.shares_memory(flat, other) for other in self._free):  # released twice: kept once
                self._free.append(flat)
        self._free.sort(key=lambda flat: flat.size)
        del self._free[:-self.keep]

    @property
    def held_bytes(self) -> int:
        with self._lock:
            self._sort_returned()
            return sum(flat.nbytes for flat in self._free)


class CacheRows:
    """The new_kv of a step whose graph wrote the new tokens' K/V into `cache` itself: sequence b's T rows sit at
    slots starts[b] .. starts[b] + T - 1 (its length when the step ran). KVCache.append / append_rows of the same
    cache commit them where they lie."""

    def __init__(self, cache: "KVCache", starts: np.ndarray, num_tokens: int):
        self.cache, self.starts, self.num_tokens = cache, starts, num_tokens


class KVCache:
    def __init__(self, allocate: Callable[[tuple[int, ...]], object], num_layers: int, batch: int,
                 num_kv_heads: int, head_dim: int, max_capacity: int, bucket: int = 128, window: int | None = None,
                 static=None, release: Callable[[object], None] | None = None):
        self._allocate = allocate  # shape -> zero-initialised array of the backend's kind
        self._release = release  # takes back a store this cache gave up (a StorePool's), or None
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_capacity = max_capacity
        self.bucket = bucket
        self.window = window  # sliding attention window (positions), or None: steps mask slots beyond it
        self.lengths = np.zeros(batch, dtype=np.int64)  # [B] rows each sequence has in the cache
        self._static = static  # [L, 2, Bmax, Hkv, C, D] preallocated, or None
        if static is not None:
            if batch > static.shape[2]:
                raise InvalidRequestError(f"a batch of {batch} exceeds the static cache's {static.shape[2]} sequences")
            self.capacity = self.max_capacity = static.shape[4]
            self._store = static
        else:
            self.capacity = 0
            self._store = self._allocate((num_layers, 2, batch, num_kv_heads, 0, head_dim))  # [L, 2, R, Hkv, S, D]
        self._held = [self._store]  # the store the cache holds, given back when the cache is dropped
        if release is not None and static is None:
            weakref.finalize(self, lambda held: release(held[0]), self._held)
        self.buffer = self._store[:, :, :batch]  # [L, 2, B, Hkv, S, D]
        self.slot_index = np.arange(self.capacity)  # [S] 0..S-1, for building masks without per-step allocation
        self.valid = None  # [B, S] bool: which slots hold a token, once `pad_to` padded some (else None)
        self.pads = np.zeros(batch, dtype=np.int64)  # [B] padding slots of each sequence
        self.compute_holes = False  # padded batches (benchmarking only): step_inputs feeds holes as real rows
        self._row_of = None  # (store, row) of the static cache this one is a row_view of

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def is_static(self) -> bool:
        return self._static is not None

    def row_view(self) -> "KVCache":
        """An empty one-sequence static cache over this static cache's next free row of its store: where a joining
        sequence can be prefilled alone by a step that binds any address (TensorRT), and which `extend` then
        takes over without copying."""
        if self._static is None:
            raise ValueError("row_view is of a static cache")
        row = self.batch
        if row >= self._store.shape[2]:
            raise InvalidRequestError(f"a batch of {row + 1} exceeds the static cache's {self._store.shape[2]} sequences")
        view = KVCache(self._allocate, self.num_layers, 1, self.num_kv_heads, self.head_dim, self.capacity,
                       window=self.window, static=self._store[:, :, row:row + 1])
        view._row_of = (self._store, row)
        return view

    @property
    def store(self):
        """The static store this cache lives in (an engine's fixed addresses), or None for a dynamic cache."""
        return self._static

    def add_rows(self, count: int) -> None:
        """Add `count` empty sequences after the current ones (continuous batching admits requests here), in free
        rows of the store (a dynamic store doubles its rows when it has too few)."""
        batch = self.batch + count
        rows = self._store.shape[2]
        if batch > rows:
            if self._static is not None:
                raise InvalidRequestError(f"a batch of {batch} exceeds the static cache's {rows} sequences")
            grown = self._allocate((self.num_layers, 2, max(batch, 2 * rows), self.num_kv_heads, self.capacity,
                                    self.head_dim))
            grown[:, :, :self.batch] = self.buffer
            self._replace_store(grown)
        self.buffer = self._store[:, :, :batch]
        self.lengths = np.concatenate([self.lengths, np.zeros(count, dtype=np.int64)])
        self.pads = np.concatenate([self.pads, np.zeros(count, dtype=np.int64)])
        if self.valid is not None:
            self.valid = np.concatenate([self.valid, np.ones((count, self.capacity), dtype=bool)])

    def extend(self, other: "KVCache") -> None:
        """Append `other`'s sequences (a cache the new ones were prefilled in: a dynamic one beside a dynamic cache,
        an engine's admission cache beside its static one) after the current ones: only their filled slots are
        copied, and nothing where `other` is this cache's row_view."""
        if (self._static is None) != (other._static is None):
            raise ValueError("extend joins two dynamic caches, or a static cache and its engine's admission cache")
        old = self.batch
        self.reserve(other.capacity)
        self.add_rows(other.batch)
        in_place = other._row_of is not None and other._row_of[0] is self._store and other._row_of[1] == old
        if not in_place:  # (a row_view of this very row holds the sequence already)
            used = int(other.lengths.max(initial=0))
            self.buffer[:, :, old:, :, :used] = other.buffer[:, :, :, :, :used]
        self.lengths[old:] = other.lengths
        self.pads[old:] = other.pads
        if other.valid is not None:
            if self.valid is None:
                self.valid = np.ones((self.batch, self.capacity), dtype=bool)
            self.valid[old:] = other._valid_at(self.capacity)

    def layer_views(self, layer: int) -> tuple[object, object]:
        """(keys, values) of one layer, each [B, Hkv, S, D], contiguous."""
        return self.buffer[layer, 0], self.buffer[layer, 1]

    def reserve(self, needed: int) -> bool:
        """Make room for `needed` slots per sequence; returns True if the buffer was reallocated."""
        if needed <= self.capacity:
            return False
        if self._static is not None:
            raise InvalidRequestError(f"context of {needed} tokens exceeds the engines' static capacity of "
                                      f"{self.capacity} (rebuild them with a larger --capacity)")
        if needed > self.max_capacity:
            raise InvalidRequestError(f"context of {needed} tokens exceeds the model's maximum of {self.max_capacity}")
        capacity = min(self.max_capacity, -(-needed // self.bucket) * self.bucket)
        grown = self._allocate((self.num_layers, 2, self._store.shape[2], self.num_kv_heads, capacity, self.head_dim))
        used = int(self.lengths.max(initial=0))
        grown[:, :, :self.batch, :, :used] = self.buffer[:, :, :, :, :used]
        if self.valid is not None:
            self.valid = self._valid_at(capacity)
        self._replace_store(grown)
        self.capacity = capacity
        self.buffer = grown[:, :, :self.batch]
        self.slot_index = np.arange(capacity)
        return True

    def _replace_store(self, grown) -> None:
        """Hold `grown` (the old store's rows already copied into it) and give the old store back."""
        old, self._store = self._store, grown
        self._held[0] = grown
        if self._release is not None:
            self._release(old)

    def append(self, new_kv, counts: Sequence[int]) -> None:
        """Append the first counts[b] rows of new_kv [L, 2, B, Hkv, T, D] (or CacheRows) to each sequence b."""
        if isinstance(new_kv, CacheRows):
            for b, n in enumerate(counts):
                self._commit_in_place(new_kv, b, range(n))
            return
        for b, n in enumerate(counts):
            if n:
                start = int(self.lengths[b])
                self.buffer[:, :, b, :, start:start + n] = new_kv[:, :, b, :, :n]
                self.lengths[b] = start + n
                if self.valid is not None:
                    self.valid[b, start:start + n] = True

    def append_rows(self, new_kv, b: int, rows: Sequence[int]) -> None:
        """Append chosen rows (e.g. an accepted tree path) of sequence b's new_kv, compacted in order."""
        if isinstance(new_kv, CacheRows):
            self._commit_in_place(new_kv, b, rows)
            return
        start = int(self.lengths[b])
        for i, row in enumerate(rows):
            self.buffer[:, :, b, :, start + i] = new_kv[:, :, b, :, row]
        self.lengths[b] = start + len(rows)
        if self.valid is not None:
            self.valid[b, start:start + len(rows)] = True

    def _commit_in_place(self, rows: CacheRows, b: int, chosen: Sequence[int]) -> None:
        if not len(chosen):
            return
        if rows.cache is not self or rows.starts[b] < self.lengths[b]:
            raise ValueError("in-graph K/V rows are committed into the cache they were written to, before it moves on")
        self.compact(b, int(self.lengths[b]), [int(rows.starts[b]) + int(r) for r in chosen])

    def compact(self, b: int, start: int, slots: Sequence[int]) -> None:
        """Move rows at `slots` (ascending, each >= its destination) to start, start + 1, ...; the
        sequence then ends after them. This is how an accepted tree path leaves the scratch area."""
        for i, src in enumerate(slots):
            if src != start + i:
                self.buffer[:, :, b, :, start + i] = self.buffer[:, :, b, :, src]
        self.lengths[b] = start + len(slots)
        if self.valid is not None:
            self.valid[b, start:start + len(slots)] = True

    def truncate(self, b: int, length: int) -> None:
        """Roll sequence b back to `length` rows (drafted rows beyond it become garbage)."""
        if not 0 <= length <= self.lengths[b]:
            raise ValueError(f"cannot truncate sequence {b} from {self.lengths[b]} to {length}")
        if self.valid is not None and length < self.lengths[b]:
            self.pads[b] -= int(np.count_nonzero(~self.valid[b, length:self.lengths[b]]))
        self.lengths[b] = length

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the given batch rows, new row i being old row rows[i] (sequences that finished leave the
        batch). In place: only rows that move are copied, each up to its sequence's length."""
        rows = [int(r) for r in rows]
        if any(src < i for i, src in enumerate(rows)) or len(set(rows)) < len(rows):  # would overwrite a source
            moved = self.buffer[:, :, rows]  # a copy (advanced indexing) before the overwrite
            self._store[:, :, :len(rows)] = moved
        else:
            for i, src in enumerate(rows):
                if src != i:
                    used = int(self.lengths[src])
                    self._store[:, :, i, :, :used] = self._store[:, :, src, :, :used]
        self.buffer = self._store[:, :, :len(rows)]
        self.lengths = self.lengths[rows].copy()
        self.pads = self.pads[rows].copy()
        if self.valid is not None:
            self.valid = self.valid[rows].copy()

    # -- padding (vanilla batched speculation, benchmarking only) -----------------------------
    def pad_to(self, length: int) -> np.ndarray:
        """Pad every shorter sequence with masked slots up to `length` (slots it then owns, which no step
        attends to); returns the pad slots added per sequence."""
        if self.window is not None:
            raise InvalidRequestError("padded batches need slot i to hold position i under a sliding attention window: "
                                      "run this model unpadded")
        added = np.maximum(0, length - self.lengths)
        if not added.any():
            return added
        self.reserve(length)
        if self.valid is None:
            self.valid = np.ones((self.batch, self.capacity), dtype=bool)
        for b in np.flatnonzero(added):
            self.valid[b, self.lengths[b]:length] = False
        self.lengths += added
        self.pads += added
        return added

    def positions(self) -> np.ndarray:
        """[B] the position of each sequence's next token: its slots minus its padding."""
        return self.lengths - self.pads

    def _valid_at(self, capacity: int) -> np.ndarray:
        """`valid` (all True if nothing was padded) at another capacity; slots past the old one are True."""
        out = np.ones((self.batch, capacity), dtype=bool)
        if self.valid is not None:
            keep = min(capacity, self.capacity)
            out[:, :keep] = self.valid[:, :keep]
        return out
