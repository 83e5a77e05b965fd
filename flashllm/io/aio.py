"""Linux native AIO (io_submit/io_getevents) through ctypes: many direct reads per syscall, no threads.

Reader threads that call ``os.preadv`` once per bundle spend their time handing the GIL back and
forth and, on a loaded machine, waiting to be scheduled: every call wakes several of them. With AIO
the calling thread submits a call's reads in one syscall and, when it waits, reaps them in another
(``AioQueue``), with the request records built by numpy. Only used for O_DIRECT reads (buffered AIO
is synchronous) on little-endian Linux; ``AioContext.open`` returns None elsewhere.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from collections import deque

import numpy as np

# struct iocb and struct io_event of linux/aio_abi.h (little-endian field order)
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])  # struct iovec
_CMD_PREAD, _CMD_PREADV = 0, 7
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}  # setup, destroy, submit, getevents


def _libc():
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or platform.machine() not in _SYSCALLS:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
        libc.syscall.restype = ctypes.c_long
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_SETUP, _DESTROY, _SUBMIT, _GETEVENTS = _SYSCALLS.get(platform.machine(), (None,) * 4)


def make_iocbs(fd: int, buf_addrs: np.ndarray, file_offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Read requests (one per element) as an array of struct iocb (``data`` is set by ``AioQueue.add``).
    Filled as 64-bit words (the opcode, reqprio and fildes fields share word 2), which takes a few
    microseconds against tens for the structured fields one by one: a sparse token makes one per layer."""
    words = np.zeros((len(lens), IOCB.itemsize // 8), dtype=np.uint64)
    words[:, 2] = (int(fd) << 32) | _CMD_PREAD
    words[:, 3] = buf_addrs
    words[:, 4] = lens
    words[:, 5] = file_offs
    return words.view(IOCB).reshape(len(lens))


def gathered_iocbs(iocbs: np.ndarray, which: np.ndarray, iovecs: np.ndarray, first: np.ndarray) -> None:
    """Turn iocbs[which] into vectored reads: read k scatters into iovecs[first[k]:first[k + 1]]."""
    iocbs["opcode"][which] = _CMD_PREADV
    iocbs["buf"][which] = iovecs.ctypes.data + first[which].astype(np.uint64) * IOVEC.itemsize
    iocbs["nbytes"][which] = first[which + 1] - first[which]


class AioContext:
    """One kernel AIO context with room for ``depth`` reads in flight."""

    def __init__(self, ctx: int, depth: int):
        self.ctx, self.depth = ctx, depth
        self.events = np.zeros(depth, dtype=EVENT)
        self._ptrs = np.zeros(depth, dtype=np.uint64)
        self._steps = np.arange(depth, dtype=np.uint64) * np.uint64(IOCB.itemsize)  # iocb k at base + _steps[k]
        self._ctx, self._events_at = ctypes.c_ulong(ctx), ctypes.c_void_p(self.events.ctypes.data)

    @classmethod
    def open(cls, depth: int) -> "AioContext | None":
        """A new context, or None where native AIO is unavailable (not Linux, seccomp, aio-max-nr reached)."""
        if _LIBC is None:
            return None
        ctx = ctypes.c_ulong(0)
        if _LIBC.syscall(_SETUP, ctypes.c_long(depth), ctypes.byref(ctx)) != 0:
            return None
        return cls(ctx.value, depth)

    def close(self) -> None:
        if self.ctx:
            _LIBC.syscall(_DESTROY, ctypes.c_ulong(self.ctx))
            self.ctx = 0

    def submit(self, iocbs: np.ndarray) -> int:
        """Queue ``iocbs`` (a contiguous slice of an iocb array); returns how many the kernel took (all, or
        those before it refused); raises OSError if it took none."""
        n = len(iocbs)
        if len(self._ptrs) < n:
            self._ptrs = np.zeros(n, dtype=np.uint64)
            self._steps = np.arange(n, dtype=np.uint64) * np.uint64(IOCB.itemsize)
        ptrs = self._ptrs[:n]
        np.add(self._steps[:n], np.uint64(iocbs.ctypes.data), out=ptrs)
        at, done = ptrs.ctypes.data, 0
        while done < n:
            got = _LIBC.syscall(_SUBMIT, self._ctx, ctypes.c_long(n - done), ctypes.c_void_p(at + 8 * done))
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if done:
                    return done
                raise OSError(err, os.strerror(err))
            done += got
        return done

    def reap(self, min_nr: int, max_nr: int) -> np.ndarray:
        """Wait until at least ``min_nr`` submitted reads are done; their io_events (at most ``max_nr``)."""
        while True:
            got = _LIBC.syscall(_GETEVENTS, self._ctx, ctypes.c_long(min_nr), ctypes.c_long(max_nr),
                                self._events_at, None)
            if got >= 0:
                return self.events[:got]
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))  # cannot happen with a valid context


class AioJob:
    """The reads of one engine call in an AioQueue: iocbs[:submitted] went to the kernel, `done` came back."""

    def __init__(self, iocbs: np.ndarray, want: np.ndarray, finish, describe, keep):
        self.iocbs, self.want, self.finish, self.describe, self.keep = iocbs, want, finish, describe, keep
        self.submitted = self.done = self.nbytes = 0  # reads taken by the kernel, reaped, bytes they read
        self.error: BaseException | None = None
        self.finished = False

    @property
    def over(self) -> bool:
        """Every read submitted came back, and none is left to submit (or an error stopped submitting)."""
        return self.done == self.submitted and (self.error is not None or self.submitted == len(self.iocbs))


class AioQueue:
    """One AIO context shared by a reader's calls. `add` submits what the device queue takes without
    sleeping and leaves the rest of a call to a submitter thread: io_submit sleeps in the kernel while
    the block device's request queue is full (typically 256 requests, fewer than a large layer's reads),
    and the generating thread should be computing meanwhile. Whoever
    waits for a call (`progress`) first submits what is left of it itself, then reaps completions in one
    sleeping syscall and credits them to their calls (``data`` = call id << 32 | read index). A failed
    call stops submitting but reaps what it has in flight before it finishes, so no read lands in a
    buffer its caller already gave up.

    Locks: ``lock`` guards the bookkeeping (never held in a syscall); ``submitting`` is held by the one
    thread in io_submit, ``reaping`` by the one in io_getevents."""

    INLINE_SHARE = 0.5  # of the device queue: the reads `add` submits itself, without sleeping
    SUBMITTER_NICE = 0  # the submitter thread's nice relative to the process (Linux)

    def __init__(self, ctx: AioContext, inline: int = 64):
        """`inline`: the most reads in flight after `add` submitted from the calling thread (about half the
        device's request queue, `device_queue`, leaves room for other I/O)."""
        self.ctx, self.inline = ctx, max(1, int(inline))
        self.lock = threading.Lock()
        self.submitting, self.reaping = threading.Lock(), threading.Lock()
        self._work = threading.Condition(self.lock)  # the submitter thread waits here for reads and room
        self.jobs: dict[int, AioJob] = {}
        self.waiting: deque = deque()  # jobs with reads left to submit, oldest first
        self.inflight, self._next = 0, 0  # reads counted in the kernel (submitted, not reaped)
        self._thread: threading.Thread | None = None
        self._closing = False

    def add(self, job: AioJob) -> None:
        with self.lock:
            jid, self._next = self._next, (self._next + 1) & 0xFFFFFFFF
            job.iocbs["data"] = (np.uint64(jid) << np.uint64(32)) | np.arange(len(job.iocbs), dtype=np.uint64)
            self.jobs[jid] = job
            self.waiting.append(job)
        self._submit(self.inline, block=False)
        with self.lock:
            if self.waiting:  # more than the device queue takes at once: the rest goes in the background
                if self._thread is None:
                    self._thread = threading.Thread(target=self._submitter, name="flashio-aio-submit", daemon=True)
                    self._thread.start()
                self._work.notify()

    def progress(self, block: bool = True, job: AioJob | None = None) -> None:
        """Reap what has completed (with `block`, at least one read, if any is in flight; when waiting for
        `job`, all of its reads in flight, so that the waiter wakes once); a waiter first submits what
        is left of its `job` (and of older calls) itself."""
        if block and job is not None and job.submitted < len(job.iocbs) and job.error is None:
            self._submit(None, block=True, until=job)
        if not self.reaping.acquire(blocking=block):
            return  # another thread is reaping: a poll finds nothing to do
        try:
            with self.lock:
                self._finish_over()
                if not self.inflight or (job is not None and job.finished):
                    return
                want = 1 if not block else min(self.inflight, max(1, job.submitted - job.done)) if job else 1
                count = self.inflight
            try:
                events, failed = self.ctx.reap(want if block else 0, count), None
            except OSError as e:  # the context itself failed: fail every call that has reads in flight
                events, failed = self.ctx.events[:0], e
            with self.lock:
                if failed is not None:
                    for j in self.jobs.values():
                        j.error = j.error or failed
                        j.done = j.submitted
                    self.inflight = 0
                self.inflight -= len(events)
                self._credit(events)
                self._finish_over()
                self._work.notify()  # room in the context for the submitter
        finally:
            self.reaping.release()

    def _submit(self, limit: int | None, block: bool, until: AioJob | None = None) -> None:
        """Submit waiting reads, oldest call first, while the context has room: with `limit`, until that
        many are in flight; with `until`, until that call's reads are all submitted; with `block` False
        only if no other thread is submitting. The syscall runs outside `lock` (it may sleep)."""
        if not self.submitting.acquire(blocking=block):
            return
        try:
            while True:
                with self.lock:
                    while self.waiting and (self.waiting[0].error is not None or
                                            self.waiting[0].submitted == len(self.waiting[0].iocbs)):
                        self.waiting.popleft()
                    room = self.ctx.depth - self.inflight
                    if limit is not None:
                        room = min(room, limit - self.inflight)
                    if not self.waiting or room <= 0 or (until is not None and (until.error is not None or
                                                                                until.submitted == len(until.iocbs))):
                        return
                    job = self.waiting[0]
                    batch = job.iocbs[job.submitted:job.submitted + room]
                try:
                    got, error = self.ctx.submit(batch), None
                except OSError as e:  # refused (e.g. EAGAIN): the call fails once its reads in flight are back
                    got, error = 0, e
                with self.lock:
                    if error is not None:
                        job.error = job.describe(job.submitted, None, error)
                    job.submitted += got
                    self.inflight += got
                    self._finish_over()
        finally:
            self.submitting.release()

    def _submitter(self) -> None:
        """The background thread: submits calls' reads beyond what `add` submitted (sleeping in io_submit
        while the device queue is full, and waiting for room in the context)."""
        while True:
            with self.lock:
                while not self._closing and not (self.waiting and self.inflight < self.ctx.depth):
                    self._work.wait()
                if self._closing:
                    return
            self._submit(None, block=True)

    def _credit(self, events: np.ndarray) -> None:
        if not len(events):
            return
        ids = (events["data"] >> np.uint64(32)).astype(np.int64)
        index = (events["data"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        one = ids[0] == ids[-1] and (ids == ids[0]).all()  # mostly: the reads of the one call waited for
        for jid in ids[:1].tolist() if one else np.unique(ids).tolist():
            job, mine = self.jobs[jid], slice(None) if one else ids == jid
            res, k = events["res"][mine], index[mine]
            job.done += len(res)
            bad = np.flatnonzero(res != job.want[k])
            if len(bad) and job.error is None:
                job.error = job.describe(int(k[bad[0]]), int(res[bad[0]]))
            job.nbytes += int(res[res > 0].sum())

    def _finish_over(self) -> None:
        """Finish the calls that are over (under `lock`)."""
        for jid in [j for j, job in self.jobs.items() if job.over]:
            job = self.jobs.pop(jid)
            job.finished = True
            job.finish(job.nbytes, job.done, job.error)
            job.keep = None

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self._work.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self.reaping, self.lock:
            while self.inflight:  # never free buffers the kernel still writes into
                self.inflight -= len(self.ctx.reap(1, self.inflight))
            for job in self.jobs.values():  # calls never submitted in full fail rather than hang
                job.error = job.error or job.describe(job.submitted, None, OSError(errno.EBADF, "reader closed"))
                job.done = job.submitted
            self._finish_over()
            self.ctx.close()


def device_queue(path: str, default: int = 128) -> int:
    """Requests the block device under `path` queues before a submitter sleeps (sysfs nr_requests; `default`
    where unknown)."""
    try:
        st = os.stat(path)
        dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        for q in (f"{dev}/queue/nr_requests", f"{dev}/../queue/nr_requests"):  # a disk, or a partition's disk
            if os.path.exists(q):
                with open(q) as f:
                    return max(1, int(f.read()))
    except (OSError, ValueError):
        pass
    return default
