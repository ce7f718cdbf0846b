import numpy as np
import pytest

from specrt.errors import InvalidRequestError
from specrt.runtime.kv_cache import KVCache


def make(batch=2, max_capacity=64, bucket=8):
    return KVCache(lambda shape: np.zeros(shape, np.float32), num_layers=2, batch=batch, num_kv_heads=1,
                   head_dim=3, max_capacity=max_capacity, bucket=bucket)


def rows(batch, num_tokens, start):
    """new_kv [L=2, 2, B, 1, T, 3] whose value at row t of sequence b is start + 100*b + t."""
    v = start + 100 * np.arange(batch)[:, None] + np.arange(num_tokens)[None, :]
    return np.broadcast_to(v[None, None, :, None, :, None], (2, 2, batch, 1, num_tokens, 3)).astype(np.float32).copy()


def seq(cache, b):
    return cache.buffer[0, 0, b, 0, : cache.lengths[b], 0].tolist()


def test_append_commits_only_requested_rows_per_sequence():
    c = make()
    c.reserve(5)
    c.append(rows(2, 4, 0), [3, 1])
    assert c.lengths.tolist() == [3, 1]
    assert seq(c, 0) == [0, 1, 2] and seq(c, 1) == [100]
    c.append(rows(2, 2, 10), [2, 0])
    assert seq(c, 0) == [0, 1, 2, 10, 11] and seq(c, 1) == [100]


def test_append_rows_compacts_a_tree_path():
    c = make()
    c.reserve(8)
    c.append(rows(2, 2, 0), [2, 2])
    c.append_rows(rows(2, 6, 50), 1, [0, 2, 5])
    assert seq(c, 1) == [100, 101, 150, 152, 155]
    assert seq(c, 0) == [0, 1]


def test_truncate_is_a_length_move_and_checks_bounds():
    c = make()
    c.reserve(4)
    c.append(rows(2, 4, 0), [4, 4])
    c.truncate(0, 1)
    assert seq(c, 0) == [0] and c.lengths[1] == 4
    with pytest.raises(ValueError):
        c.truncate(0, 3)


def test_growth_is_bucketed_and_keeps_content():
    c = make(bucket=8)
    assert c.reserve(3) and c.capacity == 8
    assert not c.reserve(8)
    c.append(rows(2, 5, 0), [5, 2])
    assert c.reserve(9) and c.capacity == 16
    assert seq(c, 0) == [0, 1, 2, 3, 4] and seq(c, 1) == [100, 101]
    with pytest.raises(InvalidRequestError, match="exceeds"):
        c.reserve(65)


def test_keep_drops_finished_sequences():
    c = make(batch=3)
    c.reserve(4)
    c.append(rows(3, 3, 0), [1, 2, 3])
    c.keep([0, 2])
    assert c.batch == 2 and c.lengths.tolist() == [1, 3]
    assert seq(c, 1) == [200, 201, 202]


def test_compact_moves_an_accepted_path_out_of_scratch():
    c = make()
    c.reserve(8)
    c.append(rows(2, 7, 0), [7, 7])  # slots 0..6; say 3..6 are scratch tree nodes
    c.compact(0, 3, [4, 6])  # accepted nodes sat at slots 4 and 6
    assert seq(c, 0) == [0, 1, 2, 4, 6]
    c.compact(1, 3, [3])  # already in place
    assert seq(c, 1) == [100, 101, 102, 103]


def test_pack_step_scratch_visibility():
    from specrt.runtime.step_inputs import pack_step

    c = make(batch=1)
    c.reserve(8)
    c.append(rows(1, 6, 0), [6])  # slots 0..3 prefix, 4..5 scratch
    vis = np.array([[True, False], [False, True]])
    ids, pos, mask = pack_step(c, [np.array([7, 8])], [np.array([5, 5])], [np.eye(2, dtype=bool)], [(4, vis)])
    cap = c.capacity
    assert mask[0, 0, :cap].tolist() == [True] * 4 + [True, False] + [False] * (cap - 6)
    assert mask[0, 1, :cap].tolist() == [True] * 4 + [False, True] + [False] * (cap - 6)
    assert mask[0, :, cap:].tolist() == [[True, False], [False, True]]


def test_padding_masks_slots_and_keeps_positions():
    """pad_to (padded batches, benchmarking only): shorter sequences get masked slots up to a common length;
    positions() stay the tokens' own; valid and pads follow every later change of the batch."""
    from specrt.runtime.step_inputs import pack_step

    c = make(batch=3)
    c.reserve(6)
    c.append(rows(3, 4, 0), [4, 1, 2])
    assert c.valid is None and c.pad_to(4).tolist() == [0, 3, 2]
    assert c.lengths.tolist() == [4, 4, 4] and c.positions().tolist() == [4, 1, 2]
    assert c.valid[:, :4].tolist() == [[True] * 4, [True, False, False, False], [True, True, False, False]]
    c.append(rows(3, 2, 10), [1, 2, 0])
    assert c.positions().tolist() == [5, 3, 2] and c.valid[1, 4:6].all()
    _, _, mask = pack_step(c, [np.zeros(1, np.int64)] * 3, [c.positions()[b:b + 1] for b in range(3)])
    assert mask[1, 0, :c.capacity].tolist()[:7] == [True, False, False, False, True, True, False]
    c.reserve(40)  # growing keeps which slots are padding
    assert c.valid.shape == (3, c.capacity) and not c.valid[1, 1:4].any()
    c.truncate(1, 2)  # rolling back over padding gives it back
    assert c.pads.tolist() == [0, 1, 2] and c.positions()[1] == 1
    c.keep([2, 1])
    assert c.pads.tolist() == [2, 1] and c.valid[0, :4].tolist() == [True, True, False, False]
    c.add_rows(1)
    assert c.pads.tolist() == [2, 1, 0] and c.valid.shape[0] == 3 and c.valid[2].all()
    windowed = KVCache(lambda shape: np.zeros(shape, np.float32), 1, 2, 1, 1, 64, 8, window=4)
    windowed.reserve(2)
    windowed.lengths[:] = [1, 2]
    with pytest.raises(InvalidRequestError, match="sliding attention window"):
        windowed.pad_to(2)


def test_leaving_and_joining_sequences_copy_only_the_rows_that_move():
    """A finishing sequence's row is filled by the last live one (scheduler.compaction), in place: the store keeps
    its address and the other rows are not copied; joining sequences take free rows of the store."""
    from specrt.runtime.scheduler import compaction

    assert compaction([False, True, False, False, True, False]) == [0, 5, 2, 3]
    assert compaction([True, True]) == [] and compaction([False, False]) == [0, 1]
    c = make(batch=4)
    c.reserve(3)
    c.append(rows(4, 3, 0), [3, 2, 1, 3])
    store = c._store
    copies = []
    real = store.__setitem__

    class Spy(np.ndarray):
        def __setitem__(self, key, value):
            copies.append(key)
            real(key, value)

    c._store = store.view(Spy)
    c.keep(compaction([False, True, False, False]))  # sequence 1 leaves: sequence 3 takes its row
    assert len(copies) == 1 and [seq(c, b) for b in range(3)] == [[0, 1, 2], [300, 301, 302], [200]]
    fresh = make(batch=2)
    fresh.reserve(12)
    fresh.append(rows(2, 10, 50), [10, 4])
    c.extend(fresh)  # a larger capacity: the store grows once; its rows now fit the new sequences
    assert c.batch == 5 and seq(c, 3) == list(range(50, 60)) and seq(c, 4) == [150, 151, 152, 153]
    assert [seq(c, b) for b in range(3)] == [[0, 1, 2], [300, 301, 302], [200]]
    c.keep([0, 4, 2])  # a hole filled from the end
    store = c._store
    c.add_rows(2)  # free rows: no new store
    assert c._store is store and c.batch == 5 and c.lengths.tolist() == [3, 4, 1, 0, 0]
    c.keep([1, 0])  # a swap reads each source before it is overwritten
    assert seq(c, 0) == [150, 151, 152, 153] and seq(c, 1) == [0, 1, 2]


def test_a_store_pool_hands_given_up_memory_to_the_next_store_zeroed_and_keeps_a_bounded_few():
    from specrt.runtime.kv_cache import StorePool

    pool = StorePool(np.float32, keep=2)
    big = (4, 2, 8, 2, 256, 64)  # 16 MiB
    a = pool.allocate(big)
    assert not a.any() and pool.held_bytes == 0
    a[...] = 1.0
    pool.release(a)
    pool.release(a)  # twice: held once
    assert pool.held_bytes == a.nbytes
    b = pool.allocate((4, 2, 8, 2, 128, 64))  # smaller: the same memory, zero-filled as a fresh store
    assert np.shares_memory(a, b) and not b.any() and pool.held_bytes == 0
    c = pool.allocate(big)  # nothing fits in the pool: fresh
    assert not np.shares_memory(b, c)
    for arr in (b, c, pool.allocate((4, 2, 8, 2, 64, 64))):  # a third one: the smallest is dropped
        pool.release(arr)
    assert pool.held_bytes == 2 * a.nbytes
    pool.release(np.ones(16, np.float32))  # below MIN_BYTES (and not its memory): not kept
    assert pool.held_bytes == 2 * a.nbytes
    # a finalizer releasing a store while this thread holds the lock (inside allocate) must not deadlock
    with pool._lock:
        pool.release(np.zeros(big, np.float32))
    assert pool.held_bytes == 2 * a.nbytes and pool._free[0].size == a.size  # sorted in, the largest kept


def test_a_cache_gives_its_stores_back_when_it_grows_and_when_it_is_dropped_and_never_shares_a_live_one():
    import gc

    from specrt.runtime.kv_cache import StorePool

    pool = StorePool(np.float32)
    cache = KVCache(pool.allocate, 4, 8, 2, 64, 1024, bucket=128, release=pool.release)
    cache.reserve(100)
    cache.buffer[...] = 3.0
    cache.lengths[:] = 100
    first = cache._store
    cache.reserve(200)  # grown: the committed prefix copied, the old store given back
    assert (cache.buffer[:, :, :, :, :100] == 3.0).all() and not cache.buffer[:, :, :, :, 100:].any()
    assert np.shares_memory(pool._free[0], first) and not np.shares_memory(cache._store, first)
    other = KVCache(pool.allocate, 4, 8, 2, 64, 1024, bucket=128, release=pool.release)
    other.reserve(100)  # takes the given-up store, never the live one
    assert np.shares_memory(other._store, first) and not np.shares_memory(other._store, cache._store)
    held = cache._store
    del cache
    gc.collect()
    assert any(np.shares_memory(flat, held) for flat in pool._free)  # dropped: its store given back


def test_a_store_pool_never_hands_one_memory_to_two_live_stores_across_threads():
    import threading

    from specrt.runtime.kv_cache import StorePool

    pool = StorePool(np.float32, keep=3)
    clashes, rng_seeds = [], range(4)

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(150):
            store = pool.allocate((int(rng.integers(1, 4)) << 18,))  # 1-3 MiB
            if store.any():
                clashes.append("not zero-filled")
            store[...] = seed + 1
            if not (store == seed + 1).all():
                clashes.append("written by another thread")
            pool.release(store)

    threads = [threading.Thread(target=worker, args=(s,)) for s in rng_seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clashes and len(pool._free) <= 3


def test_a_static_cache_takes_a_sequence_prefilled_alone_in_an_admission_cache():
    """Engines (fixed addresses) prefill a joining sequence in a one-row admission cache of their own and copy only
    its filled slots into the next free row of the batch's static store, which keeps its address."""
    alloc = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
    store, admission = alloc((2, 2, 4, 1, 16, 3)), alloc((2, 2, 1, 1, 16, 3))
    c = KVCache(alloc, 2, 2, 1, 3, 16, static=store)
    c.append(rows(2, 3, 0), [3, 2])
    for start, n in ((50, 5), (70, 2)):  # the admission store is reused: each cache over it starts empty
        alone = KVCache(alloc, 2, 1, 1, 3, 16, static=admission)
        alone.append(rows(1, n, start), [n])
        c.extend(alone)
    assert c._store is store and c.capacity == 16 and c.lengths.tolist() == [3, 2, 5, 2]
    assert [seq(c, b) for b in range(4)] == [[0, 1, 2], [100, 101], list(range(50, 55)), [70, 71]]
    assert not store[:, :, 3, :, 2:].any()  # slots past the joined sequence's length were not copied
    with pytest.raises(ValueError, match="extend joins two dynamic caches, or a static cache and"):
        c.extend(make(batch=1))


def test_a_row_view_is_the_static_stores_next_free_row_and_joins_without_a_copy():
    """TensorRT binds any address: a joining sequence is prefilled in the store's next free row itself."""
    alloc = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
    store = alloc((2, 2, 3, 1, 16, 3))
    c = KVCache(alloc, 2, 2, 1, 3, 16, static=store)
    c.append(rows(2, 3, 0), [3, 2])
    view = c.row_view()
    view.append(rows(1, 4, 70), [4])  # written straight into row 2 of the store
    assert store[0, 0, 2, 0, :4, 0].tolist() == [70, 71, 72, 73]
    copies = []

    class Spy(np.ndarray):  # the store, recording every assignment into it or its slices
        def __setitem__(self, key, value):
            copies.append(key)
            super().__setitem__(key, value)

    c._store = store.view(Spy)
    view._row_of = (c._store, 2)  # (row_view's record, of the spied store)
    c.extend(view)
    assert not copies and c.lengths.tolist() == [3, 2, 4] and seq(c, 2) == [70, 71, 72, 73]
    with pytest.raises(InvalidRequestError, match="a batch of 4 exceeds the static cache's 3 sequences"):
        c.row_view()
    with pytest.raises(ValueError, match="row_view is of a static cache"):
        make().row_view()
