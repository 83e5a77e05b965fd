"""What a flash read call is to its caller: the handle to wait on (`PendingRead`), its cost (`IOStats`), its errors."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from flashllm.errors import FlashLLMError


class FlashIOError(FlashLLMError):
    """A read from a flash file failed, or a request did not fit the file or the destination."""


@dataclass
class IOStats:
    """What one call cost: bytes asked for, bytes transferred (incl. alignment waste and gaps), syscalls, and
    the time from submitting the call to its last read finishing."""

    bytes_requested: int = 0
    bytes_read: int = 0
    reads: int = 0
    wall_s: float = 0.0

    def __add__(self, other: "IOStats") -> "IOStats":
        return IOStats(self.bytes_requested + other.bytes_requested, self.bytes_read + other.bytes_read,
                       self.reads + other.reads, self.wall_s + other.wall_s)


class PendingRead:
    """A submitted call: ``wait()`` blocks until all its reads are done, then returns IOStats or raises."""

    def __init__(self, path: str, pending: int, requested: int, t0: float, fadvise=None, driver=None,
                 total: int | None = None, helper=None):
        """`pending`: workers serving the call; `total`: its reads (it is over when all are counted, without
        waiting for workers woken too late to find any left); `helper`: does reads of the call in the
        waiting thread, which is running already (a woken worker may wait long for a core on a loaded
        machine); `driver`: an AioQueue whose `progress` the waiting thread calls (AIO reads)."""
        self.path, self.pending, self._requested, self._t0, self._fadvise = path, pending, requested, t0, fadvise
        self._driver, self._total, self._helper = driver, total, helper
        self._job = None  # an AIO call's AioJob: its waiter reaps all of the job's reads at once
        self._t1 = t0  # when the last read finished
        self.lock, self.event = threading.Lock(), threading.Event()
        self.bytes_read = self.reads = 0
        self.dest = None  # the threads' view of the destination, dropped when the call is over
        self.error: BaseException | None = None
        self._stats: IOStats | None = None
        if pending == 0:
            self.event.set()

    def finish(self, nbytes: int, nreads: int, error: BaseException | None, worker: bool = True) -> None:
        """Called by each worker once it has no more reads of this call (and by the helper, `worker` False)."""
        with self.lock:
            self.bytes_read += nbytes
            self.reads += nreads
            if error is not None and self.error is None:
                self.error = error
            self.pending -= worker
            all_read = self.error is None and self._total is not None and self.reads >= self._total
            if self.event.is_set() or (self.pending and not all_read):
                return
            self._t1 = time.perf_counter()
            self.dest = None
            self.event.set()
        if self._fadvise is not None:  # buffered fallback: drop what this call read from the page cache
            try:
                os.posix_fadvise(*self._fadvise, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # only a hint

    def done(self) -> bool:
        if self._driver is not None and not self.event.is_set():
            self._driver.progress(block=False)
        return self.event.is_set()

    def wait(self) -> IOStats:
        """Wait for the reads; raise the first error (a failed call must not be treated as loaded)."""
        while self._driver is not None and not self.event.is_set():
            self._driver.progress(job=self._job)
        if self._helper is not None and not self.event.is_set():
            self._helper()
        self._helper = None
        self.event.wait()
        if self.error is not None:
            raise self.error
        if self._stats is None:
            self._stats = IOStats(self._requested, self.bytes_read, self.reads, self._t1 - self._t0)
        return self._stats


def short_read(path: str, off: int, n: int, got: int) -> FlashIOError:
    return FlashIOError(f"{path}: short read at offset {off}: got {got} of {n} bytes (file truncated?)")
