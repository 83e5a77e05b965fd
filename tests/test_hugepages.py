"""Weights built at load (fused q/k/v, packed up+gate, transposed down) on 2 MiB huge pages (hugepages.py):
the buffers, the opt-out, and the same logits as torch's own allocations."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

import flashllm
from flashllm import hugepages


def test_empty_gives_writable_buffers_aligned_for_huge_pages(monkeypatch):
    for nbytes in (0, 100, hugepages.HUGE_PAGE - 1, hugepages.HUGE_PAGE, 3 * hugepages.HUGE_PAGE + 12345):
        buf = hugepages.empty(nbytes)
        assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable
        buf[:] = 7
        assert int(buf.sum()) == 7 * nbytes
        if nbytes >= hugepages.HUGE_PAGE and hugepages.enabled():
            assert buf.ctypes.data % hugepages.HUGE_PAGE == 0
    assert hugepages.enabled() == (hasattr(mmap, "MADV_HUGEPAGE"))
    if sys.platform.startswith("linux"):
        assert hugepages.enabled()
    monkeypatch.setenv("FLASHLLM_HUGEPAGES", "0")
    assert not hugepages.enabled()
    assert hugepages.empty(hugepages.HUGE_PAGE).base is None  # a plain numpy array


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_weights_on_huge_pages_give_the_same_logits(tiny_models, tmp_path, monkeypatch, mode):
    from flashllm.converters import convert

    out = convert(tiny_models("llama").ckpt, tmp_path / "f16", dtype="float16", progress=False)
    ids = [1, 17, 33, 5, 60, 8]
    load = dict(mode=mode) if mode == "dense" else dict(mode=mode, predictor="oracle")
    monkeypatch.setattr(hugepages, "HUGE_PAGE", 4096)  # the tiny model's fused weights take the mmap path
    mapped, empty = [], hugepages.empty
    monkeypatch.setattr(hugepages, "empty", lambda n: mapped.append(empty(n)) or mapped[-1])
    model = flashllm.load(out, **load)
    qkv = model.backend.w["layers.0.qkv.weight"]
    assert any(buf.ctypes.data == qkv.data_ptr() for buf in mapped) and qkv.data_ptr() % 4096 == 0
    if mode == "dense":  # the packed FFN too
        assert len(mapped) >= 3 * model.spec.n_layers
    got = model.logits(ids, prefill=3)
    monkeypatch.setenv("FLASHLLM_HUGEPAGES", "0")
    np.testing.assert_array_equal(got, flashllm.load(out, **load).logits(ids, prefill=3))
