"""What a random read costs on the disk a model lives on, measured once per machine and disk.

The flash I/O engine itself (O_DIRECT, N threads) reads random, request-sized pieces of a scratch
file on that disk, for each request size and number of reads in flight; the profile keeps the
throughput of every cell and the median latency of single reads. What it measures must be the
device, not a cache: the scratch file is written with direct I/O (it never enters this kernel's page
cache), it is large (1 GiB: a virtual disk's host may still cache what the guest just wrote, and a
small file it keeps whole, which overstates throughput and so the gap), no piece of it is read twice,
and reads go to random offsets over all of it. A model file at least that large is read instead
(read-only): written earlier, it is less likely to be in a host's cache than a scratch file just
written. Where no scratch file can be written (a read-only model directory), the largest file there
is read. A profile measured without direct I/O derives no gap (``gap_bytes`` 0). Fitting the
amortised cost of one read, ``size / throughput(size)``, to ``per_read_s + size / bandwidth`` gives
the cost model that gap-filling uses: reading through a gap of g bytes costs g / bandwidth, a separate
read costs per_read_s, so a gap is read through when ``g < per_read_s * bandwidth`` (``gap_bytes``).

Profiles are cached as JSON under ``disk/`` of flashllm's cache (``paths.cache_home``: ``$FLASHLLM_CACHE``,
default ``~/.cache/flashllm``), one file per host and block device; ``profile(path, refresh=True)`` measures again.

    from flashllm.io import disk_profile
    p = disk_profile.profile("/models/opt/ffn.bin")   # cached, or measured now (a few seconds)
    p.gap_bytes(32), p.cost_model(32), p.throughput(16384, 32), p.latency_s(4096)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.paths import cache_home

FORMAT = "flashllm-disk-profile"
VERSION = 2  # 2: measured on a large direct-written scratch file, each piece read once (1 was host-cached)
SIZES = (4096, 16384, 65536, 262144, 1048576)  # request sizes measured by default
INFLIGHT = (1, 8, 32)  # reads in flight measured by default
INFLIGHT_AIO = (1, 8, 32, 256)  # ... with native AIO (one call's reads all in flight: a large layer's hundreds)
SCRATCH_BYTES = 1 << 30  # the scratch file random reads go to (written once, deleted after)
SECONDS = 0.25  # per cell
WAVES = 8  # an engine call of WAVES x q reads beside one of q: what a call costs beyond its reads (call_us)
WAVE_SIZES = 3  # ... measured at the smallest request sizes (a call's cost does not scale with them)
MIN_CALLS = 8  # per cell, however long they take


def cache_root() -> Path:
    return cache_home() / "disk"


def disk_key(path) -> str:
    """host + block device of ``path`` (a file or a directory): what a profile is cached under."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    return f"{socket.gethostname()}-dev{major}_{minor}"


def _describe_device(path) -> str:
    """The block device's model name (Linux sysfs), or its numbers."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    for p in (sys_dev / "device" / "model", sys_dev / ".." / "device" / "model"):
        try:
            return f"{p.read_text().strip()} ({major}:{minor})"
        except OSError:
            continue
    return f"block device {major}:{minor}"


@dataclass
class DiskProfile:
    """Throughput per (reads in flight, request size) and single-read latency, of one disk."""

    key: str
    device: str
    date: str
    direct: bool  # measured with O_DIRECT (False: the page cache may have served reads)
    sizes: list[int]
    inflight: list[int]
    mibps: list[list[float]]  # [len(inflight)][len(sizes)]
    latency_us: list[float]  # median single-read latency per size (1 in flight)
    scratch_bytes: int = 0
    seconds_per_cell: float = 0.0
    notes: list[str] = field(default_factory=list)
    call_us: list[float] | None = None  # per in-flight count: an engine call's cost beyond its reads (None: not measured)
    engine: str = "preadv"  # the engine measured: reader threads ("preadv") or native AIO ("aio"), as FlashReader

    # -- queries ---------------------------------------------------------------------------------
    def _row(self, inflight: int) -> int:
        """The measured in-flight count closest to ``inflight`` (ties: the smaller)."""
        q = np.array(self.inflight)
        return int(np.argmin(np.abs(np.log(q) - np.log(max(inflight, 1)))))

    def throughput(self, size: int, inflight: int) -> float:
        """Bytes/s of random ``size``-byte reads with ``inflight`` in flight (interpolated in log size)."""
        mib = np.interp(np.log(size), np.log(self.sizes), self.mibps[self._row(inflight)])
        return float(mib) * (1 << 20)

    def latency_s(self, size: int) -> float:
        """Seconds one read of ``size`` bytes takes alone."""
        return float(np.interp(np.log(size), np.log(self.sizes), self.latency_us)) * 1e-6

    def cost_model(self, inflight: int) -> tuple[float, float]:
        """(per-read seconds, bytes/s): the line through the amortised cost of one read, ``size /
        throughput``, at the measured in-flight count closest to ``inflight`` (least squares of the
        relative error, so that the large sizes do not decide the per-read cost alone)."""
        row = self._row(inflight)
        s = np.array(self.sizes, dtype=np.float64)
        return _fit_line(s, s / (np.array(self.mibps[row]) * (1 << 20)))

    def call_cost_model(self, inflight: int) -> tuple[float, float, float] | None:
        """(seconds per engine call, per-read seconds, bytes/s) at ``inflight`` reads in flight: a call of
        r reads costs ``call + r * per_read + bytes / bandwidth``. A cell's calls hold one read per thread,
        so its amortised cost carries the whole call (waking the threads, waiting for the slowest read)
        in every q reads; a call of many reads per thread (the runtime's, for a large layer) pays it once.
        None when the profile has no call costs (measured before they were)."""
        if not self.call_us:
            return None
        row = self._row(inflight)
        call = self.call_us[row] * 1e-6
        s = np.array(self.sizes, dtype=np.float64)
        per_read, bandwidth = _fit_line(s, np.maximum(s / (np.array(self.mibps[row]) * (1 << 20))
                                                      - call / self.inflight[row], 1e-9))
        return call, per_read, bandwidth

    def gap_bytes(self, inflight: int) -> int:
        """The largest gap worth reading through rather than issuing a second read (0 when the profile
        was not measured with direct I/O: a page cache made the reads look free)."""
        if not self.direct:
            return 0
        per_read, bandwidth = self.cost_model(inflight)
        return int(per_read * bandwidth)

    def read_seconds(self, sizes, inflight: int) -> float:
        """Predicted time of reads of ``sizes`` bytes with ``inflight`` in flight (cost model)."""
        per_read, bandwidth = self.cost_model(inflight)
        sizes = np.asarray(sizes, dtype=np.float64)
        return float(len(sizes) * per_read + sizes.sum() / bandwidth)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "DiskProfile":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError("not a flashllm disk profile of this version")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        p = cls(**fields)
        if len(p.mibps) != len(p.inflight) or any(len(r) != len(p.sizes) for r in p.mibps) or \
                len(p.latency_us) != len(p.sizes) or min(min(r) for r in p.mibps) <= 0:
            raise ValueError("inconsistent table")
        return p

    def table(self) -> str:
        """A table a person can read: MiB/s per request size and reads in flight, latency, the cost model."""
        head = f"{'request':>9} {'latency (us)':>13} " + " ".join(f"{f'{q} in flight':>13}" for q in self.inflight)
        lines = [f"disk {self.device} ({self.key}), measured {self.date} with the {self.engine} engine"
                 f"{'' if self.direct else ' WITHOUT direct I/O'}; MiB/s of random reads", head]
        for j, s in enumerate(self.sizes):
            lines.append(f"{_fmt(s):>9} {self.latency_us[j]:>13.0f} " +
                         " ".join(f"{self.mibps[i][j]:>13.0f}" for i in range(len(self.inflight))))
        for q in self.inflight:
            a, b = self.cost_model(q)
            lines.append(f"{q} in flight: a read costs {a * 1e6:.1f} us + size / {b / (1 << 20):.0f} MiB/s; "
                         f"gaps under {_fmt(self.gap_bytes(q))} are read through")
            calls = self.call_cost_model(q)
            if calls:
                lines.append(f"    in calls of many reads: {calls[0] * 1e6:.0f} us per call + {calls[1] * 1e6:.1f} us "
                             f"per read + size / {calls[2] / (1 << 20):.0f} MiB/s")
        return "\n".join(lines + self.notes)


def _fit_line(s: np.ndarray, cost: np.ndarray) -> tuple[float, float]:
    """(intercept >= 0, 1 / slope) of ``cost ~ intercept + s * slope``, least squares of the relative error
    (so that the large sizes do not decide the intercept alone)."""
    slope, intercept = np.polyfit(s, cost, 1, w=1 / cost)
    bandwidth = 1.0 / slope if slope > 0 else float(np.max(s / cost))
    return max(float(intercept), 0.0), float(bandwidth)


def _fmt(n: int) -> str:
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= m:
            return f"{n / m:g}{unit}"
    return str(n)


# -- measuring ----------------------------------------------------------------------------------
_clock = time.perf_counter  # what cells are timed with (a test swaps in a simulated disk's clock)


def _cell(reader, order: np.ndarray, size: int, inflight: int, seconds: float, dest) -> tuple[float, float]:
    """(bytes/s, median seconds per call) reading ``size``-byte rows ``order[0], order[1], ...`` (a random
    permutation of the file's rows: no row is read twice), ``inflight`` per call (as many as ``dest`` has
    rows: a multiple of the reader's threads for calls of several waves), for ``seconds`` and at least
    MIN_CALLS calls (or until the rows run out)."""
    per_call = len(dest)
    rows, clock = np.arange(per_call), _clock
    total, times = 0, []
    start = clock()
    for k in range(0, len(order) - per_call + 1, per_call):
        t = clock()
        total += reader.read_rows(0, size, size, order[k:k + per_call], dest, rows).bytes_read
        times.append(clock() - t)
        if len(times) >= MIN_CALLS and clock() - start >= seconds:
            break
    return total / max(clock() - start, 1e-9), float(np.median(times))


def _scratch(directory: Path, nbytes: int, notes: list) -> tuple[str, bool]:
    """(path of a file to read, whether we wrote it): a scratch file of random bytes in ``directory``,
    written with direct I/O where the file system allows (so that this kernel's page cache never holds it)."""
    from flashllm.hugepages import aligned_empty

    try:
        fd, path = tempfile.mkstemp(prefix=".flashllm-disk-profile-", dir=directory)
    except OSError:
        return "", False
    rng = np.random.default_rng()
    chunk = aligned_empty(8 << 20, np.uint8)
    try:
        try:
            dfd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            dfd = os.open(path, os.O_WRONLY)
        try:
            for done in range(0, nbytes, len(chunk)):  # new random bytes each chunk: nothing to deduplicate
                chunk[:] = np.frombuffer(rng.bytes(len(chunk)), np.uint8)
                n = min(len(chunk), nbytes - done)
                if os.pwrite(dfd, chunk[:n] if n == len(chunk) else chunk[:-(-n // 4096) * 4096], done) < n:
                    raise OSError(28, "short write")
            os.ftruncate(dfd, nbytes)
            os.fsync(dfd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(dfd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(dfd)
            os.close(fd)
    except OSError as e:
        os.unlink(path)
        notes.append(f"could not write a scratch file in {directory} ({e.strerror})")
        return "", False
    return path, True


def _largest_file(directory: Path, at_least: int) -> str:
    """The largest regular file directly in ``directory`` of at least ``at_least`` bytes, or ""."""
    try:
        files = [(f.stat().st_size, str(f)) for f in directory.iterdir() if f.is_file()]
    except OSError:
        return ""
    size, file = max(files, default=(0, ""))
    return file if size >= at_least else ""


def measure(path, sizes=SIZES, inflight=None, seconds: float = SECONDS,
            scratch_bytes: int = SCRATCH_BYTES, progress=None, open_reader=None, engine: str = "preadv") -> DiskProfile:
    """Measure the disk holding ``path`` (a file or directory) with the flash I/O engine.

    Reads go to ``path`` itself (read-only) if it is a file of at least ``scratch_bytes``; else to a
    scratch file of ``scratch_bytes`` written next to it and deleted afterwards, or, where that cannot
    be written, to ``path`` if it is a file. ``open_reader(file,
    threads, max_chunk_bytes)``: the engine to measure (default: FlashReader)."""
    from flashllm.hugepages import aligned_empty
    from flashllm.io.reader import FlashReader

    inflight = inflight or (INFLIGHT_AIO if engine == "aio" else INFLIGHT)
    open_reader = open_reader or (lambda f, q, chunk: FlashReader(f, threads=1 if engine == "aio" else q,
                                                                  max_chunk_bytes=chunk,
                                                                  aio_depth=q if engine == "aio" else 0))
    target = Path(path)
    if not target.exists():
        raise FlashLLMError(f"{target}: no such file or directory (cannot profile its disk)")
    directory = target if target.is_dir() else target.parent
    notes: list[str] = []
    if target.is_file() and target.stat().st_size >= scratch_bytes:  # e.g. a large model's FFN file
        file, ours = str(target), False
        notes.append(f"measured on {target} (read-only; written earlier, it is less likely than a fresh "
                     f"scratch file to be held by a host's cache)")
    else:
        file, ours = _scratch(directory, scratch_bytes, notes)
    if not file:  # a read-only place: read the file itself, or a directory's largest file (a model's ffn.bin)
        file = str(target) if target.is_file() else _largest_file(directory, max(sizes) * max(*inflight, 2))
        if not file:
            raise FlashLLMError(f"{directory}: not writable, and it holds no file large enough to read instead; "
                                f"profile a writable directory on the same disk (`flashllm profile DIR`)")
        notes.append(f"measured on {file} (read-only; it may be cached)")
    sizes, inflight = sorted(set(int(s) for s in sizes)), sorted(set(int(q) for q in inflight))
    rng = np.random.default_rng()
    mibps = [[0.0] * len(sizes) for _ in inflight]
    latency = [0.0] * len(sizes)
    call_us = [0.0] * len(inflight)
    direct = True
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    try:
        fsize = os.path.getsize(file)
        for s in sizes:
            if fsize < s * max(max(inflight), 2):
                raise FlashLLMError(f"{file}: {fsize} bytes, too small to profile {s}-byte reads")
        for i, q in enumerate(inflight):
            with open_reader(file, q, max(sizes)) as reader:
                direct = direct and reader.direct
                if getattr(reader, "engine", engine) != engine:
                    notes.append(f"{engine} unavailable here: measured with {reader.engine}")
                for j, s in enumerate(sizes):
                    dest = aligned_empty((q, s), np.uint8)
                    dest.fill(0)
                    bps, per_call = _cell(reader, rng.permutation(fsize // s), s, q, seconds, dest)
                    mibps[i][j] = bps / (1 << 20)
                    if q == 1:
                        latency[j] = per_call * 1e6
                    if progress:
                        progress(f"disk, {'native AIO' if engine == 'aio' else 'reader threads'}: random "
                                 f"{_fmt(s)} reads, {q} in flight: {mibps[i][j]:.0f} MiB/s")
                calls = []
                for s in [s for s in sizes[:WAVE_SIZES] if fsize // s >= 2 * WAVES * q]:
                    # one wave vs WAVES waves per call: (WAVES * t1 - tw) / (WAVES - 1) is the call's own cost
                    one = _cell(reader, rng.permutation(fsize // s), s, q, seconds / 2, aligned_empty((q, s), np.uint8))[1]
                    many = _cell(reader, rng.permutation(fsize // s), s, q, seconds / 2,
                                 aligned_empty((WAVES * q, s), np.uint8))[1]
                    calls.append((WAVES * one - many) / (WAVES - 1))
                call_us[i] = max(float(np.median(calls)), 0.0) * 1e6 if calls else 0.0
        if 1 not in inflight:
            with open_reader(file, 1, max(sizes)) as reader:
                for j, s in enumerate(sizes):
                    dest = aligned_empty((1, s), np.uint8)
                    latency[j] = _cell(reader, rng.permutation(fsize // s), s, 1, seconds / 2, dest)[1] * 1e6
    finally:
        if ours:
            os.unlink(file)
    if load0 is not None:
        notes.append(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
                     f"(per-read costs include the engine's CPU: a busy machine raises them)")
    return DiskProfile(key=disk_key(directory), device=_describe_device(directory),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), direct=direct, sizes=sizes,
                       inflight=inflight, mibps=[[round(v, 1) for v in r] for r in mibps],
                       latency_us=[round(v, 1) for v in latency], scratch_bytes=scratch_bytes if ours else 0,
                       seconds_per_cell=seconds, notes=notes, call_us=[round(v, 1) for v in call_us], engine=engine)


def _name(key: str, engine: str) -> str:
    return f"{key}.json" if engine == "preadv" else f"{key}-{engine}.json"


def cache_path(path, engine: str = "preadv") -> Path:
    """Where the profile of the disk holding ``path``, measured with ``engine``, is cached."""
    return cache_root() / _name(disk_key(path), engine)


def cached(path, engine: str = "preadv") -> DiskProfile | None:
    """The cached profile of the disk holding ``path``, or None (none yet, or unreadable)."""
    try:
        return DiskProfile.from_dict(json.loads(cache_path(path, engine).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save(p: DiskProfile) -> Path:
    """Write a profile to the cache (to a temporary name, then renamed)."""
    out = cache_root() / _name(p.key, p.engine)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(p.to_dict(), indent=1))
    os.replace(tmp, out)
    return out


QUICK = dict(inflight=(1, 32), seconds=0.1, scratch_bytes=256 << 20)  # a few s: what a first load measures


def profile(path, refresh: bool = False, progress=None, quick: bool = False, engine: str = "preadv",
            **measure_args) -> DiskProfile:
    """The profile of the disk holding ``path`` measured with ``engine``: cached, else (or with ``refresh``)
    measured and cached. ``quick``: if it must be measured, measure only what the runtime's gap needs (QUICK)."""
    if not refresh:
        p = cached(path, engine)
        if p is not None:
            return p
    p = measure(path, progress=progress, engine=engine, **{**(QUICK if quick else {}), **measure_args})
    try:
        save(p)
    except OSError:
        pass  # a read-only cache directory: use the measurement without keeping it
    return p
