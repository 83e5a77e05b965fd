"""The flash I/O engine returns exactly the file's bytes, coalesces as promised, and fails loudly."""

import errno
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashllm.io.reader as flashio
import flashllm.io.threads as flashio_threads
from flashllm.errors import FlashLLMError
from flashllm.hugepages import aligned_empty
from flashllm.io.reader import FlashIOError, FlashReader, IOStats
from flashllm.io.uring import MIN_BUFFER, UringContext

CONTEXTS = {"io_uring": UringContext, "aio": flashio.AioContext}  # the kernel interfaces under AioQueue

FILE_BYTES = 3 << 20
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("flashio") / "ffn.bin"
    data = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8)
    data.tofile(path)
    return str(path), data


def expected_rows(data, base, stride, row_bytes, indices, dest, dest_rows):
    """What dest must look like after read_rows: the requested rows written, every other byte untouched."""
    want = dest.copy()
    raw = want.view(np.uint8)
    for i, r in zip(indices, dest_rows):
        raw[r, :row_bytes] = data[base + i * stride:base + i * stride + row_bytes]
    return want


@st.composite
def row_requests(draw):
    """A random read_rows request: stride aligned or not, dest pitch equal to the stride or not."""
    stride = draw(st.sampled_from([512, 700, 4096, 4096 * 3, 1536, 8192 + 100]))
    row_bytes = draw(st.sampled_from([stride, stride, max(1, stride - 96), 1]))
    base = draw(st.sampled_from([0, 4096, 513]))
    n_file = (FILE_BYTES - base - row_bytes) // stride + 1
    n_dest = draw(st.integers(1, 64))
    n = draw(st.integers(0, n_dest))
    dest_rows = draw(st.permutations(range(n_dest)))[:n]
    if draw(st.booleans()):  # runs of adjacent rows in both file and dest: the coalescable case
        start = draw(st.integers(0, max(0, n_file - n)))
        indices = list(range(start, start + n))
        dest_rows = sorted(dest_rows) if draw(st.booleans()) else list(range(n))
    else:
        indices = draw(st.lists(st.integers(0, n_file - 1), min_size=n, max_size=n))
    pitch = draw(st.sampled_from([stride, row_bytes + 8, ((row_bytes + 511) // 512) * 512]))
    pitch = max(pitch, row_bytes)
    return base, stride, row_bytes, np.array(indices, dtype=np.int64), np.array(dest_rows, dtype=np.int64), \
        n_dest, pitch, draw(st.sampled_from([0, 8]))  # dest misalignment in bytes


@FAST
@given(req=row_requests(), max_chunk=st.sampled_from([1, 4096, 64 << 10, 1 << 20]),
       direct=st.booleans(), aio_depth=st.sampled_from([0, 1, 3]), gap=st.sampled_from([0, 700, 8192]))
def test_read_rows_returns_file_bytes(data_file, req, max_chunk, direct, aio_depth, gap):
    path, data = data_file
    base, stride, row_bytes, indices, dest_rows, n_dest, pitch, skew = req
    buf = aligned_empty(n_dest * pitch + skew, np.uint8)
    buf[:] = 0xA5
    dest = buf[skew:].reshape(n_dest, pitch)
    want = expected_rows(data, base, stride, row_bytes, indices, dest, dest_rows)
    with FlashReader(path, threads=3, max_chunk_bytes=max_chunk, direct=direct, aio_depth=aio_depth,
                     gap_bytes=gap) as r:
        stats = r.read_rows(base, stride, row_bytes, indices, dest, dest_rows)
    np.testing.assert_array_equal(dest, want)
    assert stats.bytes_requested == len(indices) * row_bytes
    assert stats.bytes_read >= stats.bytes_requested
    assert stats.reads >= (1 if len(indices) else 0) and stats.reads >= -(-stats.bytes_requested // max_chunk)


@FAST
@given(offset=st.integers(0, FILE_BYTES), nbytes=st.integers(0, 1 << 20),
       max_chunk=st.sampled_from([512, 4096, 100_000, 1 << 20]), skew=st.sampled_from([0, 8, 512]),
       threads=st.sampled_from([1, 4]), aio_depth=st.sampled_from([0, 2]))
def test_read_range_returns_file_bytes(data_file, offset, nbytes, max_chunk, skew, threads, aio_depth):
    path, data = data_file
    nbytes = min(nbytes, FILE_BYTES - offset)
    dest = aligned_empty(nbytes + skew + 16, np.uint8)[skew:]
    dest[:] = 7
    with FlashReader(path, threads=threads, max_chunk_bytes=max_chunk, aio_depth=aio_depth) as r:
        stats = r.read_range(offset, nbytes, dest)
    np.testing.assert_array_equal(dest[:nbytes], data[offset:offset + nbytes])
    assert (dest[nbytes:] == 7).all()
    assert stats.bytes_requested == nbytes and stats.reads == -(-nbytes // max_chunk)


def test_coalescing_merges_adjacent_rows_up_to_max_chunk(data_file):
    path, data = data_file
    dest = aligned_empty((40, 4096), np.uint8)
    with FlashReader(path, threads=4, max_chunk_bytes=64 << 10) as r:
        stats = r.read_rows(0, 4096, 4096, np.arange(100, 140), dest, np.arange(40))
        assert stats.reads == 3  # 16 + 16 + 8 rows
        assert (dest.reshape(-1) == data[100 * 4096:140 * 4096]).all()
        # adjacent in the file but not in dest: one vectored read per 64 KiB all the same
        assert r.read_rows(0, 4096, 4096, np.arange(100, 140), dest, np.arange(40)[::-1]).reads == 3
        assert (dest[::-1].reshape(-1) == data[100 * 4096:140 * 4096]).all()
    with FlashReader(path, threads=4, max_chunk_bytes=4096) as r:
        assert r.read_rows(0, 4096, 4096, np.arange(100, 140), dest, np.arange(40)).reads == 40


@pytest.mark.parametrize("aio_depth", [0, 4])
def test_gaps_up_to_gap_bytes_are_read_through(data_file, aio_depth):
    path, data = data_file
    ids = np.array([100, 102, 104, 108, 109])  # gaps of 1, 1, 3 and 0 rows
    dest = aligned_empty((5, 4096), np.uint8)
    with FlashReader(path, threads=2, gap_bytes=4096, aio_depth=aio_depth) as r:
        stats = r.read_rows(0, 4096, 4096, ids, dest, np.arange(5)[::-1])
    assert stats.reads == 2 and stats.bytes_read == (5 + 2) * 4096 and stats.bytes_requested == 5 * 4096
    for k, i in enumerate(ids):
        assert (dest[4 - k] == data[i * 4096:(i + 1) * 4096]).all()
    with FlashReader(path, threads=2, gap_bytes=3 * 4096, max_chunk_bytes=5 * 4096, aio_depth=aio_depth) as r:
        stats = r.read_rows(0, 4096, 4096, ids, dest, np.arange(5))
    assert stats.reads in (2, 3)  # one read cannot span 100..109 (max_chunk); cut on a grid from 100
    with FlashReader(path, threads=2, gap_bytes=4095, aio_depth=aio_depth) as r:
        assert r.read_rows(0, 4096, 4096, ids, dest, np.arange(5)).reads == 4


def test_aligned_rows_land_in_place_and_unaligned_ones_bounce(data_file):
    path, data = data_file
    with FlashReader(path, threads=2, max_chunk_bytes=4096) as r:
        if not r.direct:
            pytest.skip("no direct I/O on this file system")
        assert r.alignment >= 512 and (r.alignment & (r.alignment - 1)) == 0
        dest = aligned_empty((8, 4096), np.uint8)
        stats = r.read_rows(0, 4096, 4096, np.arange(8) * 3, dest, np.arange(8))
        assert stats.bytes_read == stats.bytes_requested  # no alignment waste: read straight into dest
        dest = aligned_empty((8, 700), np.uint8)
        stats = r.read_rows(0, 700, 700, np.arange(8) * 3, dest, np.arange(8))
        assert stats.bytes_read > stats.bytes_requested
        for k in range(8):
            assert (dest[k] == data[k * 3 * 700:k * 3 * 700 + 700]).all()


def test_32_threads_large_random_request(data_file):
    path, data = data_file
    rng = np.random.default_rng(1)
    indices = rng.integers(0, FILE_BYTES // 16384, 2000)
    dest = aligned_empty((2000, 16384 // 4), np.float32)  # any dtype: rows are viewed as bytes
    with FlashReader(path) as r:
        assert r.threads == 32
        stats = r.read_rows(0, 16384, 16384, indices, dest, np.arange(2000))
    want = data.reshape(-1, 16384)[indices]
    np.testing.assert_array_equal(dest.view(np.uint8), want)
    assert stats.reads <= 2000


def test_dest_can_be_a_torch_tensor_view(data_file):
    torch = pytest.importorskip("torch")
    path, data = data_file
    t = torch.zeros(10, 2048, dtype=torch.float16)
    with FlashReader(path, threads=2) as r:
        r.read_rows(0, 4096, 4096, np.arange(10), t.numpy(), np.arange(10))
    assert bytes(t.view(torch.uint8).numpy().reshape(-1)) == data[:10 * 4096].tobytes()


def test_short_read_from_truncated_file_raises_naming_file_and_offset(tmp_path):
    path = tmp_path / "ffn.bin"
    path.write_bytes(os.urandom(1 << 20))
    with FlashReader(path, threads=4) as r:
        os.truncate(path, 100_000)
        dest = aligned_empty((16, 4096), np.uint8)
        with pytest.raises(FlashIOError, match=r"ffn\.bin.*short read at offset \d+"):
            r.read_rows(0, 4096, 4096, np.arange(16) * 10, dest, np.arange(16))
        with pytest.raises(FlashIOError, match="short read"):
            r.read_range(0, 1 << 20, aligned_empty(1 << 20, np.uint8))


def test_io_error_in_a_worker_is_raised_in_the_caller(data_file, monkeypatch):
    path, _ = data_file
    with FlashReader(path, threads=4, aio_depth=0) as r:
        def eio(fd, buffers, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        monkeypatch.setattr(flashio_threads, "_preadv", eio)
        dest = aligned_empty((8, 4096), np.uint8)
        with pytest.raises(FlashIOError, match=r"ffn\.bin: read of 4096 bytes at offset \d+ failed: \[EIO\]"):
            r.read_rows(0, 4096, 4096, np.arange(8) * 2, dest, np.arange(8))
        monkeypatch.undo()
        assert r.read_rows(0, 4096, 4096, np.arange(8) * 2, dest, np.arange(8)).reads == 8  # workers alive


@pytest.fixture(params=sorted(CONTEXTS))
def kernel_io(request, monkeypatch):
    """Each asynchronous engine in turn (FLASHLLM_IO_ENGINE); the context class its reader drives."""
    monkeypatch.setenv("FLASHLLM_IO_ENGINE", request.param)
    return CONTEXTS[request.param]


def aio_reader(path, **kw):
    r = FlashReader(path, **kw)
    want = {"auto": None, "aio": "linux-aio", "io_uring": "io_uring"}[flashio.io_engine()]
    if r.engine != "aio" or want not in (None, r.kernel_io):
        r.close()
        pytest.skip(f"no {want or 'native AIO'} with direct I/O here")
    return r


def test_aio_engine_is_used_for_direct_reads_and_reads_in_batches(data_file, kernel_io):
    path, data = data_file
    with aio_reader(path, threads=2, aio_depth=5) as r:
        dest = aligned_empty((23, 4096), np.uint8)
        stats = r.read_rows(0, 4096, 4096, np.arange(23) * 7, dest, np.arange(23))
        assert stats.reads == 23 and stats.bytes_read == 23 * 4096
        assert (dest == data.reshape(-1, 4096)[0:161:7]).all()
    with FlashReader(path, aio_depth=0) as r:
        assert r.engine == "preadv" and r.aio_depth == 0


def test_aio_joins_rows_adjacent_in_file_and_dest_and_waits_once(data_file, kernel_io, monkeypatch):
    """The sparse decode's AIO call: runs of rows adjacent in the file and in dest are one read each;
    rows adjacent in the file but apart in dest are one vectored read; the waiter reaps all of a call's
    reads in one sleeping syscall."""
    path, data = data_file
    rows = data.reshape(-1, 4096)
    mins = []
    real = kernel_io.reap
    monkeypatch.setattr(kernel_io, "reap", lambda self, lo, hi: mins.append(lo) or real(self, lo, hi))
    with aio_reader(path, threads=2, aio_depth=64) as r:
        ids = np.array([3, 4, 5, 9, 11, 12, 40])
        dest = aligned_empty((8, 4096), np.uint8)
        stats = r.read_rows(0, 4096, 4096, ids, dest, np.arange(7))
        assert stats.reads == 4 and stats.bytes_read == 7 * 4096 and (dest[:7] == rows[ids]).all()
        assert mins == [4]
        dest[:] = 0
        stats = r.read_rows(0, 4096, 4096, ids, dest, np.array([0, 2, 4, 5, 6, 7, 1]))  # 3|4|5 apart in dest
        assert (dest[[0, 2, 4, 5, 6, 7, 1]] == rows[ids]).all() and stats.reads == 4


def test_aio_call_beyond_the_inline_share_is_submitted_in_the_background(data_file, kernel_io, monkeypatch):
    """`submit_rows` returns after submitting at most the inline share from the caller (io_submit sleeps
    while the device queue is full); the submitter thread sends the rest, so the reads complete while
    the caller does other work, and a waiter gets exactly the file's bytes, also when the context holds
    fewer reads than the call (the waiter's reaping makes room)."""
    path, data = data_file
    rows = data.reshape(-1, 4096)
    real, calls = kernel_io.submit, []
    monkeypatch.setattr(kernel_io, "submit",
                        lambda self, iocbs: calls.append((threading.current_thread().name, len(iocbs))) or
                        real(self, iocbs))
    ids = np.arange(23) * 7
    for depth in (64, 3):
        calls.clear()
        with aio_reader(path, threads=2, aio_depth=depth) as r:
            r._aio.queue.inline = 2
            dest = aligned_empty((23, 4096), np.uint8)
            pending = r.submit_rows(0, 4096, 4096, ids, dest, np.arange(23))
            caller = threading.current_thread().name
            assert sum(n for who, n in calls if who == caller) <= 2
            if depth == 64:
                for _ in range(2000):  # no one waits: the background thread submits the rest
                    if pending.done():
                        break
                    threading.Event().wait(0.005)
                assert pending.done() and {who for who, _ in calls} == {caller, "flashio-aio-submit"}
            stats = pending.wait()
            assert stats.reads == 23 and (dest == rows[ids]).all()
            assert sum(n for _, n in calls) == 23


def test_aio_errors_name_the_read_and_leave_workers_alive(data_file, kernel_io, monkeypatch):
    path, _ = data_file
    real = kernel_io.reap
    dest = aligned_empty((8, 4096), np.uint8)
    with aio_reader(path, threads=4, aio_depth=3) as r:
        for res, match in [(-errno.EIO, r"ffn\.bin: read of 4096 bytes at offset \d+ failed: \[EIO\]"),
                           (100, r"ffn\.bin: short read at offset \d+: got 100 of 4096 bytes")]:
            def bad_event(self, min_nr, max_nr, res=res):
                events = real(self, min_nr, max_nr)
                if len(events):  # a poll may find none done yet
                    events["res"][-1] = res
                return events
            monkeypatch.setattr(kernel_io, "reap", bad_event)
            with pytest.raises(FlashIOError, match=match):
                r.read_rows(0, 4096, 4096, np.arange(8) * 2, dest, np.arange(8))

        def refused(self, iocbs):
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        monkeypatch.setattr(kernel_io, "submit", refused)
        with pytest.raises(FlashIOError, match=r"reads from offset \d+ could not be submitted"):
            r.read_rows(0, 4096, 4096, np.arange(8) * 2, dest, np.arange(8))
        monkeypatch.undo()
        assert r.read_rows(0, 4096, 4096, np.arange(8) * 2, dest, np.arange(8)).reads == 8


def test_async_short_read_from_truncated_file_raises_naming_file_and_offset(tmp_path, kernel_io):
    path = tmp_path / "ffn.bin"
    path.write_bytes(os.urandom(1 << 20))
    with aio_reader(path, threads=2, aio_depth=8) as r:
        os.truncate(path, 100_000)
        dest = aligned_empty((16, 4096), np.uint8)
        with pytest.raises(FlashIOError, match=r"ffn\.bin: short read at offset \d+: got 0 of 4096 bytes"):
            r.read_rows(0, 4096, 4096, np.arange(16) * 10, dest, np.arange(16))


def test_io_uring_registers_large_destinations_while_they_live(data_file, monkeypatch):
    """A destination of at least MIN_BUFFER bytes becomes a fixed buffer (its reads skip page pinning); a view
    of it reads through the same slot; when the array is freed its slot is emptied, so a new array at the
    same address gets plain reads or a fresh registration, never the old pages. Small ones stay plain."""
    monkeypatch.setenv("FLASHLLM_IO_ENGINE", "io_uring")
    path, data = data_file
    rows = data.reshape(-1, 4096)
    ids = np.array([1, 2, 9, 30, 31, 700])
    with aio_reader(path, threads=2, aio_depth=16) as r:
        small = aligned_empty((8, 4096), np.uint8)
        r.read_rows(0, 4096, 4096, ids, small, np.arange(6))
        assert r._aio.ring.registered == 0 and (small[:6] == rows[ids]).all()
        for _ in range(3):
            big = aligned_empty((MIN_BUFFER // 4096 + 5, 8192), np.uint8)
            r.read_rows(0, 4096, 4096, ids, big[:, 4096:], np.arange(6) * 3)  # a strided view
            assert r._aio.ring.registered >= big.nbytes
            assert (big[np.arange(6) * 3, 4096:] == rows[ids]).all()
            del big
            assert r._aio.ring.registered == 0


def test_default_engine_is_linux_aio_and_io_uring_keeps_within_the_device_queue(data_file, monkeypatch):
    """auto takes Linux AIO (io_uring cost the runtime more CPU); a forced io_uring ring holds at most
    URING_QUEUE_SHARE of the device's request queue in flight, so no read waits for a request in the kernel's
    io_uring workers; every read of a call larger than that still arrives."""
    path, data = data_file
    rows = data.reshape(-1, 4096)
    monkeypatch.delenv("FLASHLLM_IO_ENGINE", raising=False)
    with aio_reader(path, threads=2, aio_depth=2048) as r:
        assert r.kernel_io == "linux-aio" and r.aio_depth == 2048
    monkeypatch.setenv("FLASHLLM_IO_ENGINE", "io_uring")
    monkeypatch.setattr(flashio, "device_queue", lambda p: 8)
    with aio_reader(path, threads=2, aio_depth=2048) as r:
        assert r.aio_depth == 6 and r._aio.ring.depth == 6
        ids = np.arange(40) * 5
        dest = aligned_empty((40, 4096), np.uint8)
        r.read_rows(0, 4096, 4096, ids, dest, np.arange(40))
        assert (dest == rows[ids]).all()


def test_unknown_io_engine_is_a_clear_error(data_file, monkeypatch):
    monkeypatch.setenv("FLASHLLM_IO_ENGINE", "spdk")
    with pytest.raises(FlashIOError, match="FLASHLLM_IO_ENGINE='spdk': expected one of auto, io_uring, aio, preadv"):
        FlashReader(data_file[0], aio_depth=4)
    monkeypatch.setenv("FLASHLLM_IO_ENGINE", "preadv")
    with FlashReader(data_file[0], aio_depth=4) as r:
        assert r.engine == r.kernel_io == "preadv"


def test_out_of_range_and_malformed_requests_raise(data_file):
    path, _ = data_file
    dest = aligned_empty((4, 4096), np.uint8)
    with FlashReader(path, threads=2) as r:
        last = FILE_BYTES // 4096 - 1
        r.read_rows(0, 4096, 4096, [last], dest, [0])
        for idx, rows, match in [([last + 1], [0], "outside the file"), ([-1], [0], "outside the file"),
                                 ([0], [4], r"dest_rows must lie in \[0, 4\)"),
                                 ([0, 1], [0], "2 indices but 1 dest_rows")]:
            with pytest.raises(FlashIOError, match=match):
                r.read_rows(0, 4096, 4096, idx, dest, rows)
        with pytest.raises(FlashIOError, match="hold row_bytes=8192"):
            r.read_rows(0, 8192, 8192, [0], dest, [0])
        with pytest.raises(FlashIOError, match="2-D"):
            r.read_rows(0, 4096, 4096, [0], dest.reshape(-1), [0])
        with pytest.raises(FlashIOError, match="contiguous"):
            r.read_rows(0, 4096, 2048, [0], dest[:, ::2], [0])
        with pytest.raises(FlashIOError, match="outside the file"):
            r.read_range(FILE_BYTES - 10, 11, aligned_empty(11, np.uint8))
        with pytest.raises(FlashIOError, match="dest holds 10 bytes"):
            r.read_range(0, 11, aligned_empty(10, np.uint8))
    for kw in ({"threads": 0}, {"max_chunk_bytes": 0}, {"aio_depth": -1}):
        with pytest.raises(FlashIOError, match="must be >= 1, aio_depth and gap_bytes >= 0"):
            FlashReader(path, **kw)


def test_closed_reader_raises_and_threads_are_gone(data_file):
    path, _ = data_file
    r = FlashReader(path, threads=4)
    workers = list(r._workers.threads)
    r.close()
    r.close()
    assert r.closed and not any(t.is_alive() for t in workers)
    with pytest.raises(FlashIOError, match="closed"):
        r.read_rows(0, 4096, 4096, [0], aligned_empty((1, 4096), np.uint8), [0])
    with pytest.raises(FlashIOError, match="closed"):
        r.read_range(0, 10, aligned_empty(10, np.uint8))


def test_missing_file_is_a_flashllm_error_naming_the_path(tmp_path):
    with pytest.raises(FlashLLMError, match=r"nope\.bin: no such file"):
        FlashReader(tmp_path / "nope.bin")


def test_buffered_fallback_when_direct_io_is_refused(data_file, monkeypatch):
    path, data = data_file
    real_open = os.open

    def refusing_open(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(flashio.os, "open", refusing_open)
    monkeypatch.setattr(flashio, "_warned_devices", set())
    if hasattr(os, "O_DIRECT"):
        with pytest.warns(RuntimeWarning, match="does not support direct I/O"):
            r = FlashReader(path, threads=2)
    else:
        r = FlashReader(path, threads=2)
    with r, warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once, not per reader or per read
        FlashReader(path, threads=1).close()
        dest = np.zeros((5, 700), np.uint8)  # unaligned everything: buffered reads need no bounce
        stats = r.read_rows(13, 700, 700, np.array([9, 0, 4, 5, 6]), dest, np.array([4, 3, 0, 1, 2]))
        assert r.alignment == 1 and stats.bytes_read == stats.bytes_requested
    for k, i in zip([4, 3, 0, 1, 2], [9, 0, 4, 5, 6]):
        assert (dest[k] == data[13 + i * 700:13 + i * 700 + 700]).all()


def test_iostats_add():
    total = IOStats(1, 2, 3, 0.5) + IOStats(10, 20, 30, 1.0)
    assert total == IOStats(11, 22, 33, 1.5)


def test_aligned_empty_is_aligned():
    for align in (512, 4096, 65536):
        a = aligned_empty((3, 5), np.float16, align)
        assert a.ctypes.data % align == 0 and a.shape == (3, 5) and a.dtype == np.float16


def test_open_reader_does_not_hang_interpreter_exit(data_file):
    path, _ = data_file
    code = ("import numpy as np; from flashllm.io.reader import FlashReader; from flashllm.hugepages import aligned_empty; "
            f"r = FlashReader({path!r}); r.read_range(0, 4096, aligned_empty(4096, np.uint8))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60, check=True)


def test_no_reference_to_dest_is_kept_after_a_call(data_file):
    path, _ = data_file
    dest = np.zeros((4, 4096), np.uint8)
    with FlashReader(path, threads=4) as r:
        r.read_rows(0, 4096, 4096, np.arange(4), dest, np.arange(4))
        r.read_range(0, 4096, dest)
        dest.resize((8, 4096))  # raises if a worker still holds a view of the buffer


def test_a_worker_woken_after_its_call_is_over_holds_no_view_of_dest(data_file, monkeypatch):
    """The waiting thread may do all of its call's reads while the workers are busy with an earlier call;
    the queued share of a worker woken after that must not keep the buffer alive."""
    path, data = data_file
    real, gate = flashio_threads._preadv, threading.Event()

    def held_read(fd, bufs, off):  # the first call's reads (from offset 1 MiB) wait at the gate
        if off >= 1 << 20:
            assert gate.wait(timeout=30)
        return real(fd, bufs, off)

    monkeypatch.setattr(flashio_threads, "_preadv", held_read)
    with FlashReader(path, threads=2, aio_depth=0) as r:
        busy = r.submit_rows(1 << 20, 4096, 4096, np.arange(8) * 2, aligned_empty((8, 4096), np.uint8), np.arange(8))
        dest = np.zeros((4, 4096), np.uint8)
        r.read_rows(0, 4096, 4096, np.arange(4), dest, np.arange(4))  # done by this thread alone
        assert (dest == data.reshape(-1, 4096)[:4]).all()
        dest.resize((8, 4096))  # raises if a queued share still holds a view of the buffer
        gate.set()
        assert busy.wait().reads == 8


def test_submitted_calls_overlap_and_wait_returns_their_stats(data_file, monkeypatch):
    path, data = data_file
    a, b = aligned_empty((64, 8192), np.uint8), aligned_empty(1 << 20, np.uint8)
    real, gate = flashio_threads._preadv, threading.Event()

    def held_read(fd, bufs, off):  # reads wait at the gate: the calls stay in flight until it opens
        assert gate.wait(timeout=30)
        return real(fd, bufs, off)

    with FlashReader(path, threads=4, aio_depth=0) as r:
        monkeypatch.setattr(flashio_threads, "_preadv", held_read)
        pa = r.submit_rows(0, 8192, 8192, np.arange(64) * 2, a, np.arange(64))
        pb = r.submit_range(4096, 1 << 20, b)
        assert not pa.done() and not pb.done()  # both submitted and pending at once: the caller goes on
        gate.set()
        stats_b, stats_a = pb.wait(), pa.wait()
        assert pa.done() and pa.wait() is stats_a and stats_a.bytes_requested == 64 * 8192
        assert stats_b.bytes_requested == 1 << 20
        monkeypatch.setattr(flashio_threads, "_preadv", lambda fd, bufs, off: 0)  # every read comes back short
        pending = r.submit_range(0, 4096, b)
        with pytest.raises(FlashIOError, match="short read"):
            pending.wait()
    assert (a == data.reshape(-1, 8192)[0:128:2]).all()
    assert (b == data[4096:4096 + (1 << 20)]).all()


def test_io_throughput_bench_prints_one_json_object(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "bench", "--no-record", "io", "throughput", "--file", str(tmp_path / "io.bin"),
           "--size", "8MiB", "--chunks", "32K", "--threads", "2", "--rounds", "1", "--seconds", "0.05",
           "--layer-bytes", "4M", "--no-fio", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    if "no direct I/O" in out.stderr:
        pytest.skip("no direct I/O on this file system")
    result = json.loads(out.stdout)
    assert [(r["pattern"], r["chunk_bytes"], r["threads"]) for r in result["rows"]] == \
        [("random", 32768, 2), ("sequential", 32768, 2), ("layer", 1 << 20, 2)]
    assert all(r["engine_mibps"] > 0 and r["fio_mibps"] is None and r["ratio"] is None for r in result["rows"])
    assert (tmp_path / "io.bin").stat().st_size == 8 << 20  # --file given: kept for reuse
