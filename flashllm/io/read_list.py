"""How one engine call's rows become reads: coalescing file-adjacent rows (vectored when their
destinations are apart), gap-filling, and the max-chunk and iovec limits. Pure numpy, no I/O."""

from __future__ import annotations

import numpy as np


def split(file_offs: np.ndarray, dest_offs: np.ndarray, lens: np.ndarray, max_chunk: int):
    """Cut every (file offset, dest offset, length) piece longer than ``max_chunk`` into max_chunk pieces."""
    pieces = -(-lens // max_chunk)
    if np.all(pieces == 1):
        return file_offs, dest_offs, lens
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    within = (np.arange(int(pieces.sum())) - first) * max_chunk
    lens = np.minimum(np.repeat(lens, pieces) - within, max_chunk)
    return np.repeat(file_offs, pieces) + within, np.repeat(dest_offs, pieces) + within, lens


class Reads:
    """The reads of one call: file range (off, len) each, landing at dest offset doff, or (gathered reads,
    piece_count > 1) split into pieces p_start[r]:p_start[r+1] of (p_doff, p_len); p_doff -1 is a gap read
    into the junk buffer. Sorted by file offset."""

    MAX_PIECES = 1000  # below IOV_MAX (1024) iovecs per preadv

    def __init__(self, off, doff, lens, p_start=None, p_doff=None, p_len=None):
        self.off, self.doff, self.len = off, doff, lens
        n = len(off)
        self.p_start = np.arange(n + 1) if p_start is None else p_start
        self.p_doff = doff if p_doff is None else p_doff
        self.p_len = lens if p_len is None else p_len
        self.p_off = off if p_start is None else None
        self.gathered = p_start is not None and len(self.p_len) > n
        self._inplace = None  # ((addr, align, mem_align), `inplace`'s answer)

    def __len__(self) -> int:
        return len(self.off)

    @classmethod
    def simple(cls, off, doff, lens) -> "Reads":
        return cls(off, doff, lens)

    @classmethod
    def plan(cls, offs, doffs, row_bytes: int, gap: int, max_chunk: int, gather: bool) -> "Reads":
        """Reads covering rows at sorted file offsets ``offs`` (``row_bytes`` each) bound for ``doffs``.

        A row joins the previous one's read when the file gap between them is at most ``gap`` bytes
        (read through into junk) and, without ``gather``, only when it follows it in the file and in
        dest; a read spans at most ``max_chunk`` bytes and MAX_PIECES // 2 rows."""
        n = len(offs)
        ends = offs + row_bytes
        g = offs[1:] - ends[:-1]
        if row_bytes <= max_chunk and not (g <= gap).any():  # no two rows close: one read each (sparse decode)
            return cls(offs, doffs, np.full(n, row_bytes, dtype=np.int64))
        join = (g >= 0) & (g <= gap) if gather else (g == 0) & (np.diff(doffs) == row_bytes)
        brk = np.ones(n, dtype=bool)
        brk[1:] = ~join
        starts = np.flatnonzero(brk)
        stops = np.append(starts[1:], n)  # one past each read's last row
        if (ends[stops - 1] - offs[starts]).max() > max_chunk or (stops - starts).max() > cls.MAX_PIECES // 2:
            run = np.cumsum(brk) - 1  # cut the runs too long for one read
            step = max_chunk - row_bytes + 1  # rows starting within one step of their read's start fit max_chunk
            key = (offs - offs[starts][run]) // step
            pos = (np.arange(n) - starts[run]) // (cls.MAX_PIECES // 2)
            brk[1:] |= (key[1:] != key[:-1]) | (pos[1:] != pos[:-1])
            starts = np.flatnonzero(brk)
            stops = np.append(starts[1:], n)
        off = offs[starts]
        lens = ends[stops - 1] - off
        if not gather:
            return cls(off, doffs[starts], lens)
        gap_before = np.zeros(n, dtype=np.int64)
        gap_before[1:] = g
        gap_before[brk] = 0
        new_piece = brk.copy()
        new_piece[1:] |= (gap_before[1:] > 0) | (np.diff(doffs) != row_bytes)
        rp = np.flatnonzero(new_piece)
        gp = np.flatnonzero(gap_before > 0)
        if not len(gp):  # no gap read through: the pieces are the runs of rows, in file order already
            reads = cls(off, doffs[starts], lens, np.append(np.flatnonzero(brk[rp]), len(rp)), doffs[rp],
                        np.diff(np.append(rp, n)) * row_bytes)
            reads.p_off = offs[rp]
            return reads
        p_off = np.concatenate([offs[rp], ends[gp - 1]])
        p_len = np.concatenate([np.diff(np.append(rp, n)) * row_bytes, gap_before[gp]])
        p_doff = np.concatenate([doffs[rp], np.full(len(gp), -1, dtype=np.int64)])
        read_of = np.cumsum(brk) - 1
        p_read = np.concatenate([read_of[rp], read_of[gp]])
        order = np.lexsort((p_off, p_read))
        p_off, p_len, p_doff, p_read = p_off[order], p_len[order], p_doff[order], p_read[order]
        p_start = np.searchsorted(p_read, np.arange(len(starts) + 1))
        reads = cls(off, doffs[starts], lens, p_start, p_doff, p_len)
        reads.p_off = p_off
        return reads

    def piece_count(self) -> np.ndarray:
        return np.diff(self.p_start)

    def pieces_of(self, r: int) -> tuple:
        a, b = self.p_start[r], self.p_start[r + 1]
        return tuple(zip(self.p_doff[a:b].tolist(), self.p_len[a:b].tolist()))

    def inplace(self, addr: int, align: int, mem_align: int) -> np.ndarray:
        """Per read: can it go straight into dest with direct I/O (every piece aligned)? (Kept for the
        same arguments: `aligned` and the engine's submit ask in turn.)"""
        if self._inplace is None or self._inplace[0] != (addr, align, mem_align):
            ok = self._piece_ok(addr, align, mem_align)
            self._inplace = (addr, align, mem_align), \
                np.minimum.reduceat(ok, self.p_start[:-1]).astype(bool) if len(ok) else ok.astype(bool)
        return self._inplace[1]

    def aligned(self, addr: int, align: int, mem_align: int, gathered_only: bool = False) -> bool:
        """Whether every piece (of the gathered reads only, if asked) suits direct I/O."""
        ok = self.inplace(addr, align, mem_align)
        return bool(ok[self.piece_count() > 1].all() if gathered_only else ok.all())

    def _piece_ok(self, addr: int, align: int, mem_align: int) -> np.ndarray:
        p_off = self.p_off
        if p_off is None:
            p_off = self.off
        dest_ok = (self.p_doff < 0) | ((addr + np.maximum(self.p_doff, 0)) % mem_align == 0)
        return (((p_off | self.p_len) % align == 0) & dest_ok).astype(np.uint8)
