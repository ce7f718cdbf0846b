"""Transparent huge pages for the memory a model's weights were loaded into (Linux).

A batch-1 step on the CPU streams every weight from memory once (hundreds of MB for the inflated target): with 4 KiB
pages that is a TLB miss every 4 KiB, and a page-table walk each. Backed by 2 MiB pages, the same stream has 512x
fewer. `specrt bench fusions --huge-pages on,off` times the step both ways.

Where transparent huge pages are enabled only for memory that asks for them ("madvise", the common default), the
weights an ONNX Runtime session copies into its own buffers (its MatMuls' packed weights included) are not huge-page
backed. `HugePages` wraps the load: within the private anonymous memory that appeared during it, every 2 MiB-aligned
huge page's worth whose pages are all resident (mincore: nothing unused becomes resident) is marked MADV_HUGEPAGE and
collapsed into a huge page at once (MADV_COLLAPSE, Linux 6.1+). The contents do not change. Where the kernel refuses
(huge pages "never", an older kernel, not Linux), nothing changes and `reason` says why. Memory that was there before
the load, such as a long-lived process's freed memory its allocator hands out again, is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import numpy as np

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>


def anonymous_regions() -> set[tuple[int, int]]:
    """This process's private writable anonymous regions, (start, end) each, from /proc/self/maps."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split()  # range perms offset dev inode [path]
            if head[1].startswith("rw") and head[1].endswith("p") and (len(head) == 5 or head[5] == "[heap]"):
                out.add(tuple(int(x, 16) for x in head[0].split("-")))
    return out


def _new_spans(now, before) -> list[tuple[int, int]]:
    """The parts of the regions `now` that no region of `before` covered (the kernel merges a new mapping into the
    one beside it: the merged region's old part is not new)."""
    old = sorted(before)
    out = []
    for start, end in sorted(now):
        for a, b in old:
            if b <= start or a >= end:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _resident_runs(libc, start: int, end: int) -> list[tuple[int, int]]:
    """The runs of whole 2 MiB-aligned huge pages within [start, end) whose every 4 KiB page is resident (mincore)."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return []
    page = os.sysconf("SC_PAGE_SIZE")
    vec = np.zeros((last - first) // page, dtype=np.uint8)
    if libc.mincore(first, last - first, vec.ctypes.data):
        return []
    whole = (vec & 1).reshape(-1, HUGE_PAGE // page).all(axis=1)
    runs, i = [], 0
    while i < len(whole):
        if whole[i]:
            j = i
            while j < len(whole) and whole[j]:
                j += 1
            runs.append((first + i * HUGE_PAGE, first + j * HUGE_PAGE))
            i = j
        else:
            i += 1
    return runs


class HugePages:
    """with HugePages(): load a model. Afterwards `bytes` were collapsed into huge pages, or `reason` says why none."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bytes = 0
        self.reason = None if enabled else "turned off"
        self._before = None

    def __enter__(self) -> "HugePages":
        if self.enabled:
            if not sys.platform.startswith("linux"):
                self.reason = "transparent huge pages are Linux's"
            else:
                try:
                    self._before = anonymous_regions()
                except OSError as e:
                    self.reason = f"cannot read /proc/self/maps ({e.strerror})"
        return self

    def __exit__(self, kind, value, tb) -> None:
        if self._before is None or kind is not None:
            return
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        errors = set()
        for start, end in _new_spans(anonymous_regions(), self._before):
            for a, b in _resident_runs(libc, start, end):
                if libc.madvise(a, b - a, MADV_HUGEPAGE) or libc.madvise(a, b - a, MADV_COLLAPSE):
                    errors.add(os.strerror(ctypes.get_errno()))
                else:
                    self.bytes += b - a
        if not self.bytes:
            self.reason = f"the kernel refused: {', '.join(sorted(errors))}" if errors else "no region to collapse"
