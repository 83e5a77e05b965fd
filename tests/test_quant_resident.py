"""Quantized resident matrices (--quantize-resident), the int8 KV cache (--kv-bits 8), MLX's quantized
FFN rows, and predictors trained on quantized models."""

import numpy as np
import pytest
import torch

import flashllm
from flashllm.cli.main import main
from flashllm.converters import convert

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12, 3, 77]
BF16_EPS = 2.0 ** -8  # relative spacing of bfloat16 (activations and outputs of torch's CPU kernels)
# max |logit error| / max |logit| of dense mode vs the float32 model on these random checkpoints
# (measured: resident int8 0.010-0.047, int4 0.20-0.43; KV int8 0.004-0.014; the top from Gemma 2,
# whose soft-capped logits are small; random weights have no structure to lose)
BOUND = {"int8": 0.08, "int4": 0.6, "kv8": 0.03}
CONFIGS = {"int8": {"quantize_resident": "int8"}, "int4": {"quantize_resident": "int4"}, "kv8": {"kv_bits": 8}}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(96, 64), (40, 128), (48, 96)])
def test_quant_matrix_error_is_half_a_step_and_the_kernel_agrees(bits, shape):
    """Every dequantized weight is within half a stored step of the float one (int4: plus the bfloat16
    rounding of the group's zero point); the kernel's product equals x @ dequantized.T to bfloat16
    precision; row lookups return the same dequantized rows."""
    from flashllm.backends.torch.quant import QuantMatrix

    gen = torch.Generator().manual_seed(bits + shape[0])
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    q = QuantMatrix(w, bits, torch.float32, gather=True)
    back = q.rows(torch.arange(shape[0]))
    if bits == 8:
        step = q.scales.float()[:, None]
        allowed = step / 2 + 1e-6
    else:
        sz = q.scales.float()[:, :shape[0]].permute(1, 0, 2)  # [rows, groups, (scale, zero)]
        step = sz[..., 0].repeat_interleave(q.group, dim=1)
        allowed = step / 2 + sz[..., 1].abs().repeat_interleave(q.group, dim=1) * BF16_EPS + 1e-6
    assert ((back - w).abs() <= allowed).all()
    assert (step * {8: 127, 4: 15}[bits] <= 2.05 * w.abs().amax(1, keepdim=True) + 1e-6).all()  # steps are tight
    x = torch.randn(5, shape[1], generator=gen)
    ref = x.bfloat16().float() @ back.t()
    y = q.linear(x)
    assert y.shape == (5, shape[0])
    assert (y - ref).abs().max() <= 4 * BF16_EPS * (x.abs() @ back.abs().t()).max()
    assert q.nbytes < w.numel() * 4 / 3  # float32 / 3 (int4 keeps a row-gatherable copy too)
    assert QuantMatrix(w, bits, torch.float32).nbytes < w.numel() * 4 / (3 if bits == 8 else 5)


def test_int8_kv_cache_stores_within_half_a_step():
    from types import SimpleNamespace

    from flashllm.backends.torch.quant import KVCache

    spec = SimpleNamespace(n_layers=2, n_kv_heads=3, head_dim=128)
    kv = KVCache(spec, 16, torch.float32, "cpu", bits=8)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 3, 128, generator=gen) * 4, torch.randn(5, 3, 128, generator=gen)
    kv.update(1, 0, k[:3], v[:3], 0)
    keys, vals = kv.update(1, 3, k[3:], v[3:], 1)  # a decode step reads lo..end
    assert keys.shape == vals.shape == (3, 4, 128) and kv.group == 64  # head-major
    for new, got in ((k[1:], keys.transpose(0, 1)), (v[1:], vals.transpose(0, 1))):
        g = new.reshape(4, 3, 2, 64)
        half_step = ((g.amax(-1) - g.amin(-1)) / 255 / 2)[..., None]
        assert ((got.reshape(g.shape) - g).abs() <= half_step * (1 + 1e-5) + 1e-6).all()
        assert (got != new).any()
    assert kv.nbytes() < KVCache(spec, 16, torch.float32, "cpu").nbytes() / 3


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_quantized_resident_and_kv_stay_within_bound_on_every_family(tiny, config):
    """Dense mode with resident int8/int4 matrices or an int8 KV cache, against the float32 model."""
    exact = flashllm.load(tiny.model_dir).logits(IDS, prefill=4)
    model = flashllm.load(tiny.model_dir, **CONFIGS[config])
    ours = model.logits(IDS, prefill=4)
    err = np.abs(ours - exact).max()
    assert 0 < err <= BOUND[config] * np.abs(exact).max()
    assert model.stats["dram_bytes"] < flashllm.load(tiny.model_dir).stats["dram_bytes"]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_every_mode_with_everything_quantized_matches_dense(tiny_models, tmp_path, backend):
    """int4 bundles + int4 resident + int8 KV: naive, hybrid and sparse (oracle, window 2) equal dense
    mode with the same options; MLX keeps the bundles quantized in its caches and agrees with torch."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    out = convert(tiny_models("llama-relu").ckpt, tmp_path / "q", dtype="float16", quantize="int4", progress=False)
    opts = dict(backend=backend, quantize_resident="int4", kv_bits=8, dtype="float32")
    dense = flashllm.load(out, **opts).logits(IDS, prefill=4)
    for mode, kw in (("naive", {}), ("hybrid", {"hybrid_fraction": 0.5}),
                     ("sparse", {"predictor": "oracle", "window": 2})):
        model = flashllm.load(out, mode=mode, **opts, **kw)
        np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-4, rtol=1e-4)
        assert model.stats["quantization"] == {"ffn": "int4 asymmetric g64", "resident": "int4", "kv_bits": 8}
    if backend == "mlx":
        from flashllm.backends.mlx.quant import QuantArray

        # kept private: which array type MLX's cache rows hold is the backend's own (no stat names it); the
        # public bound on the rows' bytes follows
        store = model.mode_impl.caches[0].store
        assert isinstance(store.parts["up"], QuantArray) and store.parts["up"].bits == 4
        lay = model.layout
        assert model.compute_row_bytes() < len(lay.parts) * lay.d_model * model.backend.itemsize / 3
        torch_dense = flashllm.load(out, quantize_resident="none", kv_bits=8, dtype="float32").logits(IDS, prefill=4)
        mlx_dense = flashllm.load(out, backend="mlx", kv_bits=8, dtype="float32").logits(IDS, prefill=4)
        np.testing.assert_allclose(mlx_dense, torch_dense, atol=1e-4, rtol=1e-4)


def test_resident_quantization_leaves_room_for_the_cache(tiny_models):
    """At the same DRAM budget, int4 resident matrices give the sparse caches more rows."""
    d = tiny_models("opt").model_dir
    kw = dict(mode="sparse", predictor="oracle", dram_budget=0.9)
    plain, quant = flashllm.load(d, **kw), flashllm.load(d, quantize_resident="int4", **kw)
    assert quant.backend.nbytes() < plain.backend.nbytes()
    assert sum(quant.stats["cache_capacity"]) > sum(plain.stats["cache_capacity"])


def test_cli_stats_say_what_is_quantized(tiny_models, capsys):
    d = tiny_models("opt").model_dir
    code = main(["generate", str(d), "--prompt", "the quick", "--max-new-tokens", "2", "--stats",
                 "--quantize-resident", "int8", "--kv-bits", "8"])
    err = capsys.readouterr().err
    assert code in (0, None)
    assert "quantized: FFN bundles none, resident matrices int8, KV cache int8" in err
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(d), "--prompt", "x", "--kv-bits", "4"])
    assert exc.value.code == 2 and "--kv-bits" in capsys.readouterr().err


def test_predictors_train_on_a_quantized_model(tiny_models, tmp_path, capsys):
    """Calibration runs the quantized model (its activations differ from the float model's), and the
    trained predictors drive sparse mode on it."""
    from flashllm.predictors import collect as col
    from tiny import TEXT

    ckpt = tiny_models("opt").ckpt
    q = convert(ckpt, tmp_path / "q", dtype="float16", quantize="int4", progress=False)
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 6)
    masks = {}
    for name, d in (("float", tiny_models("opt").model_dir), ("int4", q)):
        model = col.open_model(d, seq_len=64)
        cal = col.collect(model, col.tokens_of(model, data, 64, 256), col.activation_rule(model.spec), progress=False)
        try:
            masks[name] = col.unpack_mask(cal.load(1)[1], cal.d_ffn)
        finally:
            cal.cleanup()
    assert masks["int4"].shape == masks["float"].shape and (masks["int4"] != masks["float"]).any()
    assert main(["predictors", "train", str(q), "--data", str(data), "--rank", "4", "--max-tokens", "256"]) in (0, None)
    assert (q / "predictors.json").is_file()
    # no hot-neuron pinning: with no budget it would pin every neuron at load and leave nothing to read
    sparse = flashllm.load(q, mode="sparse", predictor="lowrank", quantize_resident="int8", pin_hot=False)
    sparse.logits(IDS, prefill=4)
    assert sparse.stats["bytes_read"] > 0


def test_resident_matrices_are_quantized_as_they_are_read(tmp_path):
    """Loading with --quantize-resident quantizes each resident tensor straight from its stored bytes:
    the rise of the process's resident set during the load (the kernel's VmHWM in a fresh child
    process; bench/quant/load_peak.py) stays below the float copy of the resident weights and within
    what the loaded model holds plus one stored tensor and 32 MiB (the quantizer's CHUNK_VALUES
    temporaries, first-use buffers). Quantizing after loading every matrix in the compute dtype, as
    before, rose to 2x the float copy here (transient 237-264 MiB)."""
    from flashllm.format.spec import ArchSpec
    from bench.models import make_model
    from bench.quant import load_peak

    # embeddings and lm_head 32768 x 512 (32 MiB each in float16, 64 MiB in float32): far above the noise
    spec = ArchSpec(**make_model._shape(make_model.LLAMA, 32768, 512, 2, 8, 128, 64))
    model_dir = make_model.write_model(spec, tmp_path / "m", "float16", progress=False)
    MiB = 1 << 20
    for bits in ("int4", "int8"):
        # float32 compute: the float copy these bounds were set against (float16 files compute in float16 by default)
        r = load_peak.measure(model_dir, mode="dense", quantize_resident=bits, context=64, dtype="float32")
        assert r["resident_held"] < r["float_resident"] / 3, r  # the quantized matrices are what stays
        assert r["peak"] < r["float_resident"], r
        assert r["transient"] <= r["largest_tensor"] + 32 * MiB, r


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_naive_mode_quantizes_resident_layers_once_at_load(tiny_models, monkeypatch, bits):
    """Naive mode reads every layer per token, but quantizes its resident matrices once, at load (they
    used to be re-quantized from the stored floats on every token: 65.9 of 68.7 s per token on the 7B
    shape): no quantization while decoding, fewer bytes read per token than the stored floats, and
    the same logits as dense mode with the same options."""
    from flashllm.backends.torch.backend import TorchBackend

    calls = []
    real = TorchBackend.quantized
    monkeypatch.setattr(TorchBackend, "quantized", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    d = tiny_models("llama-relu").model_dir
    model = flashllm.load(d, mode="naive", quantize_resident=bits, dtype="float32")
    at_load = len(calls)
    logits = model.logits(IDS, prefill=4)  # a prompt, then 8 decode tokens
    assert len(calls) == at_load
    assert at_load >= 4 * model.spec.n_layers  # q, k, v, o of every layer (and embeddings, lm_head)
    dense = flashllm.load(d, quantize_resident=bits, dtype="float32").logits(IDS, prefill=4)
    np.testing.assert_allclose(logits, dense, atol=1e-4, rtol=1e-4)
    plain = flashllm.load(d, mode="naive", dtype="float32")
    plain.logits(IDS, prefill=4)
    assert model.stats["bytes_read"] < plain.stats["bytes_read"]
