"""Linux native AIO (io_submit/io_getevents) through ctypes: many direct reads per GIL release.

A flash reader thread that calls ``os.preadv`` once per 16 KiB bundle spends most of its time
handing the GIL back and forth; with AIO a thread submits a batch of reads in one syscall and
reaps them in another, with the request records built by numpy. Only used for O_DIRECT reads
(buffered AIO is synchronous) on little-endian Linux; ``AioContext.open`` returns None elsewhere.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

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
    """Read requests (one per element) as an array of struct iocb; ``data`` holds each one's index."""
    iocbs = np.zeros(len(lens), dtype=IOCB)
    iocbs["data"] = np.arange(len(lens))
    iocbs["opcode"] = _CMD_PREAD
    iocbs["fildes"] = fd
    iocbs["buf"] = buf_addrs
    iocbs["nbytes"] = lens
    iocbs["offset"] = file_offs
    return iocbs


def gathered_iocbs(iocbs: np.ndarray, which: np.ndarray, iovecs: np.ndarray, first: np.ndarray) -> None:
    """Turn iocbs[which] into vectored reads: read k scatters into iovecs[first[k]:first[k + 1]]."""
    iocbs["opcode"][which] = _CMD_PREADV
    iocbs["buf"][which] = iovecs.ctypes.data + first[which].astype(np.uint64) * IOVEC.itemsize
    iocbs["nbytes"][which] = first[which + 1] - first[which]


class AioContext:
    """One kernel AIO context with room for ``depth`` reads in flight (one per reader thread)."""

    def __init__(self, ctx: int, depth: int):
        self.ctx, self.depth = ctx, depth
        self.events = np.zeros(depth, dtype=EVENT)
        self._ptrs = np.zeros(depth, dtype=np.uint64)

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

    def submit(self, iocbs: np.ndarray) -> None:
        """Queue all of ``iocbs`` (a contiguous slice of an iocb array); raises OSError if the kernel refuses."""
        n = len(iocbs)
        ptrs = self._ptrs[:n]
        ptrs[:] = iocbs.ctypes.data + np.arange(n, dtype=np.uint64) * IOCB.itemsize
        done = 0
        while done < n:
            got = _LIBC.syscall(_SUBMIT, ctypes.c_ulong(self.ctx), ctypes.c_long(n - done),
                                ctypes.c_void_p(ptrs.ctypes.data + 8 * done))
            if got < 0:
                err = ctypes.get_errno()
                if err != errno.EINTR:
                    raise OSError(err, os.strerror(err))
                continue
            done += got

    def reap(self, min_nr: int, max_nr: int) -> np.ndarray:
        """Wait until at least ``min_nr`` submitted reads are done; their io_events (at most ``max_nr``)."""
        while True:
            got = _LIBC.syscall(_GETEVENTS, ctypes.c_ulong(self.ctx), ctypes.c_long(min_nr),
                                ctypes.c_long(max_nr), ctypes.c_void_p(self.events.ctypes.data), None)
            if got >= 0:
                return self.events[:got]
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))  # cannot happen with a valid context
