"""The native int8/int4 kernels over quantized bundle parts as stored (flashllm/format/quant.py's layout): each kernel against the
float32 math of the dequantized values (every scheme, group sizes, strided rows, row-index lists accumulated in two
calls, threads, the portable C path), and the runtime against its torch path (FLASHLLM_NATIVE=0, rows dequantized
when read) and dense mode, for every family the quantized tests cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashllm
from flashllm.backends.torch.native import NativeKernels
from flashllm.backends.torch.quant import QuantRows
from flashllm.converters import convert
from flashllm.format.quant import QuantScheme
from test_native import IDS, kernel_sets, needs_native, reference_ffn

SCHEMES = [(name, scheme) for name in ("int4", "int8") for scheme in ("asymmetric", "symmetric")]


def quant_store(q: QuantScheme, n: int, d: int, parts: int, pad: int = 6, seed: int = 0):
    """n bundle rows of `parts` quantized parts and `pad` bytes (a row stride != any part's) and the float32
    values the parts stand for ([n, d] per part)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(parts, n, d, generator=g) * d ** -0.5).numpy()
    raw = np.concatenate([q.quantize(p) for p in w] + [np.full((n, pad), 255, np.uint8)], axis=1)
    pb = q.part_bytes(d)
    rows = [QuantRows(raw, k * pb, q, d) for k in range(parts)]
    return rows, [torch.from_numpy(q.dequantize(raw[:, k * pb:(k + 1) * pb], d)) for k in range(parts)]


def _close(got, ref, dtype):
    """float32 sums in another order (float32 compute), or one rounding of an intermediate (16-bit compute)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype] * float(ref.abs().max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


@needs_native
@pytest.mark.parametrize("name,scheme", SCHEMES)
@pytest.mark.parametrize("group", [8, 16, 6])
def test_quantized_matvec_matches_the_dequantized_rows(name, scheme, group):
    q = QuantScheme.named(name, group, scheme)
    (w,), (values,) = quant_store(q, 203, 48, 1)
    x, bias = torch.randn(1, 48), torch.randn(203)
    for dtype in (torch.float32, torch.bfloat16):
        xd, bd = x.to(dtype), bias.to(dtype)
        ref = xd.float() @ values.t() + bd.float()
        for kname, lib in kernel_sets():
            for threads in (1, 3):
                y = NativeKernels(lib, threads).qlinear(xd, w, bd)
                assert y.dtype == dtype
                _close(y.float(), ref.to(dtype).float(), dtype)


@needs_native
@pytest.mark.parametrize("name,scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_ffn_rows_and_index_lists(name, scheme, dtype):
    """Gated FFN over quantized rows, with biases, in two calls over index lists into one float32 sum (and a
    resident gate's pre-activations with a threshold) equals the float32 math of the dequantized values; a
    dropped row is outside the tolerance."""
    q = QuantScheme.named(name, 16, scheme)
    n, d = 90, 64
    (gate, up, down), values = quant_store(q, n, d, 3, seed=1)
    rows, vals = {"gate": gate, "up": up, "down": down}, dict(zip(("gate", "up", "down"), values))
    x, ub = torch.randn(1, d).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    first, second = np.array([70, 3, 9, 44, 12, 5, 88, 60, 61, 0, 7, 8]), np.array([1, 2, 89, 30])
    both = np.concatenate([first, second])
    ref = reference_ffn(x, vals, "silu", up_bias=ub, index=both)
    for kname, lib in kernel_sets():
        for threads in (1, 2):
            kern, acc = NativeKernels(lib, threads), torch.zeros(1, d)
            for idx in (first, second):
                assert kern.ffn(x, rows, ub, None, None, "silu", 0.0, None, idx, acc, True) is acc
            _close(acc, ref, dtype)
    top = max(both, key=lambda r: float(reference_ffn(x, vals, "silu", up_bias=ub, index=[r]).abs().max()))
    with pytest.raises(AssertionError):
        _close(acc, reference_ffn(x, vals, "silu", up_bias=ub, index=both[both != top]), dtype)
    pre = torch.randn(1, n).to(dtype)
    ref = reference_ffn(x, {"up": vals["up"], "down": vals["down"]}, "silu", gate_pre=pre, threshold=0.3)
    acc = torch.zeros(1, d)
    NativeKernels(kernel_sets()[0][1], 2).ffn(x, {"up": up, "down": down}, None, None, pre, "silu", 0.0, 0.3, None,
                                              acc, True)
    _close(acc, ref, dtype)
    with pytest.raises(IndexError):
        NativeKernels(kernel_sets()[0][1], 1).ffn(x, rows, None, None, None, "silu", 0.0, None, np.array([n]), acc, True)


@needs_native
@pytest.mark.parametrize("name,scheme", SCHEMES)
def test_quantized_ffn_sum_is_the_same_bits_at_any_thread_count(name, scheme):
    """As the float kernel: the quantized FFN's sum (the int4 fast path's de-interleaved one too) is the same bits
    at 1, 2 and 5 threads and on repeated calls."""
    q = QuantScheme.named(name, 16, scheme)
    n, d = 600, 64
    (gate, up, down), _ = quant_store(q, n, d, 3, seed=2)
    rows, x = {"gate": gate, "up": up, "down": down}, torch.randn(1, d).to(torch.bfloat16)
    for kname, lib in kernel_sets():
        sums = []
        for threads in (1, 2, 5, 2, 2):
            acc = torch.zeros(1, d)
            assert NativeKernels(lib, threads).ffn(x, rows, None, None, None, "silu", 0.0, None, None, acc, True) is acc
            sums.append(acc)
        assert all(torch.equal(other, sums[0]) for other in sums[1:]), kname


def _logits(out, monkeypatch, native: bool, **kw):
    monkeypatch.setenv("FLASHLLM_NATIVE", "1" if native else "0")
    model = flashllm.load(out, dtype="float32", **kw)
    return model.logits(IDS, prefill=3), model


@needs_native
@pytest.mark.parametrize("name", ["int4", "int8"])
def test_quantized_models_native_equal_torch_dense_and_sparse(tiny, tmp_path, monkeypatch, name):
    """Every family, float32 compute: the native kernels over rows as stored give the torch path's logits (rows
    dequantized when read) up to float32 summation order, in dense mode, hybrid (two calls per layer) and sparse
    mode with the oracle (== dense); the cache holds the stored bytes (4-8x smaller rows than dequantized ones)."""
    out = convert(tiny.ckpt, tmp_path / name, dtype="float16", quantize=name, group_size=16, progress=False)
    torch_dense, _ = _logits(out, monkeypatch, False)
    scale = float(np.abs(torch_dense).max())
    for mode, kw in (("dense", {}), ("hybrid", {"hybrid_fraction": 0.5}), ("sparse", dict(predictor="oracle", window=2))):
        ours, model = _logits(out, monkeypatch, True, mode=mode, **kw)
        assert model.backend.native.calls["qffn"] > 0 and "int8/int4 FFN rows as stored" in model.stats["kernels"]
        np.testing.assert_allclose(ours, torch_dense, rtol=0, atol=2e-5 * scale, err_msg=mode)
    theirs, off = _logits(out, monkeypatch, False, mode="sparse", predictor="oracle", window=2)
    assert off.backend.native is None
    np.testing.assert_allclose(theirs, torch_dense, rtol=0, atol=2e-5 * scale)
    row_bytes = model.backend.cache_row_bytes(model.manifest.layout)
    assert row_bytes < off.backend.cache_row_bytes(off.manifest.layout) / 3
