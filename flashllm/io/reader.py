"""Flash I/O engine: parallel direct (page-cache-free) reads of FFN bundles into preallocated buffers.

N worker threads are started once. Each call coalesces requests into a list of reads that the
threads work through in a loop of blocking ``os.preadv`` calls (which release the GIL), pulling
from one shared iterator so that none idles while reads are left. Rows adjacent in the file become
one read even when their destinations are not (a vectored read), and with ``gap_bytes`` so do rows
separated by at most that many bytes: the gap is read into a junk buffer, because one read through
it costs less than a second read (flashllm/io/disk_profile.py measures where that holds). With ``aio_depth > 0`` aligned
direct reads go through Linux native AIO instead (flashllm/io/aio.py): the calling thread submits a call's reads
in one syscall, ``aio_depth`` in flight, and reaps them when it waits; no thread is woken, which on
a loaded machine is most of what a small call costs. Unaligned
reads still go to the threads. ``read_*`` wait for the reads;
``submit_*`` return a handle to wait on later, so that I/O overlaps compute or the next call.
One Python task per read would cost more than the read itself at these sizes.

Here: `FlashReader` (opening, checking and planning a call, choosing its engine); the reader threads are
in flashllm/io/threads.py, the AIO submission in flashllm/io/aio_engine.py, a call's handle and stats in flashllm/io/call.py.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import time
import warnings
import weakref

import numpy as np

from flashllm.io.aio import AioContext, AioQueue, device_queue
from flashllm.io.aio_engine import AioReads
from flashllm.io.call import FlashIOError, IOStats, PendingRead  # noqa: F401  (re-exported)
from flashllm.io.threads import ReaderThreads
from flashllm.io.read_list import Reads, split
from flashllm.io.uring import UringContext
from flashllm.hugepages import aligned_empty

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_warned_devices: set = set()  # file systems already warned about (the fallback warns once each)
IO_ENGINES = ("auto", "io_uring", "aio", "preadv")


def io_engine() -> str:
    """$FLASHLLM_IO_ENGINE: "auto" (Linux AIO for readers given an aio_depth, reader threads otherwise), or
    forced: "io_uring" (still Linux AIO where it is missing), "aio" (Linux AIO), "preadv" (reader threads).
    io_uring is not the default: inside the runtime a large sparse model's decode token took more CPU with it
    than with Linux AIO and no less I/O time, though its reads alone are cheaper (docs/benchmarks.md)."""
    choice = os.environ.get("FLASHLLM_IO_ENGINE", "auto").strip().lower() or "auto"
    if choice not in IO_ENGINES:
        raise FlashIOError(f"FLASHLLM_IO_ENGINE={choice!r}: expected one of {', '.join(IO_ENGINES)}")
    return choice


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


def _shutdown(fd: int, workers: ReaderThreads, aio: AioReads | None) -> None:
    workers.stop()
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
    registered as fixed buffers (``flashllm.io.uring``) where $FLASHLLM_IO_ENGINE asks for it (at most
    URING_QUEUE_SHARE of the device's queue in flight). ``engine`` says "aio" (either) or "preadv" (threads),
    ``kernel_io`` which interface ("io_uring", "linux-aio", "preadv"); $FLASHLLM_IO_ENGINE forces one.
    ``gap_bytes``: rows at most this far apart in the file are read with the gap in one read.
    """

    # io_uring reads in flight: at most this share of the device's request queue. Past a full queue a read
    # waits for a request in io_uring's kernel workers, which take the cores from the math (a large sparse
    # model's FFN step ran several times slower with thousands of reads in flight than within the queue).
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
        junk = aligned_empty(-(-max(self.gap_bytes, 1) // self.alignment) * self.alignment, np.uint8)  # gaps land here
        self.size = os.fstat(self._fd).st_size
        bounce_bytes = self.max_chunk_bytes + 2 * self.alignment
        ctx = None
        if self.direct and aio_depth > 0 and choice != "preadv":
            if choice == "io_uring":
                queue_share = max(1, int(device_queue(self.path) * self.URING_QUEUE_SHARE))
                ctx = UringContext.open(min(int(aio_depth), queue_share), self._fd)
            ctx = ctx or AioContext.open(int(aio_depth))
        self._aio = AioReads(self._fd, self.path, ctx, int(device_queue(self.path) * AioQueue.INLINE_SHARE),
                             junk.ctypes.data) if ctx is not None else None  # None: unavailable, all reads take preadv
        self.engine = "aio" if self._aio else "preadv"
        self.kernel_io = "io_uring" if self._aio and self._aio.ring else "linux-aio" if self._aio else "preadv"
        self.aio_depth = self._aio.depth if self._aio else 0
        bounces = [memoryview(aligned_empty(bounce_bytes, np.uint8)) for _ in range(self.threads + 1)]  # +1: waiter
        self._workers = ReaderThreads(self._fd, self.path, bounces, self.alignment, memoryview(junk))
        self._finalizer = weakref.finalize(self, _shutdown, self._fd, self._workers, self._aio)

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
                        os.preadv(fd, (probe,), 0)  # some file systems refuse only at read time
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
        return self._workers.cpu_seconds()

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
        if self._aio is not None:
            self._aio.register(dest)
        if self._aio is not None and not self.gap_bytes and len(offs) * row_bytes <= self.max_chunk_bytes and \
                not ((base_offset | stride | row_bytes) % self.alignment or (addr | pitch) % self.mem_alignment):
            call = self._aio.rows(offs, doffs, row_bytes, stride == row_bytes == pitch, addr, dest, t0)
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
        """Queue the reads (sorted by file offset) for AIO or the reader threads; the returned handle waits for them."""
        if self.direct and self.alignment > 1:
            inplace = reads.inplace(flat.ctypes.data, self.alignment, self.mem_alignment)
        else:
            inplace = np.ones(len(reads), dtype=bool)
        if self.engine == "aio" and inplace.all():
            return self._aio.submit(flat, reads, requested, t0)
        fadvise = None
        if not self.direct and hasattr(os, "posix_fadvise"):
            lo = int(reads.off.min())
            fadvise = (self._fd, lo, int((reads.off + reads.len).max()) - lo)
        return self._workers.submit(flat, reads, inplace, requested, t0, fadvise)
