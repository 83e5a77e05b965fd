"""The torch CUDA path: skipped without a GPU; the staging logic it uses is also tested on the CPU."""

import numpy as np
import pytest
import torch

import flashllm
from flashllm.backends.torch.staging import StagingRing

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


# -- the same checks as the CPU suite's, on the GPU: every family, mode, storage and quantization ----------
from tiny import FAMILIES, MOE_FAMILIES  # noqa: E402

MODES = (("naive", {}), ("hybrid", {"hybrid_fraction": 0.5}), ("sparse", {"predictor": "oracle", "window": 2}))


def close_to(got, want, share):
    """got within `share` of want's largest magnitude (GPU kernels sum in another order than the CPU's)."""
    assert np.abs(got - want).max() <= share * np.abs(want).max(), np.abs(got - want).max()


@cuda
@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(MOE_FAMILIES))
def test_cuda_dense_matches_cpu_in_every_family(tiny_models, family):
    tiny = tiny_models(family)
    ref = flashllm.load(tiny.model_dir).logits(IDS, prefill=6)
    close_to(flashllm.load(tiny.model_dir, device="cuda").logits(IDS, prefill=6), ref, 1e-3)
    if family not in MOE_FAMILIES:  # in bfloat16 a router may pick another expert: no bound to hold
        close_to(flashllm.load(tiny.model_dir, device="cuda", dtype="bfloat16").logits(IDS, prefill=6), ref, 6e-2)


@cuda
@pytest.mark.parametrize("family", ["opt", "llama-relu", "mixtral", "qwen2_moe"])
def test_cuda_every_mode_matches_cuda_dense(tiny_models, family):
    """naive, hybrid and sparse (oracle, window 2; experts for MoE) on the GPU equal dense on the GPU."""
    tiny = tiny_models(family)
    dense = flashllm.load(tiny.model_dir, device="cuda").logits(IDS, prefill=6)
    for mode, kw in MODES:
        if family in MOE_FAMILIES and mode != "sparse":
            continue
        kw = {} if family in MOE_FAMILIES else kw
        model = flashllm.load(tiny.model_dir, device="cuda", mode=mode, **kw)
        np.testing.assert_allclose(model.logits(IDS, prefill=6), dense, atol=1e-4, rtol=1e-4, err_msg=mode)
        assert model.stats["bytes_read"] > 0 and model.stats["gpu_bytes"] > 0


@cuda
@pytest.mark.parametrize("family", ["llama-relu", "qwen2_moe"])
def test_cuda_quantized_storage_and_kv_match_the_cpu(tiny_models, tmp_path, family):
    """int4 bundles + int8 KV: every mode on the GPU equals GPU dense, and GPU dense equals CPU dense."""
    from flashllm.converters import convert

    out = convert(tiny_models(family).ckpt, tmp_path / "q", dtype="float16", quantize="int4", group_size=32,
                  progress=False)
    opts = dict(kv_bits=8, dtype="float32")
    cpu = flashllm.load(out, **opts).logits(IDS, prefill=4)
    dense = flashllm.load(out, device="cuda", **opts).logits(IDS, prefill=4)
    # the CPU's int4 expert kernel takes its input in bfloat16 (torch's int4pack kernel): 0.6% on the H100
    close_to(dense, cpu, 1e-2 if family in MOE_FAMILIES else 1e-3)
    for mode, kw in MODES:
        if family in MOE_FAMILIES and mode != "sparse":
            continue
        model = flashllm.load(out, device="cuda", mode=mode, **opts, **({} if family in MOE_FAMILIES else kw))
        np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-4, rtol=1e-4, err_msg=mode)


@cuda
def test_cuda_refuses_resident_quantization_at_load(tiny_models):
    """The resident int8/int4 kernels are torch's CPU ones: on CUDA a clear error at load, not a failure later."""
    from flashllm.errors import FlashLLMError

    with pytest.raises(FlashLLMError, match="--quantize-resident none"):
        flashllm.load(tiny_models("llama").model_dir, device="cuda", quantize_resident="int4")


@cuda
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_cuda_batch_equals_one_at_a_time(tiny_models, mode):
    tiny = tiny_models("llama-relu")
    kw = dict(predictor="oracle", window=2) if mode == "sparse" else {}
    prompts = [IDS[:5], IDS[3:12], IDS[7:9]]
    alone = flashllm.load(tiny.model_dir, device="cuda", mode=mode, **kw)
    want = [list(alone.generate_ids(p, 6)) for p in prompts]
    model = flashllm.load(tiny.model_dir, device="cuda", mode=mode, batch_size=len(prompts), **kw)
    model.generate_batch(prompts, max_new_tokens=6)
    assert [g.token_ids for g in model.last_generations] == want


@cuda
def test_cuda_trained_predictors_generate_what_the_cpu_generates(tmp_path):
    """The embedded model with its trained low-rank predictors, sparse at a 90% budget (float32, context
    256): the GPU's greedy tokens equal the CPU's."""
    from flashllm.cli.demo import prepare

    model_dir = prepare(tmp_path / "tiny-opt")
    cpu = flashllm.load(model_dir, mode="sparse", dram_budget=0.9, context=256)
    gpu = flashllm.load(model_dir, device="cuda", mode="sparse", gpu_budget=0.9, context=256)
    prompt = cpu.tokenizer.encode("def main():")
    assert list(gpu.generate_ids(prompt, 24)) == list(cpu.generate_ids(prompt, 24))
    assert gpu.stats["bytes_read"] > 0
