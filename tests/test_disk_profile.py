"""The disk profile: measured with the flash engine, cached per disk, and a cost model that decides gaps."""

import json

import numpy as np
import pytest

from flashllm.io import disk_profile
from flashllm.io.disk_profile import DiskProfile
from flashllm.errors import FlashLLMError
from flashllm.io.reader import IOStats


def synthetic(per_read_us: float, mib_s: float) -> DiskProfile:
    """A profile whose cells follow per-read cost + size / bandwidth exactly."""
    sizes = [4096, 16384, 65536, 262144]
    rate = [[s / (per_read_us * 1e-6 + s / (mib_s * 2**20)) / 2**20 for s in sizes]]
    return DiskProfile(key="k", device="d", date="now", direct=True, sizes=sizes, inflight=[32], mibps=rate,
                       latency_us=[100.0] * 4)


def test_cost_model_recovers_per_read_cost_and_bandwidth():
    p = synthetic(50, 1000)
    per_read, bandwidth = p.cost_model(32)
    assert per_read == pytest.approx(50e-6, rel=1e-6) and bandwidth == pytest.approx(1000 * 2**20, rel=1e-6)
    assert p.gap_bytes(32) == pytest.approx(50e-6 * 1000 * 2**20, rel=1e-3)
    assert synthetic(10, 1000).gap_bytes(32) < p.gap_bytes(32) < synthetic(50, 3000).gap_bytes(32)
    assert p.read_seconds([4096] * 10, 32) == pytest.approx(10 * 50e-6 + 40960 / (1000 * 2**20))


class SimulatedDisk:
    """A reader over a disk where a read costs `per_read_s` + size / `bandwidth` (amortised, any depth), on a
    clock it advances itself; it records every (offset, size) read."""

    direct = True

    def __init__(self, per_read_s: float, bandwidth: float, call_s: float = 0.0):
        self.per_read_s, self.bandwidth, self.call_s, self.now, self.seen = per_read_s, bandwidth, call_s, 0.0, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def read_rows(self, base, stride, size, idx, dest, rows):
        self.now += self.call_s + len(idx) * (self.per_read_s + size / self.bandwidth)
        self.seen += [(int(i) * stride, size) for i in idx]
        return IOStats(bytes_read=len(idx) * size, reads=len(idx))


def test_measured_gap_is_the_simulated_disks_break_even(tmp_path, monkeypatch):
    """measure() on a disk with a known per-read cost and bandwidth derives exactly their product as the
    gap, and reads no piece of the scratch file twice within a cell."""
    disk = SimulatedDisk(per_read_s=60e-6, bandwidth=800 * 2**20)
    monkeypatch.setattr(disk_profile, "_clock", lambda: disk.now)
    p = disk_profile.measure(tmp_path, sizes=(4096, 65536, 1 << 20), inflight=(1, 32), seconds=0.01,
                             scratch_bytes=64 << 20, open_reader=lambda f, q, chunk: disk)
    assert p.direct and p.scratch_bytes == 64 << 20 and list(tmp_path.iterdir()) == []
    per_read, bandwidth = p.cost_model(32)
    assert per_read == pytest.approx(60e-6, rel=0.01) and bandwidth == pytest.approx(800 * 2**20, rel=0.01)
    assert p.gap_bytes(32) == pytest.approx(60e-6 * 800 * 2**20, rel=0.02)  # ~49 KiB
    assert p.latency_us[0] == pytest.approx(60 + 4096 / (800 * 2**20) * 1e6, rel=0.01)
    first_cell = [r for r in disk.seen if r[1] == 4096][:disk_profile.MIN_CALLS]
    assert len(set(first_cell)) == len(first_cell)


def test_call_cost_is_measured_apart_from_the_reads(tmp_path, monkeypatch):
    """On a disk where an engine call costs 500 us besides its reads, one-wave cells carry that cost in every
    read; the profile's call cost model recovers it, so a call of many reads is not charged it per wave."""
    from flashllm.planner import cost_model as costmodel

    disk = SimulatedDisk(per_read_s=20e-6, bandwidth=800 * 2**20, call_s=500e-6)
    monkeypatch.setattr(disk_profile, "_clock", lambda: disk.now)
    p = disk_profile.measure(tmp_path, sizes=(4096, 65536, 1 << 20), inflight=(1, 32), seconds=0.01,
                             scratch_bytes=64 << 20, open_reader=lambda f, q, chunk: disk)
    assert p.cost_model(32)[0] == pytest.approx(20e-6 + 500e-6 / 32, rel=0.01)  # one wave: the call in every read
    call, per_read, bandwidth = p.call_cost_model(32)
    assert call == pytest.approx(500e-6, rel=0.01) and per_read == pytest.approx(20e-6, rel=0.01)
    assert bandwidth == pytest.approx(800 * 2**20, rel=0.01)
    many = costmodel.io_s(p, 256, 256 * 4096, 32, calls=1)
    assert many == pytest.approx(500e-6 + 256 * (20e-6 + 4096 / (800 * 2**20)), rel=0.01)
    assert costmodel.io_s(p, 256, 256 * 4096, 32, calls=8) == pytest.approx(many + 7 * 500e-6, rel=0.01)
    assert synthetic(50, 1000).call_cost_model(32) is None  # a profile from before call costs: amortised model


def test_a_large_file_is_measured_in_place_without_a_scratch_file(tmp_path):
    big = tmp_path / "ffn.bin"
    big.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    said = []
    p = disk_profile.measure(big, sizes=(4096,), inflight=(2,), seconds=0.01, scratch_bytes=1 << 20,
                             progress=said.append)
    assert p.scratch_bytes == 0 and any("ffn.bin" in n for n in p.notes)
    assert said[0].startswith("disk, reader threads: random 4K reads, 2 in flight: ")  # what each line measures
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ffn.bin"] and big.stat().st_size == 1 << 20


def test_a_read_only_model_directory_is_measured_on_its_largest_file(tmp_path, monkeypatch):
    """`flashllm plan` on a read-only model directory: no scratch file can be written there, so the model's own
    ffn.bin is read (it said "no file to read there" with ffn.bin in the directory); a directory with no file
    large enough says what to do instead."""
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(disk_profile.tempfile, "mkstemp", read_only)
    model = tmp_path / "model"
    model.mkdir()
    (model / "flashllm.json").write_text("{}")
    (model / "ffn.bin").write_bytes(np.random.default_rng(0).bytes(1 << 20))
    small = dict(sizes=(4096,), inflight=(2,), seconds=0.01, scratch_bytes=64 << 20)
    p = disk_profile.measure(model, **small)
    assert p.scratch_bytes == 0 and any(str(model / "ffn.bin") in n and "read-only" in n for n in p.notes)
    assert sorted(x.name for x in model.iterdir()) == ["ffn.bin", "flashllm.json"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlashLLMError, match="not writable, and it holds no file large enough.*flashllm profile"):
        disk_profile.measure(tmp_path / "empty", **small)


def test_no_gap_from_a_profile_measured_without_direct_io():
    p = synthetic(50, 1000)
    assert p.gap_bytes(32) > 0
    p.direct = False  # a page cache served the reads: no physical cost model
    assert p.gap_bytes(32) == 0


def test_measure_caches_per_disk_and_refreshes(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "model"
    target.mkdir()
    small = dict(sizes=(4096, 65536), inflight=(1, 4), seconds=0.02, scratch_bytes=1 << 20)
    p = disk_profile.profile(target, **small)
    assert p.sizes == [4096, 65536] and p.inflight == [1, 4] and min(map(min, p.mibps)) > 0
    assert all(v > 0 for v in p.latency_us) and p.key == disk_profile.disk_key(target)
    assert list(target.iterdir()) == []  # the scratch file is gone
    cached = json.loads(disk_profile.cache_path(target).read_text())
    assert cached["format"] == "flashllm-disk-profile" and cached["mibps"] == p.mibps
    assert disk_profile.profile(target).date == p.date  # from the cache, not measured again
    assert disk_profile.profile(target, refresh=True, **dict(small, sizes=(4096, 8192))).sizes == [4096, 8192]
    assert "MiB/s" in p.table() and "read through" in p.table()


def test_unreadable_cache_is_measured_again_and_missing_path_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "cache"))
    path = disk_profile.cache_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "flashllm-disk-profile", "version": 1, "sizes": "garbage"}')
    assert disk_profile.cached(tmp_path) is None
    with pytest.raises(FlashLLMError, match="no such file"):
        disk_profile.measure(tmp_path / "nope")


def test_runtime_gap_comes_from_the_profile(tiny_models, tmp_path, monkeypatch):
    import flashllm

    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    tm = tiny_models("opt")
    p = synthetic(40, 2000)
    p.key = disk_profile.disk_key(tm.model_dir / "ffn.bin")
    disk_profile.save(p)
    model = flashllm.load(tm.model_dir, mode="sparse", predictor="oracle", threads=32, gap_bytes=None)
    assert model.stats["gap_bytes"] == min(p.gap_bytes(32), 1 << 20)  # up to the reader's largest read (1 MiB)
    assert flashllm.load(tm.model_dir, mode="sparse", predictor="oracle").stats["gap_bytes"] == 0  # default
    ids = np.arange(3, 12).tolist()
    np.testing.assert_allclose(model.logits(ids, prefill=2), flashllm.load(tm.model_dir, mode="dense").logits(
        ids, prefill=2), atol=1e-4, rtol=1e-4)
    assert model.stats["gap_bytes"] > 0 and model.stats["bytes_wasted"] > 0  # gaps were read through
