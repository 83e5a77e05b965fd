"""FlashReader's reads through the kernel's asynchronous interface (Linux AIO or io_uring), submitted by the caller."""

from __future__ import annotations

import errno
import os

import numpy as np

from flashllm.io.aio import IOVEC, AioContext, AioJob, AioQueue, gathered_iocbs, make_iocbs
from flashllm.io.call import FlashIOError, PendingRead, short_read
from flashllm.io.read_list import Reads
from flashllm.io.uring import UringContext


class AioReads:
    """Aligned direct reads of one open file (`fd`) through `ctx` (Linux AIO, or io_uring with the destinations
    registered as fixed buffers): the calling thread submits a call's reads, up to `inline` of them in flight
    (the AioQueue's submitter the rest), and reaps them when it waits; gaps read through land at `junk_addr`."""

    def __init__(self, fd: int, path: str, ctx: AioContext | UringContext, inline: int, junk_addr: int):
        self.fd, self.path, self.junk_addr = fd, path, junk_addr
        self.queue = AioQueue(ctx, inline)
        self.ring = ctx if isinstance(ctx, UringContext) else None  # registers destinations as fixed buffers
        self.depth = ctx.depth

    def register(self, dest: np.ndarray) -> None:
        """Make `dest` a fixed buffer of the io_uring ring (Linux AIO needs nothing)."""
        if self.ring is not None:
            self.ring.register(dest)

    def rows(self, offs: np.ndarray, doffs: np.ndarray, row_bytes: int, joinable: bool, addr: int,
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
        iocbs = make_iocbs(self.fd, doffs.astype(np.uint64) + np.uint64(addr), offs, lens)
        return self._call(iocbs, offs, lens, n * row_bytes, t0, dest)

    def submit(self, flat: np.ndarray, reads: "Reads", requested: int, t0: float) -> PendingRead:
        """Submit the reads to the AIO queue from this thread; the returned handle reaps them when waited on."""
        base = flat.ctypes.data
        self.register(flat)
        iocbs = make_iocbs(self.fd, base + reads.doff.astype(np.uint64), reads.off, reads.len)
        iovecs = None
        multi = np.flatnonzero(reads.piece_count() > 1)
        if len(multi):  # gathered reads: IOCB_CMD_PREADV over an iovec array
            iovecs = np.zeros(len(reads.p_len), dtype=IOVEC)
            iovecs["base"] = np.where(reads.p_doff >= 0, base + reads.p_doff, self.junk_addr).astype(np.uint64)
            iovecs["len"] = reads.p_len
            gathered_iocbs(iocbs, multi, iovecs, reads.p_start)
        return self._call(iocbs, reads.off, reads.len, requested, t0, (flat, iovecs))

    def _call(self, iocbs: np.ndarray, offs: np.ndarray, lens: np.ndarray, requested: int, t0: float,
              keep) -> PendingRead:
        """Queue `iocbs` (reads of `lens` bytes at file offsets `offs`) as one call; `keep`: what they read
        into, held until they are back."""
        call = PendingRead(self.path, 1, requested, t0, driver=self.queue)

        def describe(k: int, res: int | None, exc: OSError | None = None) -> FlashIOError:
            off, n = int(offs[k]), int(lens[k])
            if exc is not None:
                return FlashIOError(f"{self.path}: {len(offs) - k} reads from offset {off} could not be submitted: "
                                    f"{exc.strerror}")
            if res >= 0:
                return short_read(self.path, off, n, res)
            return FlashIOError(f"{self.path}: read of {n} bytes at offset {off} failed: "
                                f"[{errno.errorcode.get(-res, -res)}] {os.strerror(-res)}")

        call._job = AioJob(iocbs, lens.astype(np.int64), call.finish, describe, keep)
        self.queue.add(call._job)
        return call

    def close(self) -> None:
        self.queue.close()
