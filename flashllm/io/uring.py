"""io_uring for a reader's direct reads (Linux 5.19+): the AIO engine's queue (``aio.AioQueue``) over a ring
instead of an AIO context, with the reader's large destinations registered as fixed buffers.

A read into a registered buffer skips pinning its pages, the largest per-read cost in the kernel, so it
takes less CPU than a Linux AIO read; plain io_uring reads cost what AIO's do (docs/benchmarks.md). The ring is driven by C (backends/native/uring.c)
that takes the AIO engine's request records and returns its completion records, so everything above
(request building, the submitter thread, error reporting) is shared. ``UringContext.open`` returns None
where the C build, the syscall or its features are missing: the reader then uses AIO.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import weakref

import numpy as np

from flashllm.io.aio import EVENT

MIN_BUFFER = 1 << 20  # destinations smaller than this stay plain reads (registering pins the whole array)
_state: dict = {}


def _library():
    if "lib" not in _state:
        _state["lib"] = None
        if sys.platform.startswith("linux"):
            from flashllm.backends import native
            try:
                lib = ctypes.CDLL(str(native.build(source=native.SOURCE.with_name("uring.c"))))
                p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                lib.fl_uring_open.argtypes, lib.fl_uring_open.restype = [ctypes.c_uint, i32, p], p
                lib.fl_uring_close.argtypes, lib.fl_uring_close.restype = [p], None
                lib.fl_uring_buffer.argtypes, lib.fl_uring_buffer.restype = [p, i32, ctypes.c_uint64, ctypes.c_uint64], i32
                lib.fl_uring_submit.argtypes = [p, p, i64]
                lib.fl_uring_reap.argtypes = [p, i64, i64, p]
                lib.fl_uring_submit.restype = lib.fl_uring_reap.restype = i64
                _state["lib"] = lib
            except (OSError, subprocess.SubprocessError):
                pass
    return _state["lib"]


def _owner(a: np.ndarray):
    """The object owning `a`'s memory (the root of its .base chain)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


class UringContext:
    """One io_uring ring for ``depth`` reads of one file, with AioContext's interface (``submit`` iocb records,
    ``reap`` io_event records) plus ``register``: up to ``slots`` destination arrays as fixed buffers."""

    def __init__(self, lib, ring: int, depth: int):
        self.lib, self.ring, self.depth = lib, ring, depth
        self.ctx = ring  # truthy while open, like AioContext.ctx
        self.events = np.zeros(depth, dtype=EVENT)
        self.slots = [None] * lib.fl_uring_slots()  # (address, bytes, finalizer) per registered buffer
        self.registered = 0  # bytes of destinations registered so far (for stats and tests)
        self._lock = threading.RLock()  # the slot table against submissions (a finalizer may empty a slot)
        self._refused: set = set()  # (address, bytes) of owners not registered: not retried

    @classmethod
    def open(cls, depth: int, fd: int) -> "UringContext | None":
        lib = _library()
        if lib is None or depth < 1:
            return None
        err = ctypes.c_int(0)
        ring = lib.fl_uring_open(depth, fd, ctypes.byref(err))
        return cls(lib, ring, depth) if ring else None

    def register(self, dest: np.ndarray) -> bool:
        """Register the numpy array owning `dest`'s memory (MIN_BUFFER to 1 GiB) as a fixed buffer while it
        lives (a finalizer empties the slot before the memory is freed); False if it is registered already,
        or too small or large, or no slot or pinning allowance (RLIMIT_MEMLOCK) is left: plain reads then."""
        owner = _owner(dest)
        if not isinstance(owner, np.ndarray) or not self.ring:
            return False
        base, total = owner.ctypes.data, owner.nbytes
        with self._lock:
            if (base, total) in self._refused or any(s is not None and s[0] <= base < s[0] + s[1] for s in self.slots):
                return False
            free = next((k for k, s in enumerate(self.slots) if s is None), None)
            if free is None or not MIN_BUFFER <= total <= 1 << 30 or \
                    self.lib.fl_uring_buffer(self.ring, free, base, total) != 0:
                if len(self._refused) > 4096:
                    self._refused.clear()
                self._refused.add((base, total))
                return False
            self.slots[free] = (base, total, weakref.finalize(owner, self._empty, free, base))
            self.registered += total
            return True

    def _empty(self, slot: int, base: int) -> None:
        with self._lock:
            s = self.slots[slot]
            if s is not None and s[0] == base and self.ring:
                self.lib.fl_uring_buffer(self.ring, slot, 0, 0)
                self.slots[slot] = None
                self.registered -= s[1]

    def submit(self, iocbs: np.ndarray) -> int:
        """Queue `iocbs` (contiguous iocb records); how many the kernel took; OSError if it took none."""
        with self._lock:
            got = self.lib.fl_uring_submit(self.ring, iocbs.ctypes.data, len(iocbs))
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return got

    def reap(self, min_nr: int, max_nr: int) -> np.ndarray:
        """Wait until at least `min_nr` reads completed; their completions (at most `max_nr`) as io_events."""
        if len(self.events) < max_nr:
            self.events = np.zeros(max_nr, dtype=EVENT)
        got = self.lib.fl_uring_reap(self.ring, min_nr, max_nr, self.events.ctypes.data)
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return self.events[:got]

    def close(self) -> None:
        with self._lock:
            if self.ring:
                for s in self.slots:
                    if s is not None:
                        s[2].detach()
                self.lib.fl_uring_close(self.ring)
                self.ring = self.ctx = 0
