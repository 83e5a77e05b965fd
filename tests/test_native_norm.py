"""The native RMS norm (kernels.c fl_rmsnorm): torch's tuned norm within a rounding (machine and portable builds,
float16 and bfloat16, several rows and per-head shapes), and the runtime's norms take it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashllm
from flashllm.backends import native
from flashllm.backends.torch.native import NativeKernels

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels here: {native.describe()}")


@pytest.mark.parametrize("build", ["machine", "portable"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 200), (2, 4, 24)])
def test_rms_norm_matches_the_torch_path(build, dtype, shape):
    lib = native.library() if build == "machine" else native.Kernels(ctypes.CDLL(str(native.build(portable=True))))
    kernels = NativeKernels(lib, 2)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    ref = (w * F.rms_norm(x.float(), (shape[-1],), eps=1e-5).to(dtype)).float()
    got = kernels.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape and kernels.calls["norm"] == 1
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7  # a rounding of the scale may flip the last bit
    np.testing.assert_allclose(got.float(), ref, rtol=2 * ulp, atol=2 * ulp * float(ref.abs().max()) * 2 ** -6)
    assert kernels.rms_norm(x.float(), w.float(), 1e-5) is None  # float32 stays on torch


def test_the_runtime_norms_run_natively(tiny_models, tmp_path, monkeypatch):
    from flashllm.converters import convert

    out = convert(tiny_models("llama").ckpt, tmp_path / "f16", dtype="float16", progress=False)
    ids = [1, 17, 33, 5, 60, 8]
    fast = flashllm.load(out, mode="dense")
    got = fast.logits(ids, prefill=3)
    assert fast.backend.native.calls["norm"] >= 2 * fast.spec.n_layers + 1
    monkeypatch.setenv("FLASHLLM_NATIVE", "0")
    np.testing.assert_allclose(got, flashllm.load(out, mode="dense").logits(ids, prefill=3), atol=0.02, rtol=0.02)


@pytest.mark.parametrize("build", ["machine", "portable"])
def test_matvec_of_short_rows_in_long_chunks_matches_float32(build):
    """A predictor-shaped product (many 40-wide rows: chunks of thousands of rows) and its bias, as the float32 sum."""
    lib = native.library() if build == "machine" else native.Kernels(ctypes.CDLL(str(native.build(portable=True))))
    g = torch.Generator().manual_seed(5)
    w, x, b = (torch.randn(*s, generator=g).to(torch.float16) for s in ((9001, 40), (1, 40), (9001,)))
    ref = (x.float() @ w.float().t() + b.float()).to(torch.float16).float()
    for threads in (1, 2, 3):
        y = NativeKernels(lib, threads).linear(x, w, b)
        np.testing.assert_allclose(y.float(), ref, rtol=2 ** -10, atol=1e-6)
