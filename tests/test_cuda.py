"""The torch CUDA path: skipped without a GPU; the staging logic it uses is also tested on the CPU."""

import numpy as np
import pytest
import torch

import flashllm
from flashllm.backends.staging import StagingRing

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12, 3, 71, 29, 55, 9, 40, 7, 19, 23, 31]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def test_staging_ring_alternates_aligned_buffers_on_cpu():
    ring = StagingRing(rows=4, stride=64, device=torch.device("cpu"))
    first, second, third = ring.acquire(), ring.acquire(), ring.acquire()
    assert (first, second, third) == (0, 1, 0)
    assert all(b.ctypes.data % 4096 == 0 and b.shape == (4, 64) for b in ring.buffers)
    assert ring.nbytes == 2 * 4 * 64


def test_staging_ring_copies_rows_with_a_cast():
    ring = StagingRing(rows=3, stride=32, device=torch.device("cpu"))
    values = np.arange(3 * 16, dtype=np.float16).reshape(3, 16)
    b = ring.acquire()
    ring.buffers[b][:, :] = values.view(np.uint8)
    matrix = torch.zeros(5, 16, dtype=torch.float32)
    ring.copy_rows(b, torch.from_numpy(ring.buffers[b][:3]).view(torch.float16)[:, :16], matrix, np.array([4, 0, 2]))
    np.testing.assert_array_equal(matrix[[4, 0, 2]].numpy(), values.astype(np.float32))
    assert not matrix[[1, 3]].any()


@cuda
@pytest.mark.parametrize("family", ["opt", "llama", "falcon-new", "persimmon"])
def test_cuda_dense_matches_cpu(tiny_models, family):
    tiny = tiny_models(family)
    ref = flashllm.load(tiny.model_dir).logits(IDS, prefill=6)
    gpu = flashllm.load(tiny.model_dir, device="cuda").logits(IDS, prefill=6)
    np.testing.assert_allclose(gpu, ref, atol=2e-3, rtol=2e-3)  # TF32/fused kernels on the GPU
    half = flashllm.load(tiny.model_dir, device="cuda", dtype="float16").logits(IDS, prefill=6)
    assert np.abs(half - ref).max() < 3e-2 * np.abs(ref).max()


@cuda
@pytest.mark.parametrize("family", ["opt", "llama-relu", "persimmon"])
def test_cuda_sparse_oracle_matches_cuda_dense(tiny_models, family):
    tiny = tiny_models(family)
    dense = flashllm.load(tiny.model_dir, device="cuda")
    sparse = flashllm.load(tiny.model_dir, device="cuda", mode="sparse", predictor="oracle", threads=4)
    np.testing.assert_allclose(sparse.logits(IDS, prefill=6), dense.logits(IDS, prefill=6), atol=1e-4, rtol=1e-4)
    assert sparse.stats["gpu_bytes"] > 0
    prompt = IDS[:5]
    assert list(sparse.generate_ids(prompt, 10)) == list(dense.generate_ids(prompt, 10))
    cpu = flashllm.load(tiny.model_dir)
    assert list(cpu.generate_ids(prompt, 10)) == list(dense.generate_ids(prompt, 10))


@cuda
def test_cuda_budgets_are_separate(tiny_models):
    tiny = tiny_models("opt")
    model = flashllm.load(tiny.model_dir, device="cuda", mode="sparse", predictor="oracle", dtype="float16",
                          gpu_budget=0.9, dram_budget=0.5)
    model.logits(IDS[:8], prefill=4)
    stats = model.stats
    assert stats["gpu_bytes"] <= stats["gpu_budget"] and stats["dram_bytes"] <= stats["dram_budget"]
