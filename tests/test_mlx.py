"""The MLX backend beyond the parity runner (tests/test_parity.py: dense, every mode, greedy tokens, float16):
sliding windows inside the prompt, small caches, half-precision files, predictors, devices and budgets.

Runs on MLX's CPU build on Linux (slow reference BLAS: short sequences only) and on Metal on a Mac.
"""

import shutil

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")

import flashllm  # noqa: E402
from tiny import write_random_predictors  # noqa: E402

rng = np.random.default_rng(1)
IDS = [int(t) for t in rng.integers(3, 96, size=14)]  # a 6-token prompt, then 8 decode steps
PREFILL = 6
FLOAT16_ATOL = 5e-2  # logits of magnitude ~5; measured max error 0.019 (torch float16: 0.023)


def mlx_model(model_dir, mode="dense", **kw):
    return flashllm.load(model_dir, backend="mlx", mode=mode, threads=2, **kw)


def test_mlx_sliding_window_inside_the_prompt(tiny_models):
    tiny = tiny_models("mistral")  # window 8 < a 14-token prompt: the prefill mask applies the window
    ref = flashllm.load(tiny.model_dir, mode="dense").logits(IDS)
    np.testing.assert_allclose(mlx_model(tiny.model_dir).logits(IDS), ref, atol=1e-4, rtol=1e-4)


def test_mlx_small_cache_swaps_and_chunks_exactly(tiny_models):
    """Caches of 80 and 72 rows (of 128 neurons): chunked prefill, swap-delete, a shrinking window and
    (at 72, below one token's active set) dropped neurons, all as on torch."""
    tiny = tiny_models("opt")
    dense = mlx_model(tiny.model_dir).logits(IDS, prefill=PREFILL)
    for capacity in (80, 72):
        runs = {}
        for backend in ("mlx", "torch"):
            full = flashllm.load(tiny.model_dir, backend=backend, mode="sparse", predictor="oracle")
            budget = full.backend.nbytes() + full.backend.staging_bytes(full.layout.stride) + \
                2 * capacity * full.compute_row_bytes()
            model = flashllm.load(tiny.model_dir, backend=backend, mode="sparse", predictor="oracle",
                                  dram_budget=budget, window=8, threads=2, read_ahead=False)
            assert model.stats["cache_capacity"] == [capacity] * model.spec.n_layers
            runs[backend] = (model.logits(IDS, prefill=PREFILL), model.stats)
            assert model.stats["dram_bytes"] <= budget
        (ours, stats), (ref, ref_stats) = runs["mlx"], runs["torch"]
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
        for key in ("neurons_dropped", "neurons_loaded_per_layer", "neurons_cached_per_layer", "bytes_read"):
            assert stats[key] == ref_stats[key], key
        assert stats["prompt"]["strategy"] == "dense-stream"  # 128 neurons through 80 or 72 rows: chunked
        if capacity == 80:
            assert stats["neurons_dropped"] == 0
            np.testing.assert_allclose(ours, dense, atol=1e-5, rtol=1e-5)
        else:
            assert stats["neurons_dropped"] > 0
    for key in ("bytes_read", "reads", "io_ms", "mem_ms", "compute_ms", "total_ms"):
        assert stats[key] > 0, key  # sparse decode reads, places and computes every token
    parts = stats["io_ms"] + stats["mem_ms"] + stats["compute_ms"] + stats["predictor_ms"]
    assert parts == pytest.approx(stats["total_ms"], rel=1e-6)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_mlx_half_storage_matches_torch(tiny_models, tmp_path, storage):
    """Half-precision files (bfloat16 crosses to MLX as bit patterns) computed in float32 on both backends."""
    from flashllm.converters import convert

    model_dir = convert(tiny_models("llama").ckpt, tmp_path / storage, dtype=storage, progress=False)
    ref = flashllm.load(model_dir, mode="dense", dtype="float32").logits(IDS, prefill=PREFILL)
    for mode, kw in (("dense", {}), ("sparse", dict(predictor="oracle")), ("naive", {})):
        ours = mlx_model(model_dir, mode, dtype="float32", **kw).logits(IDS, prefill=PREFILL)
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4, err_msg=mode)


@pytest.mark.parametrize("family", ["opt", "llama-relu"])
def test_mlx_lowrank_predictor_matches_torch(tiny_models, tmp_path, family):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models(family).model_dir, model_dir)
    write_random_predictors(model_dir)
    # torch reads ahead by default where reads land in its cache rows; MLX's never do: compare without
    ref = flashllm.load(model_dir, mode="sparse", predictor="lowrank", threads=2, read_ahead=False)
    ours = mlx_model(model_dir, "sparse", predictor="lowrank")
    np.testing.assert_allclose(ours.logits(IDS, prefill=PREFILL), ref.logits(IDS, prefill=PREFILL),
                               atol=1e-4, rtol=1e-4)
    assert ours.stats["neurons_loaded_per_layer"] == ref.stats["neurons_loaded_per_layer"]
    assert ours.stats["bytes_read"] == ref.stats["bytes_read"]


def test_mlx_device_errors(tiny_models):
    model_dir = tiny_models("opt").model_dir
    with pytest.raises(flashllm.FlashLLMError, match="--backend torch"):
        mlx_model(model_dir, device="cuda")
    with pytest.raises(flashllm.FlashLLMError, match="cpu and gpu"):
        mlx_model(model_dir, device="tpu")
    if not mx.is_available(mx.gpu):
        with pytest.raises(flashllm.FlashLLMError, match="device 'gpu'"):
            mlx_model(model_dir, device="gpu")
    with pytest.raises(flashllm.FlashLLMError, match="dtype"):
        mlx_model(model_dir, dtype="int8")


def test_mlx_caches_hold_as_many_rows_as_torch_at_the_demos_settings(tmp_path):
    """The demo's settings (the embedded model, 50%, bfloat16 rows cast from float32 on insert, context 256,
    its shipped predictors): MLX's one staging buffer costs what torch's does, so its neuron caches get
    the same rows. At the old 8 MiB bound the buffer was a whole layer (2 MiB of an 11.3 MiB budget)
    and MLX's caches held 1585 rows against torch's 3370 (more flash reads, dropped neurons)."""
    from flashllm.cli import demo

    model_dir = demo.prepare(tmp_path / "tiny-opt")
    models = {b: flashllm.load(model_dir, backend=b, mode="sparse", dram_budget=0.5, window=4, dtype="bfloat16",
                               context=256) for b in ("torch", "mlx")}
    stride = models["mlx"].layout.stride
    assert models["mlx"].backend.staging_bytes(stride) <= models["torch"].backend.staging_bytes(stride)
    assert models["mlx"].stats["cache_capacity"] == models["torch"].stats["cache_capacity"]


def test_mlx_budget_error_says_a_float16_file_computes_in_float32(tiny_models, tmp_path):
    """MLX's CPU build computes float16 files in float32 (twice the bytes per cached row and resident
    weight); a budget too small says so and names dtype='float16', which keeps the file's dtype."""
    from flashllm.converters import convert

    model_dir = convert(tiny_models("llama").ckpt, tmp_path / "f16", dtype="float16", progress=False)
    with pytest.raises(flashllm.FlashLLMError) as err:
        mlx_model(model_dir, "sparse", predictor="oracle", dram_budget=4096)
    if mx.default_device() == mx.cpu:
        assert "dtype='float16' (this float16 file computes in float32 by default with backend='mlx'" in str(err.value)
        assert "--dtype float16" in err.value.cli_message()
    with pytest.raises(flashllm.FlashLLMError) as err:  # asked for float32: no word on the default
        mlx_model(model_dir, "sparse", predictor="oracle", dram_budget=4096, dtype="float32")
    assert "by default" not in str(err.value) and "dtype='bfloat16' (halves" in str(err.value)
    with pytest.raises(flashllm.FlashLLMError) as err:  # torch computes float16 files in float16 on the CPU
        flashllm.load(model_dir, mode="sparse", predictor="oracle", dram_budget=4096)
    assert "by default" not in str(err.value)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_mlx_experts_in_quantized_slots_go_through_gather_qmm(tiny_models, tmp_path, quant, monkeypatch):
    """Experts kept in MLX's affine format are computed with one `mx.gather_qmm` per part for all routed
    experts of a call: equal to one `mx.quantized_matmul` per expert (the same products; the float32 sum of a
    token's experts in another order) and to torch on the dequantized experts within float32 rounding."""
    from flashllm.backends.mlx import backend as mlx_backend
    from flashllm.backends.mlx.quant import QuantArray
    from flashllm.converters import convert

    out = convert(tiny_models("qwen2_moe").ckpt, tmp_path / quant, dtype="float32", quantize=quant, group_size=32,
                  progress=False)
    ref = flashllm.load(out, mode="dense", kernels="plain").logits(IDS, prefill=PREFILL)  # torch, dequantized
    calls, real = [0], QuantArray.gather_matmul

    def counted(self, x, slots):
        calls[0] += 1
        return real(self, x, slots)

    monkeypatch.setattr(QuantArray, "gather_matmul", counted)
    runs = {}
    for mode in ("dense", "sparse"):
        gathered = mlx_model(out, mode, device="cpu").logits(IDS, prefill=PREFILL)
        assert calls[0] > 0, mode
        with monkeypatch.context() as m:  # one quantized_matmul per expert instead
            m.setattr(mlx_backend, "_slot_rows", lambda first, rows: False)
            calls[0] = 0
            per_expert = mlx_model(out, mode, device="cpu").logits(IDS, prefill=PREFILL)
            assert calls[0] == 0
        np.testing.assert_allclose(gathered, per_expert, atol=1e-5, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(gathered, ref, atol=1e-4, rtol=1e-4, err_msg=mode)
        runs[mode] = gathered
    np.testing.assert_allclose(runs["sparse"], runs["dense"], atol=1e-5, rtol=1e-5)
