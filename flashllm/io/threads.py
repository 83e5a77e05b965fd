"""FlashReader's reader threads: a call's blocking preadv reads, taken from one iterator by workers and waiter."""

from __future__ import annotations

import errno
import os
import queue
import sys
import threading

import numpy as np

from flashllm.io.call import FlashIOError, PendingRead, short_read
from flashllm.io.read_list import Reads

_preadv = os.preadv  # module-level so tests can inject I/O errors
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()  # False on free-threaded Python: no shared iterator


class ReaderThreads:
    """Worker threads reading one open file (`fd`), one per bounce buffer but the last, which is the waiting
    thread's: it does reads of its own call too. A read goes straight into the destination, or (unaligned
    direct I/O) through the reader's bounce buffer; gaps read through land in `junk`."""

    def __init__(self, fd: int, path: str, bounces: list[memoryview], alignment: int, junk: memoryview):
        self.fd, self.path, self.alignment, self.junk = fd, path, alignment, junk
        *own, self._help_bounce = bounces
        self.queues = [queue.SimpleQueue() for _ in own]
        self.threads = [threading.Thread(target=_worker, name=f"flashio-{i}", daemon=True, args=(fd, q, b, alignment))
                        for i, (q, b) in enumerate(zip(self.queues, own))]
        for t in self.threads:
            t.start()
        self._next = 0
        self._help_lock = threading.Lock()

    def submit(self, flat: np.ndarray, reads: Reads, inplace: np.ndarray, requested: int, t0: float,
               fadvise=None) -> PendingRead:
        """Queue the reads (sorted by file offset) into `flat` for the workers, `inplace` per read: straight into
        it (else through a bounce buffer); `fadvise`: the range the call drops from the page cache (buffered
        reads). The returned handle waits for them."""
        nw = min(len(self.queues), len(reads))
        # Issue the reads as nw interleaved sequential streams (like fio's parallel sequential jobs): each
        # thread walks its own ascending stream, which the device serves faster than all threads walking one.
        per = -(-len(reads) // nw)
        order = np.arange(per * nw).reshape(nw, per).T.reshape(-1)
        order = order[order < len(reads)]
        mode = inplace.tolist()  # True: straight into dest; False: through the bounce buffer
        for r in np.flatnonzero(reads.piece_count() > 1).tolist():  # gathered: (dest offset or -1, bytes) pieces
            mode[r] = reads.pieces_of(r)
        cols = [a[order].tolist() for a in (reads.off, reads.doff, reads.len)] + [[mode[k] for k in order.tolist()]]
        shared = zip(*cols)
        call = PendingRead(self.path, nw, requested, t0, fadvise, total=len(reads),
                           helper=(lambda: self._help(call, shared)) if _GIL else None)
        call.dest = memoryview(flat)
        # Work-sharing: all workers pull from one iterator, so none idles while reads are left (no straggler
        # tail). next() on a zip of list iterators is atomic under the GIL; do not put map() or anything that
        # allocates between the items in here: a GC run mid-item can switch threads and mix up reads.
        for w in range(nw):
            share = shared if _GIL else zip(*(c[w::nw] for c in cols))  # free-threaded: fixed shares
            self.queues[(self._next + w) % len(self.queues)].put((call, share, self.junk))
        self._next = (self._next + nw) % len(self.queues)
        return call

    def _help(self, call: PendingRead, shared) -> None:
        """The waiting thread takes reads of its call from the shared iterator too (unless another one is
        helping: the bounce buffer is one)."""
        if self._help_lock.acquire(blocking=False):
            try:
                _serve(self.fd, self._help_bounce, self.alignment, (call, shared, self.junk), worker=False)
            finally:
                self._help_lock.release()

    def cpu_seconds(self) -> float:
        """CPU seconds the worker threads have used so far (Linux /proc schedstat; 0.0 elsewhere)."""
        total = 0
        for t in self.threads:
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total / 1e9

    def stop(self) -> None:
        """Stop the workers once the calls queued for them are done."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()


def _worker(fd: int, jobs: queue.SimpleQueue, bounce: memoryview, align: int) -> None:
    """Serve jobs until the ``None`` sentinel (holding no reference to a job's buffer in between)."""
    while _serve(fd, bounce, align, jobs.get()):
        pass


def _serve(fd: int, bounce: memoryview, align: int, job, worker: bool = True) -> bool:
    """Do the reads of one job (a worker's, or the waiting thread's help with ``worker`` False); errors go
    back to the caller through ``PendingRead``. False on the sentinel."""
    if job is None:
        return False
    call, reads, junk = job
    dest = call.dest  # None once the call is over: a worker woken that late takes no view of the buffer
    if dest is None:
        reads = ()
    nbytes = nreads = off = n = 0
    error = None
    preadv = _preadv
    try:
        for off, doff, n, direct in reads:
            if direct is True:
                got = preadv(fd, (dest[doff:doff + n],), off)
                if got != n:
                    raise short_read(call.path, off, n, got)
            elif direct is not False:  # gathered: one file range into several rows (gaps into `junk`)
                got = preadv(fd, [dest[d:d + k] if d >= 0 else junk[:k] for d, k in direct], off)
                if got != n:
                    raise short_read(call.path, off, n, got)
            else:  # read the covering aligned range into the bounce buffer and copy out
                a0 = off - off % align
                a1 = -(-(off + n) // align) * align
                got = preadv(fd, (bounce[:a1 - a0],), a0)
                if got < off + n - a0:
                    raise short_read(call.path, off, n, max(0, got - (off - a0)))
                dest[doff:doff + n] = bounce[off - a0:off - a0 + n]
            nbytes += got
            nreads += 1
    except OSError as e:
        error = FlashIOError(f"{call.path}: read of {n} bytes at offset {off} failed: "
                             f"[{errno.errorcode.get(e.errno, e.errno)}] {e.strerror}")
        error.__cause__ = e
    except BaseException as e:  # FlashIOError (short read) or a bug: re-raised in the caller
        error = e
    dest = None  # before the call can be counted over: its caller may resize or free the buffer then
    call.finish(nbytes, nreads, error, worker)
    return True
