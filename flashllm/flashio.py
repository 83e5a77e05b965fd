"""Flash I/O engine: parallel direct (page-cache-free) reads of FFN bundles into preallocated buffers.

N worker threads are started once. Each call coalesces requests into a list of reads that the
threads work through in a loop of blocking ``os.preadv`` calls (which release the GIL), pulling
from one shared iterator so that none idles while reads are left. Rows adjacent in the file become
one read even when their destinations are not (a vectored read), and with ``gap_bytes`` so do rows
separated by at most that many bytes: the gap is read into a junk buffer, because one read through
it costs less than a second read (disk_profile.py measures where that holds). With ``aio_depth > 0`` aligned
direct reads go through Linux native AIO instead (aio.py): the calling thread submits a call's reads
in one syscall, ``aio_depth`` in flight, and reaps them when it waits; no thread is woken, which on
a loaded machine is most of what a small call costs (bench/results/io_pipeline.md). Unaligned
reads still go to the threads. ``read_*`` wait for the reads;
``submit_*`` return a handle to wait on later, so that I/O overlaps compute or the next call.
One Python task per read is measurably slower (bench/io_throughput.py --per-read-tasks).
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import struct
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from flashllm.aio import IOVEC, AioContext, AioJob, AioQueue, device_queue, gathered_iocbs, make_iocbs
from flashllm.read_plan import Reads, split
from flashllm.uring import UringContext
from flashllm.errors import FlashLLMError

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_preadv = os.preadv  # module-level so tests can inject I/O errors
_warned_devices: set = set()  # file systems already warned about (the fallback warns once each)
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()  # False on free-threaded Python: no shared iterator
IO_ENGINES = ("auto", "io_uring", "aio", "preadv")


def io_engine() -> str:
    """$FLASHLLM_IO_ENGINE: "auto" (Linux AIO for readers given an aio_depth, reader threads otherwise), or
    forced: "io_uring" (still Linux AIO where it is missing), "aio" (Linux AIO), "preadv" (reader threads).
    io_uring is not the default: inside the runtime it cost the 7B sparse token more CPU than Linux AIO and
    saved no I/O time, though fio measured its reads cheaper (bench/results/compute_roofline.md, session 8)."""
    choice = os.environ.get("FLASHLLM_IO_ENGINE", "auto").strip().lower() or "auto"
    if choice not in IO_ENGINES:
        raise FlashIOError(f"FLASHLLM_IO_ENGINE={choice!r}: expected one of {', '.join(IO_ENGINES)}")
    return choice


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


def aligned_empty(shape, dtype, align: int = 4096) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align``-byte boundary (for in-place direct reads)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def dio_alignment(path: str) -> tuple[int, int]:
    """(file offset alignment, memory alignment) for direct I/O on ``path``; offset 0 if the FS refuses it.

    Asks statx(STATX_DIOALIGN) (Linux >= 6.1); otherwise the file system block size, a safe upper bound.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.create_string_buffer(256)
            if libc.statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) == 0:
                mask, = struct.unpack_from("=I", buf, 0)
                if mask & _STATX_DIOALIGN:
                    mem, off = struct.unpack_from("=II", buf, 152)  # stx_dio_mem_align, stx_dio_offset_align
                    return off, mem
        except (AttributeError, OSError):
            pass  # no statx in this libc: fall through
    bsize = os.statvfs(path).f_bsize or 512
    return bsize, bsize


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
                    raise _short(call.path, off, n, got)
            elif direct is not False:  # gathered: one file range into several rows (gaps into `junk`)
                got = preadv(fd, [dest[d:d + k] if d >= 0 else junk[:k] for d, k in direct], off)
                if got != n:
                    raise _short(call.path, off, n, got)
            else:  # read the covering aligned range into the bounce buffer and copy out
                a0 = off - off % align
                a1 = -(-(off + n) // align) * align
                got = preadv(fd, (bounce[:a1 - a0],), a0)
                if got < off + n - a0:
                    raise _short(call.path, off, n, max(0, got - (off - a0)))
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


def _short(path: str, off: int, n: int, got: int) -> FlashIOError:
    return FlashIOError(f"{path}: short read at offset {off}: got {got} of {n} bytes (file truncated?)")


def _shutdown(fd: int, queues: list, threads: list, aio: AioQueue | None) -> None:
    for q in queues:
        q.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join()
    if aio is not None:
        aio.close()
    os.close(fd)


class FlashReader:
    """Reads rows (bundles) and ranges of one file with ``threads`` workers, bypassing the page cache.

    ``direct=True`` uses O_DIRECT (Linux) / F_NOCACHE (macOS); where the file system refuses, it warns
    once and falls back to buffered reads plus ``posix_fadvise(DONTNEED)``, like ``direct=False``.
    ``threads``: reads in flight as one blocking preadv per read in each of ``threads`` threads.
    ``aio_depth > 0`` sends aligned reads through the kernel's asynchronous interface from the calling thread
    where it works (Linux, direct I/O), ``aio_depth`` in flight: Linux AIO, or io_uring with the destinations
    registered as fixed buffers (``flashllm.uring``) where $FLASHLLM_IO_ENGINE asks for it (at most
    URING_QUEUE_SHARE of the device's queue in flight). ``engine`` says "aio" (either) or "preadv" (threads),
    ``kernel_io`` which interface ("io_uring", "linux-aio", "preadv"); $FLASHLLM_IO_ENGINE forces one.
    ``gap_bytes``: rows at most this far apart in the file are read with the gap in one read.
    """

    # io_uring reads in flight: at most this share of the device's request queue. Past a full queue a read
    # waits for a request in io_uring's kernel workers, which took the cores from the math: the 7B sparse
    # token's FFN 276-352 ms at 2048 in flight, 70 at 192 (bench/results/compute_roofline.md, session 8).
    URING_QUEUE_SHARE = 0.75

    def __init__(self, path, threads: int = 32, max_chunk_bytes: int = 1 << 20, direct: bool = True,
                 aio_depth: int = 0, gap_bytes: int = 0):
        if threads < 1 or max_chunk_bytes < 1 or aio_depth < 0 or gap_bytes < 0:
            raise FlashIOError(f"{path}: threads and max_chunk_bytes must be >= 1, aio_depth and gap_bytes >= 0, "
                               f"got {threads}, {max_chunk_bytes}, {aio_depth} and {gap_bytes}")
        self.path = os.fspath(path)
        choice = io_engine()
        self.threads, self.max_chunk_bytes = int(threads), int(max_chunk_bytes)
        self.direct, self.alignment, self.mem_alignment = False, 1, 1
        self._fd = self._open(direct)
        self.gap_bytes = min(int(gap_bytes), self.max_chunk_bytes)
        junk = aligned_empty(-(-max(self.gap_bytes, 1) // self.alignment) * self.alignment, np.uint8)
        self._junk, self._junk_addr = memoryview(junk), junk.ctypes.data  # gaps read through land here
        self.size = os.fstat(self._fd).st_size
        bounce_bytes = self.max_chunk_bytes + 2 * self.alignment
        ctx = None
        if self.direct and aio_depth > 0 and choice != "preadv":
            if choice == "io_uring":
                queue_share = max(1, int(device_queue(self.path) * self.URING_QUEUE_SHARE))
                ctx = UringContext.open(min(int(aio_depth), queue_share), self._fd)
            ctx = ctx or AioContext.open(int(aio_depth))
        self._aio = AioQueue(ctx, int(device_queue(self.path) * AioQueue.INLINE_SHARE)) if ctx is not None else None  # None: unavailable, all reads take preadv
        self._ring = ctx if isinstance(ctx, UringContext) else None  # registers destinations as fixed buffers
        self.engine = "aio" if self._aio else "preadv"
        self.kernel_io = "io_uring" if self._ring else "linux-aio" if self._aio else "preadv"
        self.aio_depth = ctx.depth if self._aio else 0
        self._queues = [queue.SimpleQueue() for _ in range(self.threads)]
        self._threads = [
            threading.Thread(target=_worker, name=f"flashio-{i}", daemon=True,
                             args=(self._fd, q, memoryview(aligned_empty(bounce_bytes, np.uint8)), self.alignment))
            for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()
        self._next = 0
        self._help_bounce = memoryview(aligned_empty(bounce_bytes, np.uint8))  # the waiting thread's
        self._help_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _shutdown, self._fd, self._queues, self._threads, self._aio)

    def _open(self, direct: bool) -> int:
        """Open with direct I/O where possible (setting direct/alignment); else buffered, with a warning."""
        try:
            if direct and hasattr(os, "O_DIRECT"):
                off_align, mem_align = dio_alignment(self.path)
                if off_align:
                    fd = None
                    try:
                        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                        probe = aligned_empty(off_align, np.uint8, max(mem_align, 1))
                        _preadv(fd, (probe,), 0)  # some file systems refuse only at read time
                        self.direct, self.alignment, self.mem_alignment = True, off_align, mem_align
                        return fd
                    except OSError as e:
                        if fd is not None:
                            os.close(fd)
                        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                            raise
                self._warn_fallback()
            fd = os.open(self.path, os.O_RDONLY)
            if direct and sys.platform == "darwin":
                import fcntl
                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
                self.direct = True
            elif direct and not hasattr(os, "O_DIRECT"):
                self._warn_fallback()
            if not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return fd
        except FileNotFoundError:
            raise FlashIOError(f"{self.path}: no such file") from None
        except OSError as e:
            raise FlashIOError(f"{self.path}: cannot open: {e.strerror}") from e

    def _warn_fallback(self) -> None:
        try:
            dev = os.stat(self.path).st_dev
        except OSError:
            dev = None
        if dev not in _warned_devices:
            _warned_devices.add(dev)
            warnings.warn(f"{self.path}: the file system does not support direct I/O; using buffered "
                          "reads with posix_fadvise(DONTNEED) (reads may be slower and touch the page "
                          "cache)", RuntimeWarning, stacklevel=4)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    def cpu_seconds(self) -> float:
        """CPU time the reader threads have used so far (Linux, from /proc schedstat; 0.0 elsewhere): the
        cost of the preadv engine's reads to the cores they share with the compute."""
        total = 0
        for t in self._threads:
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total / 1e9

    def close(self) -> None:
        """Stop the workers (after in-flight calls finish) and close the file; safe to call twice."""
        self._finalizer()

    def __enter__(self) -> "FlashReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise FlashIOError(f"{self.path}: read after the reader was closed")

    def read_rows(self, base_offset: int, stride: int, row_bytes: int, indices: np.ndarray,
                  dest: np.ndarray, dest_rows: np.ndarray) -> IOStats:
        """Copy file bytes [base_offset + indices[k]*stride, +row_bytes) into row dest_rows[k] of dest.

        Requests adjacent in the file and in dest are coalesced (up to max_chunk_bytes) when
        row_bytes == stride == dest pitch; only the first row_bytes bytes of each dest row are written.
        """
        return self.submit_rows(base_offset, stride, row_bytes, indices, dest, dest_rows).wait()

    def read_range(self, offset: int, nbytes: int, dest: np.ndarray) -> IOStats:
        """Read file bytes [offset, offset + nbytes) into the first nbytes bytes of dest (C-contiguous)."""
        return self.submit_range(offset, nbytes, dest).wait()

    def submit_rows(self, base_offset: int, stride: int, row_bytes: int, indices: np.ndarray,
                    dest: np.ndarray, dest_rows: np.ndarray) -> PendingRead:
        """Start a read_rows call and return at once (to overlap I/O with compute or with the next call)."""
        t0 = time.perf_counter()
        self._check_open()
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        dest_rows = np.asarray(dest_rows, dtype=np.int64).reshape(-1)
        base_offset, stride, row_bytes = int(base_offset), int(stride), int(row_bytes)
        if not isinstance(dest, np.ndarray) or dest.ndim != 2 or not dest.flags.writeable:
            raise FlashIOError(f"{self.path}: dest must be a writable 2-D numpy array, got "
                               f"{type(dest).__name__} {getattr(dest, 'shape', '')}")
        pitch = dest.strides[0]
        if dest.strides[1] != dest.itemsize or row_bytes > dest.shape[1] * dest.itemsize or pitch <= 0:
            raise FlashIOError(f"{self.path}: dest rows must be contiguous and hold row_bytes={row_bytes}"
                               f" (shape {dest.shape}, dtype {dest.dtype}, strides {dest.strides})")
        if len(indices) != len(dest_rows):
            raise FlashIOError(f"{self.path}: {len(indices)} indices but {len(dest_rows)} dest_rows")
        if len(indices) == 0 or row_bytes == 0:
            return PendingRead(self.path, 0, 0, t0)
        if row_bytes < 0 or stride < 0 or base_offset < 0:
            raise FlashIOError(f"{self.path}: negative base_offset/stride/row_bytes "
                               f"({base_offset}, {stride}, {row_bytes})")
        ascending = bool((indices[1:] >= indices[:-1]).all())  # a cache's missing neurons are
        lo, hi = (int(indices[0]), int(indices[-1])) if ascending else (int(indices.min()), int(indices.max()))
        if lo < 0 or base_offset + hi * stride + row_bytes > self.size:
            bad = lo if lo < 0 else hi
            raise FlashIOError(f"{self.path}: row index {bad} (offset {base_offset + bad * stride}, "
                               f"{row_bytes} bytes) is outside the file of {self.size} bytes")
        if dest_rows.min() < 0 or dest_rows.max() >= dest.shape[0]:
            raise FlashIOError(f"{self.path}: dest_rows must lie in [0, {dest.shape[0]}), got "
                               f"[{dest_rows.min()}, {dest_rows.max()}]")

        if ascending:
            offs, doffs = base_offset + indices * stride, dest_rows * pitch
        else:
            order = np.argsort(indices, kind="stable")
            offs, doffs = base_offset + indices[order] * stride, dest_rows[order] * pitch
        addr = dest.ctypes.data
        if self._ring is not None:
            self._ring.register(dest)
        if self._aio is not None and not self.gap_bytes and len(offs) * row_bytes <= self.max_chunk_bytes and \
                not ((base_offset | stride | row_bytes) % self.alignment or (addr | pitch) % self.mem_alignment):
            call = self._aio_rows(offs, doffs, row_bytes, stride == row_bytes == pitch, addr, dest, t0)
            if call is not None:
                return call
        span = (dest.shape[0] - 1) * pitch + dest.shape[1] * dest.itemsize
        flat = np.lib.stride_tricks.as_strided(dest.view(np.uint8), shape=(span,), strides=(1,))
        if self.max_chunk_bytes < 2 * row_bytes:  # rows alone (cut into max_chunk pieces)
            pieces = split(offs, doffs, np.full(len(offs), row_bytes, dtype=np.int64), self.max_chunk_bytes)
            return self._submit(flat, Reads.simple(*pieces), len(indices) * row_bytes, t0)
        reads = Reads.plan(offs, doffs, row_bytes, self.gap_bytes, self.max_chunk_bytes, gather=True)
        if self.direct and self.alignment > 1 and reads.gathered and not reads.aligned(
                flat.ctypes.data, self.alignment, self.mem_alignment, gathered_only=True):
            reads = Reads.plan(offs, doffs, row_bytes, 0, self.max_chunk_bytes, gather=False)
        return self._submit(flat, reads, len(indices) * row_bytes, t0)

    def submit_range(self, offset: int, nbytes: int, dest: np.ndarray) -> PendingRead:
        """Start a read_range call and return at once; ``wait()`` on the result."""
        t0 = time.perf_counter()
        self._check_open()
        offset, nbytes = int(offset), int(nbytes)
        if not isinstance(dest, np.ndarray) or not dest.flags.c_contiguous or not dest.flags.writeable:
            raise FlashIOError(f"{self.path}: dest must be a writable C-contiguous numpy array")
        if nbytes > dest.nbytes:
            raise FlashIOError(f"{self.path}: dest holds {dest.nbytes} bytes, read needs {nbytes}")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise FlashIOError(f"{self.path}: range at offset {offset} of {nbytes} bytes is outside the "
                               f"file of {self.size} bytes")
        if nbytes == 0:
            return PendingRead(self.path, 0, 0, t0)
        flat = dest.reshape(-1).view(np.uint8)
        one = np.array([0], dtype=np.int64)
        pieces = split(one + offset, one, one + nbytes, self.max_chunk_bytes)
        return self._submit(flat, Reads.simple(*pieces), nbytes, t0)

    def _submit(self, flat: np.ndarray, reads: "Reads", requested: int, t0: float) -> PendingRead:
        """Queue the reads (sorted by file offset) for the workers; the returned handle waits for them."""
        if self.direct and self.alignment > 1:
            inplace = reads.inplace(flat.ctypes.data, self.alignment, self.mem_alignment)
        else:
            inplace = np.ones(len(reads), dtype=bool)
        if self.engine == "aio" and inplace.all():
            return self._submit_aio(flat, reads, requested, t0)
        nw = min(self.threads, len(reads))
        # Issue the reads as nw interleaved sequential streams (like fio's parallel sequential jobs),
        # which measured up to 1.8x faster here than all threads walking one stream.
        per = -(-len(reads) // nw)
        order = np.arange(per * nw).reshape(nw, per).T.reshape(-1)
        order = order[order < len(reads)]
        mode = inplace.tolist()  # True: straight into dest; False: through the bounce buffer
        for r in np.flatnonzero(reads.piece_count() > 1).tolist():  # gathered: (dest offset or -1, bytes) pieces
            mode[r] = reads.pieces_of(r)
        cols = [a[order].tolist() for a in (reads.off, reads.doff, reads.len)] + [[mode[k] for k in order.tolist()]]
        fadvise = None
        if not self.direct and hasattr(os, "posix_fadvise"):
            lo = int(reads.off.min())
            fadvise = (self._fd, lo, int((reads.off + reads.len).max()) - lo)
        shared = zip(*cols)
        call = PendingRead(self.path, nw, requested, t0, fadvise, total=len(reads),
                           helper=(lambda: self._help(call, shared)) if _GIL else None)
        call.dest = memoryview(flat)
        # Work-sharing: all workers pull from one iterator, so none idles while reads are left (no straggler
        # tail). next() on a zip of list iterators is atomic under the GIL; do not put map() or anything that
        # allocates between the items in here: a GC run mid-item can switch threads and mix up reads.
        for w in range(nw):
            share = shared if _GIL else zip(*(c[w::nw] for c in cols))  # free-threaded: fixed shares
            self._queues[(self._next + w) % self.threads].put((call, share, self._junk))
        self._next = (self._next + nw) % self.threads
        return call

    def _help(self, call: PendingRead, shared) -> None:
        """The waiting thread takes reads of its call from the shared iterator too (unless another one is
        helping: the bounce buffer is one)."""
        if self._help_lock.acquire(blocking=False):
            try:
                _serve(self._fd, self._help_bounce, self.alignment, (call, shared, self._junk), worker=False)
            finally:
                self._help_lock.release()

    def _aio_rows(self, offs: np.ndarray, doffs: np.ndarray, row_bytes: int, joinable: bool, addr: int,
                  dest: np.ndarray, t0: float) -> PendingRead | None:
        """The sparse decode's call in few numpy operations (no read plan): aligned rows at sorted file
        offsets `offs` bound for dest offsets `doffs`, AIO, no gap-filling, at most one max chunk in all;
        with `joinable` (rows as wide as their stride and dest pitch), rows adjacent in the file and in
        dest are one read. None when file-adjacent rows go to rows apart (a vectored read: `Reads.plan`)."""
        n = len(offs)
        lens = None
        if joinable and n > 1:
            start = np.empty(n, dtype=bool)
            start[0] = True
            np.not_equal(np.diff(offs), row_bytes, out=start[1:])
            apart = np.diff(doffs) != row_bytes
            if (apart > start[1:]).any():
                return None
            first = np.flatnonzero(start)
            if len(first) < n:
                lens = np.diff(np.append(first, n)) * row_bytes
                offs, doffs = offs[first], doffs[first]
        if lens is None:
            lens = np.full(len(offs), row_bytes, dtype=np.int64)
        iocbs = make_iocbs(self._fd, doffs.astype(np.uint64) + np.uint64(addr), offs, lens)
        return self._aio_call(iocbs, offs, lens, n * row_bytes, t0, dest)

    def _submit_aio(self, flat: np.ndarray, reads: "Reads", requested: int, t0: float) -> PendingRead:
        """Submit the reads to the AIO queue from this thread; the returned handle reaps them when waited on."""
        base = flat.ctypes.data
        if self._ring is not None:
            self._ring.register(flat)
        iocbs = make_iocbs(self._fd, base + reads.doff.astype(np.uint64), reads.off, reads.len)
        iovecs = None
        multi = np.flatnonzero(reads.piece_count() > 1)
        if len(multi):  # gathered reads: IOCB_CMD_PREADV over an iovec array
            iovecs = np.zeros(len(reads.p_len), dtype=IOVEC)
            iovecs["base"] = np.where(reads.p_doff >= 0, base + reads.p_doff, self._junk_addr).astype(np.uint64)
            iovecs["len"] = reads.p_len
            gathered_iocbs(iocbs, multi, iovecs, reads.p_start)
        return self._aio_call(iocbs, reads.off, reads.len, requested, t0, (flat, iovecs))

    def _aio_call(self, iocbs: np.ndarray, offs: np.ndarray, lens: np.ndarray, requested: int, t0: float,
                  keep) -> PendingRead:
        """Queue `iocbs` (reads of `lens` bytes at file offsets `offs`) as one call; `keep`: what they read
        into, held until they are back."""
        call = PendingRead(self.path, 1, requested, t0, driver=self._aio)

        def describe(k: int, res: int | None, exc: OSError | None = None) -> FlashIOError:
            off, n = int(offs[k]), int(lens[k])
            if exc is not None:
                return FlashIOError(f"{self.path}: {len(offs) - k} reads from offset {off} could not be submitted: "
                                    f"{exc.strerror}")
            if res >= 0:
                return _short(self.path, off, n, res)
            return FlashIOError(f"{self.path}: read of {n} bytes at offset {off} failed: "
                                f"[{errno.errorcode.get(-res, -res)}] {os.strerror(-res)}")

        call._job = AioJob(iocbs, lens.astype(np.int64), call.finish, describe, keep)
        self._aio.add(call._job)
        return call
