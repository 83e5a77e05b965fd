"""Host memory for what a token streams: page-aligned buffers that direct I/O reads land in (`aligned_empty`),
and fresh buffers on 2 MiB transparent huge pages for big, long-lived memory (weights fused at load: torch's
allocator gives them 4 KiB pages, while numpy already advises its big arrays huge): fewer TLB misses per GB the
mat-vecs stream. Linux asks with madvise(MADV_HUGEPAGE) on a new private anonymous mapping (THP in "madvise" or
"always" mode); elsewhere, for small buffers, or with FLASHLLM_HUGEPAGES=0 these are plain arrays."""
from __future__ import annotations

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20


def aligned_empty(shape, dtype, align: int = 4096) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary (for in-place direct reads)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def enabled() -> bool:
    """Whether `empty` asks for huge pages (Python's mmap knows MADV_HUGEPAGE and the user did not opt out)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("FLASHLLM_HUGEPAGES", "1") != "0"


def empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes`. From `HUGE_PAGE` bytes up (where `enabled`) a fresh mapping
    whose pages from a 2 MiB boundary on are advised huge, so the first touch (a copy into it) faults in
    huge pages; the unused head and tail of the mapping are never touched and cost no memory."""
    if nbytes < HUGE_PAGE or not enabled():
        return np.empty(nbytes, dtype=np.uint8)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous: not faulted in yet
    raw = np.frombuffer(area, dtype=np.uint8)  # keeps `area` mapped while any view of it lives
    start = -raw.ctypes.data % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # THP disabled ("never") or not built in: plain pages
        pass
    return raw[start:start + nbytes]
