"""The native CPU kernels (flashllm/backends/native): each kernel against a float32 torch reference (strided
rows, every activation, biases, thresholds, row-index lists, accumulation, threads, the portable C path), the
runtime against transformers with them on, and the torch fallback (FLASHLLM_NATIVE=0, no compiler)."""

from __future__ import annotations

import copy
import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashllm
from flashllm.backends import native
from flashllm.backends.torch.native import NativeKernels
from flashllm.converters import convert
from flashllm.stats import TokenCost

LIB = native.library()
needs_native = pytest.mark.skipif(LIB is None, reason=f"no native kernels here: {native.describe()}")
DTYPES = [torch.float16, torch.bfloat16]
ACTS = {"relu": F.relu, "relu2": lambda v: torch.square(F.relu(v)), "fatrelu": lambda v: v * (v > 0.05),
        "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12]


def portable_kernels() -> native.Kernels:
    return native.Kernels(ctypes.CDLL(str(native.build(portable=True))))


def kernel_sets():
    """(name, kernels): the machine's build and, on x86, the portable C build (what other CPUs run)."""
    return [("native", LIB), ("portable", portable_kernels())]


def store(n: int, d: int, parts: int, dtype, pad: int = 24, seed: int = 0) -> torch.Tensor:
    """A cache-like matrix of n bundle rows ([parts x d] values and padding: a row stride != any part)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, parts * d + pad, generator=g) * d ** -0.5).to(dtype)


def reference_ffn(x, rows, act, up_bias=None, gate_bias=None, gate_pre=None, threshold=None, index=None):
    """The FFN's float32 down sum, each intermediate rounded to x's dtype as the torch path does."""
    dt, xf = x.dtype, x.float()
    sel = (lambda t: t) if index is None else (lambda t: t[torch.as_tensor(index)])
    r = {k: sel(v).float() for k, v in rows.items()}
    rnd = lambda t: t.to(dt).float()  # noqa: E731
    up = rnd(xf @ r["up"].t() + (0 if up_bias is None else sel(up_bias).float()))
    if gate_pre is not None:
        pre = gate_pre.float()[:, index] if index is not None else gate_pre.float()
    elif "gate" in r:
        pre = rnd(xf @ r["gate"].t() + (0 if gate_bias is None else sel(gate_bias).float()))
    else:
        pre = up
    a = rnd(ACTS[act](pre))
    if threshold is not None:
        a = a * (a.abs() > threshold)
    h = rnd(a * up) if ("gate" in r or gate_pre is not None) else a
    return h @ r["down"]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [200, 30011])  # rows one at a time (x stays in L1 beside a row); four at a time
def test_matvec_matches_float32_over_strided_rows(dtype, cols):
    w_store = store(301, cols, 1, dtype)  # row stride cols + 24 elements, cols used
    w, x = w_store[:, :cols], torch.randn(1, cols).to(dtype)
    bias = torch.randn(301).to(dtype)
    ref = (x.float() @ w.float().t() + bias.float()).to(dtype)
    # float32 sums in another order differ by a few units of float32 of the sum of |w x| (an output near zero, a
    # sum that cancels, may round to a neighbour that is more than one of its own units away)
    order = float((x.float().abs() @ w.float().abs().t()).max()) * 2 ** -20
    for name, lib in kernel_sets():
        for threads in (1, 2, 3):
            y = NativeKernels(lib, threads).linear(x, w, bias)
            # one rounding of a float32 sum: at most one unit in the last place apart from torch's
            np.testing.assert_allclose(y.float(), ref.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                                       atol=max(1e-6, order), err_msg=f"{name} {threads} threads")
            assert not torch.equal(y, (x.float() @ w_store[:, 1:cols + 1].float().t()).to(dtype))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_low_rank_predictor_in_one_call_is_two_linears_exactly(dtype):
    g = torch.Generator().manual_seed(1)
    proj_in = store(24, 200, 1, dtype)[:, :200]  # strided rows, as a slice of a larger matrix
    proj_out = (torch.randn(301, 24, generator=g) * 0.2).to(dtype)
    for bias in (None, torch.randn(301, generator=g).to(dtype)):
        for threads in (1, 2):
            k = NativeKernels(LIB, threads)
            x = torch.randn(1, 200, generator=g).to(dtype)
            want = k.linear(k.linear(x, proj_in, None), proj_out, bias).float().numpy()
            got = k.low_rank(x, proj_in, proj_out, bias)
            assert got.dtype == np.float32 and got.shape == (1, 301)
            np.testing.assert_array_equal(got, want)
            again = k.low_rank(torch.randn(1, 200, generator=g).to(dtype), proj_in, proj_out, bias)
            assert not np.array_equal(again, got)  # a new array each call: the first result is unchanged
            np.testing.assert_array_equal(got, want)
    k = NativeKernels(LIB, 2)
    assert k.low_rank(torch.randn(2, 200).to(dtype), proj_in, proj_out, None) is None  # two tokens: torch's path
    assert k.low_rank(x.float(), proj_in.float(), proj_out.float(), None) is None  # float32: torch's BLAS

def _ffn(lib, x, rows, act, threads=2, **kw):
    gated = "gate" in rows or kw.get("gate_pre") is not None
    acc = kw.pop("acc", None)
    acc = torch.zeros(1, x.shape[1]) if acc is None else acc
    out = NativeKernels(lib, threads).ffn(x, rows, kw.get("up_bias"), kw.get("gate_bias"), kw.get("gate_pre"), act,
                                          0.05, kw.get("threshold"), kw.get("index"), acc, gated)
    assert out is acc
    return acc


def _close(got, ref, dtype):
    """Within the dtype's rounding of an intermediate (a float32 dot in another order may round h one
    unit differently) of the sum's scale; a dropped row or a wrong stride is far outside."""
    tol = (2 ** -6 if dtype == torch.bfloat16 else 2 ** -9) * float(ref.abs().max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("gated", [True, False])
def test_ffn_over_bundle_rows_matches_float32(dtype, act, gated):
    n, d = 67, 72
    parts = ("gate", "up", "down") if gated else ("up", "down")
    m = store(n, d, len(parts), dtype)
    rows = {p: m[:, k * d:(k + 1) * d] for k, p in enumerate(parts)}
    x = (torch.randn(1, d) * 2).to(dtype)
    ub, gb = torch.randn(n).to(dtype) * 0.1, torch.randn(n).to(dtype) * 0.1
    ref = reference_ffn(x, rows, act, ub, gb if gated else None)
    for name, lib in kernel_sets():
        got = _ffn(lib, x, rows, act, up_bias=ub, gate_bias=gb if gated else None)
        _close(got, ref, dtype)
    # the tolerance sees one dropped row (the largest contribution) and a shifted part
    biases = (ub, gb if gated else None)
    top = max(range(n), key=lambda r: float(reference_ffn(x, rows, act, *biases, index=[r]).abs().max()))
    for wrong in (reference_ffn(x, rows, act, *biases, index=np.delete(np.arange(n), top)),
                  reference_ffn(x, {p: m[:, k * d + 1:(k + 1) * d + 1] for k, p in enumerate(parts)}, act, ub,
                                *biases[1:])):
        with pytest.raises(AssertionError):
            _close(got, wrong, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_threshold_and_resident_gate(dtype):
    n, d = 50, 64
    m = store(n, d, 2, dtype, seed=1)
    rows = {"up": m[:, :d], "down": m[:, d:2 * d]}
    x = torch.randn(1, d).to(dtype)
    pre = torch.randn(1, n).to(dtype)
    for threshold in (None, 0.3):
        ref = reference_ffn(x, rows, "silu", gate_pre=pre, threshold=threshold)
        _close(_ffn(LIB, x, rows, "silu", gate_pre=pre, threshold=threshold), ref, dtype)
    assert not torch.allclose(reference_ffn(x, rows, "silu", gate_pre=pre, threshold=0.3),
                              reference_ffn(x, rows, "silu", gate_pre=pre))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_sum_is_the_same_bits_at_any_thread_count(dtype):
    """The FFN's float32 sum over cached rows does not depend on which thread took which rows: 1, 2 and 5 threads
    and repeated calls give the same bits (machine and portable builds), over all rows and over an index list."""
    n, d = 700, 256
    s = store(n, d, 3, dtype)
    rows = {"up": s[:, :d], "gate": s[:, d:2 * d], "down": s[:, 2 * d:3 * d]}
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    index = np.sort(np.random.default_rng(0).choice(n, 501, replace=False))
    for name, lib in kernel_sets():
        for idx in (None, index):
            sums = [_ffn(lib, x, rows, "silu", threads, index=idx) for threads in (1, 2, 5, 2, 2)]
            assert all(torch.equal(other, sums[0]) for other in sums[1:]), (name, idx is None)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_ffn_index_list_accumulates_in_two_calls(threads):
    """Rows computed in two calls (cached rows, then new ones) into one float32 sum equal one call over
    all of them; only the listed rows count, in any order; an empty list adds nothing."""
    n, d, dtype = 90, 40, torch.float16
    m = store(n, d, 3, dtype, seed=2)
    rows = {p: m[:, k * d:(k + 1) * d] for k, p in enumerate(("gate", "up", "down"))}
    x = torch.randn(1, d).to(dtype)
    first, second = np.array([70, 3, 9, 44, 12, 5, 88, 60, 61, 0]), np.array([1, 2, 89, 30])
    start = torch.randn(1, d)
    acc = start.clone()
    _ffn(LIB, x, rows, "silu", threads, index=first, acc=acc)
    _ffn(LIB, x, rows, "silu", threads, index=second, acc=acc)
    ref = start + reference_ffn(x, rows, "silu", index=np.concatenate([first, second]))
    _close(acc, ref, dtype)
    before = acc.clone()
    _ffn(LIB, x, rows, "silu", threads, index=np.array([], dtype=np.int64), acc=acc)
    assert torch.equal(acc, before)
    with pytest.raises(IndexError):
        _ffn(LIB, x, rows, "silu", threads, index=np.array([n]))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_ffn_output_in_the_call_has_ffn_results_bits(dtype):
    """`y` and `zero`: the kernel starts its sum from zero (whatever acc held) and writes the FFN's output as
    TorchBackend.ffn_result rounds it, plus the down bias, bit for bit (machine and portable builds)."""
    from flashllm.backends.torch.backend import TorchBackend
    n, d = 90, 72
    m = store(n, d, 3, dtype, seed=5)
    rows = {p: m[:, k * d:(k + 1) * d] for k, p in enumerate(("gate", "up", "down"))}
    x, bias = torch.randn(1, d).to(dtype), torch.randn(d).to(dtype)
    for name, lib in kernel_sets():
        kern = NativeKernels(lib, 2)
        ref = _ffn(lib, x, rows, "silu")
        for down_bias in (None, bias):
            acc, y = torch.full((1, d), 7.0), torch.empty_like(x)
            assert kern.ffn(x, rows, None, None, None, "silu", 0.05, None, None, acc, True, y=y, down_bias=down_bias,
                            zero=True) is acc
            assert torch.equal(acc, ref), name
            assert torch.equal(y, TorchBackend.ffn_result(ref, x, down_bias)), (name, down_bias is None)


@needs_native
def test_ffn_checks_rows_again_when_they_change():
    """The kernel call made for a views dict is reused only while the same tensors are in it: a part replaced in
    the dict, or another dict, is checked and computed anew (a stale call would read the old rows)."""
    n, d, dtype = 80, 64, torch.float16
    m, other = store(n, d, 3, dtype, seed=6), store(n, d, 3, dtype, seed=7)
    rows = {p: m[:, k * d:(k + 1) * d] for k, p in enumerate(("gate", "up", "down"))}
    x = torch.randn(1, d).to(dtype)
    kern = NativeKernels(LIB, 2)

    def run(r):
        acc = torch.zeros(1, d)
        assert kern.ffn(x, r, None, None, None, "silu", 0.05, None, None, acc, True) is acc
        return acc
    _close(run(rows), reference_ffn(x, rows, "silu"), dtype)
    rows["down"] = other[:, 2 * d:3 * d]  # the same dict, another down part
    _close(run(rows), reference_ffn(x, rows, "silu"), dtype)
    fewer = {p: t[:33] for p, t in rows.items()}
    _close(run(fewer), reference_ffn(x, fewer, "silu"), dtype)
    rows["up"] = m[:, d + 1:2 * d + 1].t()  # not rows of one stride: no kernel for it
    assert kern.ffn(x, rows, None, None, None, "silu", 0.05, None, None, torch.zeros(1, d), True) is None


def _sparse_pair(tiny_models, tmp_path, family, dtype, **kw):
    tiny = tiny_models(family)
    out = convert(tiny.ckpt, tmp_path / dtype, dtype=dtype, progress=False)
    return tiny, out


@needs_native
@pytest.mark.parametrize("family", ["llama", "opt", "phi", "llama-fatrelu"])
def test_runtime_with_native_kernels_is_as_accurate_as_transformers(tiny_models, tmp_path, family):
    """float16 files decoded in float16 (dense and sparse with the oracle) with the native kernels: the
    error against the float32 forward of the same rounded weights is bounded by transformers' own float16
    forward (x 1.5), as the torch path's is (tests/test_convert.py)."""
    tiny, out = _sparse_pair(tiny_models, tmp_path, family, "float16")
    rounded = copy.deepcopy(tiny.hf).to(torch.float16)
    with torch.no_grad():
        ref = copy.deepcopy(rounded).to(torch.float32)(torch.tensor([IDS])).logits[0].numpy()
        hf_error = np.abs(rounded(torch.tensor([IDS])).logits[0].float().numpy() - ref).max()
    for mode, kw in (("dense", {}), ("sparse", dict(predictor="oracle", window=2))):
        model = flashllm.load(out, mode=mode, **kw)
        our_error = np.abs(model.logits(IDS, prefill=3) - ref).max()
        calls = model.backend.native.calls
        assert calls["linear"] > 0 and (mode == "dense" or calls["ffn"] > 0), (mode, calls)
        assert our_error <= 1.5 * hf_error, (mode, our_error, hf_error)


@needs_native
def test_backend_ffn_index_and_acc_agree_with_the_torch_path(tiny_models, tmp_path, monkeypatch):
    """TorchBackend.ffn's index/acc API gives the same sum natively and on torch, and the FLASHLLM_NATIVE=0
    model takes the torch path (its stats say so) with the same logits."""
    _, out = _sparse_pair(tiny_models, tmp_path, "llama", "float16")
    model = flashllm.load(out, mode="sparse", predictor="oracle", window=2)
    assert model.stats["kernels"].startswith("native")
    native_logits = model.logits(IDS, prefill=3)
    monkeypatch.setenv("FLASHLLM_NATIVE", "0")
    off = flashllm.load(out, mode="sparse", predictor="oracle", window=2)
    assert off.backend.native is None and off.stats["kernels"] == "torch (FLASHLLM_NATIVE=0)"
    np.testing.assert_allclose(off.logits(IDS, prefill=3), native_logits, atol=0.02, rtol=0.02)
    B, T = model.backend, off.backend
    n, d = 40, model.spec.d_model
    m = store(n, d, 3, torch.float16, seed=4)
    rows = {p: m[:, k * d:(k + 1) * d] for k, p in enumerate(("gate", "up", "down"))}
    x = torch.randn(1, d).to(torch.float16)
    idx = np.array([7, 1, 30, 22])
    results = []
    for backend in (B, T):
        acc = backend.ffn_acc(x)
        acc = backend.ffn(x, rows, None, None, None, index=idx, acc=acc)
        last = np.array([0, 39])
        done = backend.ffn(x, rows, None, None, None, index=last, acc=acc.clone(), finish=True)  # the output
        acc = backend.ffn(x, rows, None, None, None, index=last, acc=acc)
        assert torch.equal(done, backend.ffn_result(acc, x, None))
        results.append(done.float())
    ref = reference_ffn(x, rows, "silu", index=np.array([7, 1, 30, 22, 0, 39])).to(torch.float16).float()
    for got in results:
        np.testing.assert_allclose(got, ref, rtol=2 ** -9, atol=1e-3 * float(ref.abs().max()))
    one_call = B.ffn(x, rows, None, None, None).float()
    np.testing.assert_allclose(one_call, reference_ffn(x, rows, "silu").to(torch.float16).float(),
                               rtol=2 ** -9, atol=1e-3 * float(one_call.abs().max()))


def test_no_compiler_falls_back_to_torch(monkeypatch, tmp_path, tiny_models):
    """Without a C compiler the loader says why and the backend computes on torch, correctly."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FLASHLLM_NATIVE_CACHE", str(tmp_path / "cache"))
    assert native.library() is None
    assert native.describe().startswith("torch (native kernels unavailable")
    model = flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="oracle", dtype="float16")
    assert model.backend.native is None
    dense = flashllm.load(tiny_models("llama").model_dir, mode="dense", dtype="float16")
    np.testing.assert_allclose(model.logits(IDS, prefill=3), dense.logits(IDS, prefill=3), atol=0.02, rtol=0.02)
    assert not list((tmp_path / "cache").glob("*.so"))


def test_built_kernels_live_under_flashllms_cache(monkeypatch, tmp_path):
    """$FLASHLLM_NATIVE_CACHE, else native/ under $FLASHLLM_CACHE (with the demo's models and the profiles), else
    under $XDG_CACHE_HOME/flashllm: setting FLASHLLM_CACHE moves everything flashllm writes outside a model."""
    from flashllm.io import disk_profile
    from flashllm.planner import profile

    monkeypatch.delenv("FLASHLLM_NATIVE_CACHE", raising=False)
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "app"))
    assert native.cache_dir() == tmp_path / "app" / "native"
    assert disk_profile.cache_root().parent == profile.cache_path().parent.parent == tmp_path / "app"
    monkeypatch.delenv("FLASHLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "flashllm" / "native"
    assert disk_profile.cache_root() == tmp_path / "xdg" / "flashllm" / "disk"
    monkeypatch.setenv("FLASHLLM_NATIVE_CACHE", str(tmp_path / "kernels"))
    assert native.cache_dir() == tmp_path / "kernels"


@needs_native
def test_build_is_cached_by_source_and_flags(monkeypatch, tmp_path):
    """A fresh cache directory gets one library per flag set, built once (the second call reuses it)."""
    monkeypatch.setenv("FLASHLLM_NATIVE_CACHE", str(tmp_path))
    first = native.build(portable=True)
    assert first.parent == tmp_path and native.build(portable=True) == first
    assert native.build() != first and len(list(tmp_path.glob("*.so"))) == 2
    assert not list(tmp_path.glob(".build-*"))  # no temporary files left


@needs_native
def test_compute_roofline_bench_lists_the_native_kernels(tiny_models, tmp_path):
    """bench/compute/roofline.py: native mat-vec roofline rows, the FFN survey's one-pass kernel, and a native
    run beside a torch one (FLASHLLM_NATIVE=0), shares against the best rate of any backend."""
    from bench.compute import roofline

    out = tmp_path / "roof.md"
    roofline.main([str(tiny_models("llama").model_dir), "--mode", "sparse", "--dtype", "float16",
                                    "--configs", "no-native-1t", "1t", "--rounds", "1", "--tokens", "2", "--warmup",
                                    "1", "--backends", "torch", "native", "--roofline-dtypes", "float16",
                                    "--roofline-rounds", "1", "--attention-keys", "16", "--out", str(out)])
    text = out.read_text()
    assert "| native | float16 | 1 | " in text and "| native | float16 | 2 | " in text
    assert "native one pass" in text and "| float16, 2 threads | " in text
    assert "| 1t | torch float16 1 native | ffn |" in text and "| no-native-1t | torch float16 1 | ffn |" in text
    assert "**Roofline** per dtype" in text


@needs_native
def test_compute_roofline_bench_on_an_int4_model(tiny_models, tmp_path, monkeypatch):
    """bench/compute/roofline.py on an int4 model: the FFN survey's int4 rows (native over the codes, torch over
    dequantized rows, the dequantization itself), and the native run's FFN bytes are the cache's int4 rows (fewer
    bytes per cached neuron than the torch run's bfloat16 rows)."""
    from bench.compute import roofline

    model = convert(tiny_models("llama").ckpt, tmp_path / "int4", dtype="float16", quantize="int4", group_size=16,
                    progress=False)
    args = [str(model), "--mode", "sparse", "--dtype", "bfloat16", "--configs", "no-native-1t", "1t", "--rounds",
            "1", "--tokens", "2", "--warmup", "1", "--backends", "native", "--roofline-dtypes", "int4",
            "--roofline-rounds", "1", "--attention-keys", "16"]
    out = tmp_path / "roof.md"
    roofline.main(args + ["--out", str(out)])
    text = out.read_text()
    for case in ("native one pass", "torch ops", "dequantize the rows to bfloat16"):
        assert case in text
    assert "| int4 g64 (bfloat16 x), 2 threads | " in text
    roof = roofline
    per_neuron = {}
    for native in ("1", "0"):
        monkeypatch.setenv("FLASHLLM_NATIVE", native)
        m = flashllm.load(model, mode="sparse", dtype="bfloat16", predictor="oracle", window=2)
        m.logits(IDS, prefill=2)
        cost = TokenCost(**m.token_stats[-1])  # the last decode token's costs
        per_neuron[native] = roof.part_bytes(m, cost, len(IDS))["ffn"] / sum(cost.neurons_cached)
    lay = m.manifest.layout
    # the same per-row extras either way; the parts as int4 codes + scales + mins against bfloat16 values
    assert per_neuron["0"] - per_neuron["1"] == len(lay.parts) * (lay.d_model * 2 - lay.quant.part_bytes(lay.d_model))


@needs_native
@pytest.mark.parametrize("hd, kvh, pos, lo", [(128, 2, 5, 0), (128, 1, 40, 9), (160, 2, 19, 0), (64, 2, 3, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_kernel_at_real_head_dims(hd, kvh, pos, lo, dtype):
    """The attention kernel called directly at head dims of real models (128: the vector path's 128 columns in
    registers; 160: those plus the rest; 64: the rest only), GQA, a window from `lo`, machine and portable builds:
    the new key and value land at `pos` and the output is attention over keys lo..pos, each to its dtype's rounding."""
    g = torch.Generator().manual_seed(hd + pos)
    heads, ctx = 2 * kvh, 48
    q, k, v = (torch.randn(1, n, hd, generator=g).to(dtype) for n in (heads, kvh, kvh))
    for name, lib in kernel_sets():
        kc, vc = (torch.randn(kvh, ctx, hd, generator=g).to(dtype) for _ in range(2))
        out = torch.empty(1, heads * hd, dtype=dtype)
        assert lib.attend(native.DTYPES[str(dtype).removeprefix("torch.")], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          kc.data_ptr(), vc.data_ptr(), ctx, pos, lo, heads, kvh, hd, 0, None, None, 0.25,
                          out.data_ptr(), 1) == 0
        assert torch.equal(kc[:, pos], k[0]) and torch.equal(vc[:, pos], v[0]), name
        keys, vals = kc[:, lo:pos + 1].float(), vc[:, lo:pos + 1].float()
        scores = (q[0].float().reshape(kvh, 2, hd) @ keys.transpose(1, 2)).to(dtype).float() * 0.25
        want = (torch.softmax(scores, dim=-1).to(dtype).float() @ vals).reshape(1, -1)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=name)


@needs_native
@pytest.mark.parametrize("family", ["llama", "opt", "mistral", "phi", "gemma3", "falcon-mq"])
def test_attention_block_in_one_call_is_the_separate_calls_exactly(tiny_models, family):
    """A decode token's attention block in one native call (norm, fused q/k/v, attention, o) gives bit for bit
    the logits and KV caches of the same kernels called one by one, float16 and bfloat16, past a sliding window;
    families it does not fit (OPT's layer norm, Gemma 3's q/k norms) take the separate calls."""
    ids = IDS + [3, 70, 9, 41, 66, 2, 58]
    for dtype in ("float16", "bfloat16"):
        model = flashllm.load(tiny_models(family).model_dir, mode="dense", dtype=dtype)
        nk = model.backend.native
        got = model.logits(ids, prefill=2)
        kv_block = [(kv.k.clone(), kv.v.clone()) for kv in model.backend.kvs]
        blocks = nk.calls["block"]
        fits = model.spec.norm != "layernorm" and not model.spec.qk_norm
        assert blocks == (fits and (len(ids) - 2) * model.spec.n_layers), (family, blocks)
        nk.attn_block = lambda *a: None  # the separate calls
        want = model.logits(ids, prefill=2)
        assert nk.calls["block"] == blocks and nk.calls["attend"] >= (len(ids) - 2) * model.spec.n_layers
        np.testing.assert_array_equal(got, want)
        for (k, v), kv in zip(kv_block, model.backend.kvs):
            assert torch.equal(k, kv.k) and torch.equal(v, kv.v)


@needs_native
@pytest.mark.parametrize("family", ["llama", "opt", "mistral", "phi", "persimmon", "qwen3", "gemma3", "falcon-mq"])
def test_decode_attention_kernel_matches_the_torch_path(tiny_models, tmp_path, family):
    """The native decode attention (rotary, KV write, scores, softmax, values: GQA, sliding windows, partial
    rotary, learned positions, q/k norms) gives the torch path's logits and KV cache, float16 and bfloat16,
    past a sliding window's length (16 tokens, windows of 8)."""
    ids = IDS + [3, 70, 9, 41, 66, 2, 58]
    for dtype in ("float16", "bfloat16"):
        model = flashllm.load(tiny_models(family).model_dir, mode="dense", dtype=dtype)
        got = model.logits(ids, prefill=2)
        calls = model.backend.native.calls["attend"] + model.backend.native.calls["block"]
        k_native = [kv.k.clone() for kv in model.backend.kvs]
        model.backend.native_attention = False  # the torch path
        want = model.logits(ids, prefill=2)
        assert calls >= (len(ids) - 2) * model.spec.n_layers, calls
        np.testing.assert_allclose(got, want, atol=1e-2, rtol=0)  # equal here; a 1% error in scale gives 0.06
        for a, b in zip(k_native, model.backend.kvs):
            np.testing.assert_allclose(a.float().numpy(), b.k.float().numpy(), atol=4e-3, rtol=2 ** -8)
