"""Reads.plan (flashllm/io/read_list.py): every row's bytes land where asked, reads respect max_chunk and the
iovec limit, rows join exactly where the rules allow; `inplace` answers per (address, alignments)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.io.read_list import Reads


def land(reads: Reads, nbytes: int) -> np.ndarray:
    """Simulate the reads over a file whose byte i is i % 251: dest bytes (-1: never written)."""
    dest = np.full(nbytes, -1, dtype=np.int64)
    p_off = reads.p_off if reads.p_off is not None else reads.off
    for r in range(len(reads)):
        a, b = reads.p_start[r], reads.p_start[r + 1]
        assert p_off[a] == reads.off[r] and reads.p_len[a:b].sum() == reads.len[r]
        at = reads.off[r]
        for doff, n in zip(reads.p_doff[a:b].tolist(), reads.p_len[a:b].tolist()):
            if doff >= 0:
                dest[doff:doff + n] = np.arange(at, at + n) % 251
            at += n
    return dest


@settings(max_examples=150, deadline=None)
@given(st.sets(st.integers(0, 120), min_size=1, max_size=60), st.sampled_from([64, 96]), st.integers(1, 3),
       st.sampled_from([0, 64, 200]), st.sampled_from([96, 200, 640, 1 << 20]), st.booleans(), st.booleans())
def test_rows_land_where_asked_within_the_limits(rows, row_bytes, stride_rows, gap, max_chunk, gather, packed):
    idx = np.asarray(sorted(rows), dtype=np.int64)
    stride = row_bytes * stride_rows
    offs = idx * stride
    drows = np.arange(len(idx)) if packed else np.cumsum(np.arange(len(idx)) % 3 + 1)
    doffs = drows * row_bytes
    if max_chunk < row_bytes:
        return
    reads = Reads.plan(offs, doffs, row_bytes, gap, max_chunk, gather)
    dest = land(reads, int(doffs.max()) + row_bytes)
    for o, d in zip(offs.tolist(), doffs.tolist()):
        np.testing.assert_array_equal(dest[d:d + row_bytes], np.arange(o, o + row_bytes) % 251)
    assert (reads.len <= max(max_chunk, row_bytes)).all() and (np.diff(reads.p_start) <= Reads.MAX_PIECES).all()
    assert (np.diff(reads.off) > 0).all()
    if max_chunk < len(idx) * stride:  # (a long run is cut at max_chunk steps from its start)
        return
    for r in range(len(reads) - 1):  # a read ends only where the next row may not join it
        nxt, end = reads.off[r + 1], reads.off[r] + reads.len[r]
        joinable = 0 <= nxt - end <= gap if gather else nxt == end and reads.doff[r + 1] == reads.doff[r] + reads.len[r]
        assert not joinable, (r, reads.off, reads.len)


def test_inplace_is_answered_for_the_arguments_asked():
    offs = np.array([0, 512, 4096], dtype=np.int64)
    reads = Reads.plan(offs, np.array([0, 512, 8192], dtype=np.int64), 512, 0, 1 << 20, True)
    assert reads.inplace(0, 512, 512).all() and reads.aligned(0, 512, 512)
    assert not reads.inplace(256, 512, 512).all() and not reads.aligned(256, 512, 512)
    assert reads.inplace(0, 512, 512).all()
