"""Transparent huge pages for the memory a model's weights were loaded into (runtime/backends/huge_pages.py): what
appeared during the load is collapsed into 2 MiB pages, unchanged; what was there before, or is not resident, is
left alone. Where this kernel gives no huge pages at all, the tests that need them skip, saying why."""

import ctypes
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime.backends.huge_pages import HugePages, anonymous_regions

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class _Memory:
    """A fresh private anonymous mapping of float32s, as the allocator maps a session's large buffers (a malloc in this
    long-lived process may hand out memory freed earlier instead, which is not new), filled from `seed` (None: left
    unwritten, so not resident)."""

    def __init__(self, mib: int, seed: int | None):
        self.map = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.float32)
        if seed is not None:
            self.array[:] = np.random.default_rng(seed).standard_normal(self.array.size)

    def close(self) -> None:
        del self.array
        self.map.close()


def _huge_pages_here() -> None:
    if not THP.is_file() or "[never]" in THP.read_text():
        pytest.skip("this kernel gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)")


def _only_when_asked() -> bool:
    """Whether memory gets huge pages only where it asks ("madvise"): what was not collapsed then has none."""
    return THP.is_file() and "[madvise]" in THP.read_text()


def _anon_huge_kib(array: np.ndarray) -> int:
    """AnonHugePages (kB) of the mappings that hold `array` (madvise splits a mapping where its advice changes)."""
    low, high = array.ctypes.data, array.ctypes.data + array.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            start, end = (int(x, 16) for x in head[0].split("-"))
            inside = start < high and end > low
        elif inside and head[0] == "AnonHugePages:":
            total += int(head[1])
    return total


def test_memory_allocated_during_the_load_is_collapsed_into_huge_pages_unchanged():
    _huge_pages_here()
    before = _Memory(8, seed=0)  # there before the load
    with HugePages() as pages:
        weights = _Memory(16, seed=1)  # resident
        unused = _Memory(16, seed=None)  # never written: not resident, left alone
    want = np.random.default_rng(1).standard_normal(16 << 18).astype(np.float32)
    # whole aligned huge pages: at either end one may be shared with memory not new or not resident
    assert pages.reason is None and pages.bytes >= weights.array.nbytes - 2 * (2 << 20)
    assert _anon_huge_kib(weights.array) >= 12 * 1024
    assert np.array_equal(weights.array, want)
    if _only_when_asked():
        assert _anon_huge_kib(before.array) == 0 and _anon_huge_kib(unused.array) == 0
    for memory in (before, weights, unused):
        memory.close()


def test_turned_off_nothing_changes():
    with HugePages(enabled=False) as pages:
        weights = _Memory(16, seed=1)
    assert (pages.bytes, pages.reason) == (0, "turned off")
    if _only_when_asked():
        assert _anon_huge_kib(weights.array) == 0
    weights.close()


def test_the_regions_are_this_process_s_private_anonymous_memory():
    memory = _Memory(4, seed=2)
    address = memory.array.ctypes.data
    holder = [r for r in anonymous_regions() if r[0] <= address < r[1]]
    assert len(holder) == 1 and holder[0][1] - holder[0][0] >= memory.array.nbytes
    libc = ctypes.CDLL(None)
    code = ctypes.cast(libc.malloc, ctypes.c_void_p).value  # in libc's text: a file's, not writable
    assert not [r for r in anonymous_regions() if r[0] <= code < r[1]]
    memory.close()


def test_a_process_that_loads_a_pipeline_has_its_weights_in_huge_pages(demo_bundle):
    """As a deployment loads one (the CLI, a served model): in a fresh process, whose allocator hands the session new
    memory. (Memory a long-lived process freed and the allocator reuses is not new, and is left as it is.)"""
    _huge_pages_here()
    code = ("import sys; from specrt.runtime.pipeline import Pipeline; t = Pipeline.load(sys.argv[1], threads=2).target; "
            "print(t.huge_pages.bytes, t.huge_pages.reason)")
    out = subprocess.run([sys.executable, "-c", code, str(demo_bundle)], capture_output=True, text=True, check=True)
    collapsed, reason = out.stdout.split(maxsplit=1)
    assert reason.strip() == "None" and int(collapsed) >= 2 << 20
