"""The int8-activation quantized kernels (backends/native/kernels_qdot.c): the mat-vec and several experts' FFN
equal W_hat . x_hat (dequantized weights times dequantized int8 activations) to float32 rounding, in the machine's
SIMD build and the portable C build; resident matrices and MoE experts of a model use them, a streamed MoE equals
the dense one, and both stay within the activations' rounding of the dequantized-expert result."""

from __future__ import annotations

import numpy as np
import pytest

import flashllm
from flashllm.backends import native
from flashllm.format.quant import QuantScheme
from tests.tiny import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels do not build")
IDS = [1, 7, 22, 5, 40, 9, 13, 61, 3, 30, 44, 2]


def x_hat(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: blocks of 32 values, int8 codes of the block's max |x| / 127."""
    b = x.reshape(-1, 32).astype(np.float64)
    dx = np.abs(b).max(1, keepdims=True) / 127
    return (np.clip(np.rint(b / np.where(dx == 0, 1, dx)), -127, 127) * dx).reshape(x.shape)


@pytest.fixture(scope="module", params=["simd", "portable"])
def kernels(request):
    import ctypes

    if request.param == "simd":
        return native.library()
    return native.Kernels(ctypes.CDLL(str(native.build(portable=True))))


@pytest.mark.parametrize("bits,scheme,group", [(4, "asymmetric", 64), (4, "symmetric", 128), (8, "symmetric", 64),
                                               (8, "asymmetric", 64), (4, "asymmetric", 32), (8, "symmetric", 32)])
def test_qmatmul_is_w_hat_times_x_hat(kernels, bits, scheme, group):
    rng = np.random.default_rng(bits * 7 + group)
    n, d, T = 100, 256, 3
    q = QuantScheme.named(f"int{bits}", group, scheme)
    raw = q.quantize(rng.normal(0, 0.05, (n, d)))
    x = rng.normal(0, 1, (T, d)).astype(np.float32)
    x[1, :32] = 0  # an all-zero block
    bias = rng.normal(0, 1, n).astype(np.float32)
    y = np.zeros((T, n), np.float32)
    assert kernels.qmatmul(bits, q.symmetric, group, raw.ctypes.data, n, d, raw.shape[1], 0, T, x.ctypes.data,
                           bias.ctypes.data, y.ctypes.data, 2) == 0
    want = x_hat(x) @ q.dequantize(raw, d).astype(np.float64).T + bias
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # the activations' rounding is the only difference from the dequantized weights' exact product, and it is small
    exact = x.astype(np.float64) @ q.dequantize(raw, d).astype(np.float64).T + bias
    assert 0 < np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


def test_qmatmul_refuses_rows_it_does_not_take(kernels):
    raw = np.zeros((4, 100), np.uint8)
    x, y = np.zeros(48, np.float32), np.zeros(4, np.float32)
    assert kernels.qmatmul(4, 0, 48, raw.ctypes.data, 4, 48, 100, 0, 1, x.ctypes.data, None, y.ctypes.data, 1) == -2


def test_experts_are_the_weighted_sum_of_each_experts_ffn(kernels):
    """Three experts over two tokens (pairs in any order) against numpy on the dequantized rows, silu, float32."""
    rng = np.random.default_rng(3)
    d, f, E = 128, 192, 3
    q = QuantScheme.named("int4", 64)
    part_in, part_down = q.part_bytes(d), q.part_bytes(f)
    gate, up = (q.quantize(rng.normal(0, 0.1, (E * f, d))).reshape(E, f, part_in) for _ in range(2))
    down = q.quantize(rng.normal(0, 0.1, (E * d, f))).reshape(E, d, part_down)
    ptrs = np.array([[gate[e].ctypes.data, up[e].ctypes.data, down[e].ctypes.data] for e in range(E)], np.int64)
    start = np.array([0, 2, 3, 4], np.int64)  # expert 0: both tokens; expert 1: token 1; expert 2: token 0
    tokens = np.array([0, 1, 1, 0], np.int64)
    weights = np.array([0.5, 0.25, 0.75, 0.5], np.float32)
    x = rng.normal(0, 1, (2, d)).astype(np.float32)
    acc = np.ones((2, d), np.float32)
    assert kernels.experts(4, 0, 64, E, ptrs.ctypes.data, start.ctypes.data, tokens.ctypes.data, weights.ctypes.data,
                           d, f, part_in, part_down, 0, 2, x.ctypes.data, native.ACTIVATIONS["silu"], 0.0,
                           acc.ctypes.data, 2) == 0
    want = np.ones((2, d))
    for e in range(E):
        for k in range(start[e], start[e + 1]):
            xs = x_hat(x[tokens[k]])
            g, u = (xs @ q.dequantize(m[e], d).astype(np.float64).T for m in (gate, up))
            h = g / (1 + np.exp(-g)) * u
            want[tokens[k]] += weights[k] * (x_hat(h.astype(np.float32)) @ q.dequantize(down[e], f).astype(np.float64).T)
    np.testing.assert_allclose(acc, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_stream_read_reads_every_byte():
    lib = native.library()
    buf = np.zeros(3 << 20, np.uint8)
    zero = lib.stream_read(buf.ctypes.data, buf.nbytes, 2)
    buf[(3 << 20) - 5] = 1
    assert lib.stream_read(buf.ctypes.data, buf.nbytes, 2) != zero


@pytest.fixture(scope="module", params=["int4", "int8"])
def moe64(request, tmp_path_factory):
    """A Qwen3-MoE of d_model 64 and experts of 64 neurons, experts quantized in groups of 64 (the kernels' layout)."""
    from flashllm.converters import convert

    root = tmp_path_factory.mktemp("moe64")
    hf = make_hf_model("qwen3_moe", moe_intermediate_size=64)
    ckpt = save_checkpoint(hf, "qwen3_moe", root / "hf")
    return convert(ckpt, root / request.param, dtype="float32", quantize=request.param, group_size=64,
                   progress=False), request.param


def test_moe_native_experts_stream_equal_dense_and_stay_close_to_dequantized(moe64):
    from flashllm.backends.torch.qmatrix import NativeExpertSlots

    out, name = moe64
    plain = flashllm.load(out, mode="dense", kernels="plain").logits(IDS, prefill=4)  # dequantized experts, float32
    dense_model = flashllm.load(out, mode="dense")
    dense = dense_model.logits(IDS, prefill=4)
    assert dense_model.backend.native.calls["experts"] > 0
    model = flashllm.load(out, mode="sparse", dram_budget=0.9)
    lay = model.layout
    budget = model.charged(0, model.backend.nbytes()) + model.spec.n_layers * 2 * lay.stride
    model = flashllm.load(out, mode="sparse", dram_budget=budget)
    assert model.stats["cache_capacity"] == [2] * model.spec.n_layers
    assert model.stats["expert_slots"] == NativeExpertSlots.KIND and model.stats["expert_slot_bytes"] == lay.stride
    np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-5, rtol=1e-5)
    assert model.stats["expert_misses"] > 0 and model.stats["dram_bytes"] <= budget
    rel = np.abs(dense - plain).max() / np.abs(plain).max()
    assert 0 < rel < 0.02  # int8 activations: close to the dequantized experts, not equal
    assert (dense.argmax(-1) == plain.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_resident_matrices_use_the_native_kernels_and_fuse_qkv(tmp_path, bits):
    """Resident int4/int8 matrices as quantized rows (q, k, v fused into one): their logits stay as close to the
    float model's as torch's int4/int8 kernels' (the plain kernels) do."""
    from flashllm.backends.torch.qmatrix import NativeQuantMatrix
    from flashllm.converters import convert

    hf = make_hf_model("llama")
    out = convert(save_checkpoint(hf, "llama", tmp_path / "hf"), tmp_path / "m", dtype="float32", progress=False)
    exact = flashllm.load(out, mode="dense").logits(IDS, prefill=4)
    torch_q = flashllm.load(out, mode="dense", quantize_resident=bits, kernels="plain").logits(IDS, prefill=4)
    model = flashllm.load(out, mode="dense", quantize_resident=bits)
    w = model.backend.w
    assert isinstance(w["layers.0.qkv.weight"], NativeQuantMatrix) and isinstance(w["lm_head.weight"], NativeQuantMatrix)
    got = model.logits(IDS, prefill=4)
    assert model.backend.native.calls["qmatmul"] > 0
    err, torch_err = (np.abs(y - exact).max() / np.abs(exact).max() for y in (got, torch_q))
    assert 0 < err < 1.5 * torch_err + 1e-3


@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_neon_paths_under_qemu(tmp_path, march):
    """The arm64 paths (NEON multiply-accumulate, and sdot where the CPU has it), built with a cross compiler and run
    under qemu: where both are installed (apt: gcc-aarch64-linux-gnu, qemu-user)."""
    import shutil
    import subprocess
    from pathlib import Path

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (cc and qemu):
        pytest.skip("no aarch64 cross compiler and qemu-aarch64 here")
    src = Path(native.__file__).parent
    exe = tmp_path / "check"
    subprocess.run([cc, "-O2", "-static", f"-march={march}", "-pthread", "-o", str(exe),
                    str(Path(__file__).with_name("native_qdot_check.c")), str(src / "kernels_qdot.c"),
                    str(src / "kernels_pool.c"), "-lm"], check=True, capture_output=True)
    run = subprocess.run([qemu, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout
