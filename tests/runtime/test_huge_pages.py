"""Transparent huge pages for the memory a model's weights were loaded into (runtime/backends/huge_pages.py): what
appeared during the load is collapsed into 2 MiB pages, unchanged; what was there before, or is not resident, is
left alone. Where this kernel gives no huge pages at all, the tests that need them skip, saying why."""

from pathlib import Path

import ctypes
import ctypes.util
import subprocess
import sys

import numpy as np
import pytest

from specrt.runtime.backends.huge_pages import HugePages, anonymous_regions

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
LIBC.free.argtypes = [ctypes.c_void_p]


def _malloc(mib: int, seed: int | None) -> np.ndarray:
    """float32 memory from glibc's malloc, as a session's weights are (numpy's own large arrays ask for huge pages
    themselves), filled from `seed` (None: left unwritten, so not resident)."""
    count = mib << 18
    array = np.ctypeslib.as_array(ctypes.cast(LIBC.malloc(count * 4), ctypes.POINTER(ctypes.c_float)), (count,))
    if seed is not None:
        array[:] = np.random.default_rng(seed).standard_normal(count)
    return array


def _huge_pages_here() -> None:
    if not THP.is_file() or "[never]" in THP.read_text():
        pytest.skip("this kernel gives no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled)")


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
    before = _malloc(8, seed=0)  # there before the load
    with HugePages() as pages:
        weights = _malloc(16, seed=1)  # resident
        unused = _malloc(16, seed=None)  # never written: not resident, left alone
    want = np.random.default_rng(1).standard_normal(16 << 18).astype(np.float32)
    # whole aligned huge pages: at either end one may be shared with memory not new or not resident
    assert pages.reason is None and pages.bytes >= weights.nbytes - 2 * (2 << 20)
    assert _anon_huge_kib(weights) >= 12 * 1024
    assert np.array_equal(weights, want)
    assert _anon_huge_kib(before) == 0 and _anon_huge_kib(unused) == 0
    for array in (before, weights, unused):
        LIBC.free(array.ctypes.data)


def test_turned_off_nothing_changes():
    with HugePages(enabled=False) as pages:
        weights = _malloc(16, seed=1)
    assert (pages.bytes, pages.reason) == (0, "turned off")
    assert _anon_huge_kib(weights) == 0
    LIBC.free(weights.ctypes.data)


def test_the_regions_are_this_process_s_private_anonymous_memory():
    array = _malloc(4, seed=2)
    holder = [r for r in anonymous_regions() if r[0] <= array.ctypes.data < r[1]]
    assert len(holder) == 1 and holder[0][1] - holder[0][0] >= array.nbytes
    code = ctypes.cast(LIBC.malloc, ctypes.c_void_p).value  # in libc's text: a file's, not writable
    assert not [r for r in anonymous_regions() if r[0] <= code < r[1]]
    LIBC.free(array.ctypes.data)


def test_a_process_that_loads_a_pipeline_has_its_weights_in_huge_pages(demo_bundle):
    """As a deployment loads one (the CLI, a served model): in a fresh process, whose allocator hands the session new
    memory. (Memory a long-lived process freed and the allocator reuses is not new, and is left as it is.)"""
    _huge_pages_here()
    code = ("import sys; from specrt.runtime.pipeline import Pipeline; t = Pipeline.load(sys.argv[1], threads=2).target; "
            "print(t.huge_pages.bytes, t.huge_pages.reason)")
    out = subprocess.run([sys.executable, "-c", code, str(demo_bundle)], capture_output=True, text=True, check=True)
    collapsed, reason = out.stdout.split(maxsplit=1)
    assert reason.strip() == "None" and int(collapsed) >= 2 << 20
