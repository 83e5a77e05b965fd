"""Quantized FFN bundles: the round-trip bound per group, the on-disk layout, and clear refusals."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flashllm.format import manifest as fmt
from flashllm.cli.main import main
from flashllm.converters import convert
from flashllm.errors import FlashLLMError
from flashllm.format.quant import QuantScheme

EPS16 = 2.0 ** -10  # relative spacing of float16 (a stored scale is at most this much above the exact one)
EPS32 = 2.0 ** -23


@st.composite
def weights(draw):
    group = draw(st.sampled_from([2, 4, 8, 16, 32, 64]))
    n, groups = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    values = st.floats(-1000, 1000, width=32, allow_subnormal=False)
    w = draw(arrays(np.float32, (n, groups * group), elements=values))
    scale = draw(st.sampled_from([1.0, 1e-3, 3e-2]))
    return (w * np.float32(scale)).astype(np.float32), group


@settings(max_examples=150, deadline=None)
@given(weights(), st.sampled_from(["int8", "int4"]), st.sampled_from(["symmetric", "asymmetric"]))
def test_round_trip_error_within_half_a_step_per_group(wg, name, scheme):
    """|w - ŵ| <= s/2 in every group, with s the group's stored scale, and s no more than the
    theoretical step (range / levels) rounded up to float16."""
    w, group = wg
    q = QuantScheme.named(name, group, scheme)
    raw = q.quantize(w)
    assert raw.shape == (w.shape[0], q.part_bytes(w.shape[1]))
    back = q.dequantize(raw, w.shape[1])
    _, s, m = q.unpack(raw, w.shape[1])
    g = w.reshape(w.shape[0], -1, group).astype(np.float64)
    s = s.astype(np.float64)
    if q.symmetric:
        step = np.abs(g).max(axis=2) / ((1 << (q.bits - 1)) - 1)
        slack = 0.0
    else:
        lo = g.min(axis=2)
        step = (g.max(axis=2) - lo) / ((1 << q.bits) - 1)
        slack = np.abs(lo) * EPS16 / ((1 << q.bits) - 1)  # the min is rounded down to float16
        assert (m.astype(np.float64) <= lo).all()
    assert (s <= (step + slack) * (1 + EPS16) + 2.0 ** -24 + 1e-12).all()
    err = np.abs(back.astype(np.float64) - w.reshape(back.shape)).reshape(g.shape)
    mags = np.abs(g).max(axis=2) + (0 if m is None else np.abs(m.astype(np.float64)))
    assert (err.max(axis=2) <= s / 2 + 8 * EPS32 * mags).all()


def test_int4_packs_two_values_per_byte_low_nibble_first():
    q = QuantScheme.named("int4", 4, "asymmetric")
    raw = q.quantize(np.array([[0.0, 15.0, 1.0, 14.0]], dtype=np.float32))
    assert raw[0, 0] == 0x0 | (0xF << 4) and raw[0, 1] == 0x1 | (0xE << 4)
    np.testing.assert_array_equal(q.dequantize(raw, 4), [[0.0, 15.0, 1.0, 14.0]])


@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4)])
def test_quantized_bundles_on_disk(tiny_models, tmp_path, name, bits):
    """Each neuron's bundle holds its gate row, up row and down column, each quantized with its own
    scales and mins; the FFN file shrinks to the quantized size; the manifest says all of it."""
    tiny = tiny_models("llama")
    out = convert(tiny.ckpt, tmp_path / name, dtype="float16", quantize=name, group_size=16, progress=False)
    m = fmt.read_manifest(out, verify=True)
    lay, d, groups = m.layout, m.spec.d_model, m.spec.d_model // 16
    part = d * bits // 8 + 2 * 2 * groups  # codes + float16 scales + float16 mins
    assert m.data["quantization"] == name and lay.quant == QuantScheme(bits, 16, "asymmetric")
    assert m.data["ffn"]["quantization"] == {"scheme": "asymmetric", "bits": bits, "group_size": 16,
                                             "scale_dtype": "float16"}
    assert m.data["ffn"]["part_bytes"] == part and lay.bundle_bytes == 3 * part
    assert m.data["ffn"]["part_offsets"] == {"gate": 0, "up": part, "down": 2 * part}
    assert m.data["ffn"]["part_layout"] == {"codes": [0, d * bits // 8], "scales": [d * bits // 8, 2 * groups],
                                            "mins": [d * bits // 8 + 2 * groups, 2 * groups]}
    plain = fmt.read_manifest(convert(tiny.ckpt, tmp_path / "f16", dtype="float16", progress=False)).layout
    assert m.data["files"]["ffn"]["size"] == lay.file_size < plain.file_size
    assert lay.bundle_bytes / plain.bundle_bytes == pytest.approx((bits + 32 / 16) / 16)  # + scale and min per 16 values
    mlp = tiny.hf.model.layers[1].mlp
    raw = np.fromfile(out / "ffn.bin", dtype=np.uint8)
    for i in (0, 5, lay.d_ffn - 1):
        start = lay.layer_offsets[1] + i * lay.stride
        bundle = raw[start:start + lay.bundle_bytes]
        for p, ref in (("gate", mlp.gate_proj.weight[i]), ("up", mlp.up_proj.weight[i]),
                       ("down", mlp.down_proj.weight[:, i])):
            ref = ref.detach().numpy()
            back = lay.quant.dequantize(bundle[None, lay.part_range(p)], d)[0]
            step = np.ptp(ref.reshape(groups, 16), axis=1).repeat(16) / ((1 << bits) - 1)
            assert (np.abs(back - ref) <= step * (0.5 + 2 * EPS16) + 1e-6).all()


def test_bundles_stay_aligned_where_padding_is_cheap():
    """A 7B-shaped gated FFN (d_model 4096): int4 and int8 bundles pad to 512 bytes (< 1/16 waste)."""
    from flashllm.format.spec import ArchSpec

    spec = ArchSpec(family="llama", vocab_size=32000, d_model=4096, n_layers=2, n_heads=32, n_kv_heads=32,
                    head_dim=128, d_ffn=11008, max_positions=4096, norm="rmsnorm", positional="rotary",
                    activation="silu", gated_ffn=True)
    for name in ("int8", "int4"):
        lay = fmt.FFNLayout.plan(spec, 2, quant=QuantScheme.named(name))
        assert lay.stride % 512 == 0 and lay.stride - lay.bundle_bytes <= lay.bundle_bytes // 16


@pytest.mark.parametrize("args,needle", [
    (["--quantize", "int8", "--group-size", "48"], "does not divide d_model 64"),
    (["--quantize", "int4", "--group-size", "1"], "at least 2"),
    (["--quantize", "int4", "--group-size", "7"], "must be even"),
])
def test_bad_group_size_is_one_clear_line(tiny_models, tmp_path, capsys, args, needle):
    src, out = tiny_models("opt").ckpt, tmp_path / "out"
    capsys.readouterr()
    code = main(["convert", str(src), str(out), *args])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("flashllm: error:") and err.count("\n") == 1 and needle in err
    assert not out.exists()


def test_a_group_size_wider_than_the_experts_names_the_size_that_fits(tiny_models, tmp_path, capsys):
    """int4 on a mixture-of-experts model whose experts are 32 neurons wide: the default group of 64 divides
    d_model but not the experts' d_ffn (a quantized down projection is grouped along it); the error names the
    option value that divides both, spelled as the caller passes options, and that value converts."""
    src = tiny_models("mixtral").ckpt
    capsys.readouterr()
    code = main(["convert", str(src), str(tmp_path / "out"), "--quantize", "int4"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "does not divide the experts' d_ffn 32" in err, err
    assert "--group-size 32" in err and not (tmp_path / "out").exists()
    with pytest.raises(FlashLLMError, match="group_size=32"):
        convert(src, tmp_path / "api", quantize="int4", progress=False)
    assert main(["convert", str(src), str(tmp_path / "out"), "--quantize", "int4", "--group-size", "32"]) == 0


def test_group_size_help_says_what_it_must_divide(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "must divide d_model and the experts' d_ffn" in text and "(default: 64)" in text


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(quantization="int3"), "quantization 'int3' is not supported"),
    (lambda d: d["ffn"]["quantization"].update(scheme="nf4"), "not supported"),
    (lambda d: d["ffn"]["quantization"].update(scale_dtype="float32"), "not supported"),
    (lambda d: d["ffn"]["quantization"].update(group_size=8), "does not match"),
    (lambda d: d["ffn"].pop("quantization"), "not supported"),
])
def test_reader_refuses_unknown_quantization(tiny_models, tmp_path, edit, needle):
    out = convert(tiny_models("opt").ckpt, tmp_path / "q", quantize="int4", group_size=16, progress=False)
    path = out / fmt.MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(FlashLLMError, match=needle):
        fmt.read_manifest(out)


IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12, 3, 77]
# max |logit error| / max |logit| of dense mode vs the float32 model, group size 32 (measured on
# these random checkpoints: int8 0.006-0.015, int4 0.10-0.31, the top from Phi-3 and Gemma 2, whose
# smaller logits (soft-capped for Gemma 2) make the ratio larger; random weights have no structure)
FAMILY_BOUND = {"int8": 0.03, "int4": 0.4}


def hf_with_dequantized_ffn(tiny, q: QuantScheme):
    """The HF reference model with every FFN weight replaced by its quantize/dequantize round trip."""
    import copy

    import torch

    from flashllm.converters.families import family_for

    family, spec = family_for(json.loads((tiny.ckpt / "config.json").read_text()))
    hf = copy.deepcopy(tiny.hf)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for i in range(spec.n_layers):
            fused = {"gate_up": family.fused_gate_up} if family.fused_gate_up else {}  # Phi-3: rows of both
            for part, module in {**family.ffn, **fused}.items():
                w = params[family.layer_prefix.format(i=i) + module + ".weight"]
                rows = w.t() if part == "down" else w  # groups run along d_model in every part
                back = torch.from_numpy(q.dequantize(q.quantize(rows.numpy()), spec.d_model))
                w.copy_(back.t() if part == "down" else back)
    return hf


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_dense_on_quantized_models_of_every_family(tiny, tmp_path, name):
    """Dense mode on quantized bundles equals HF's forward with the same dequantized FFN weights (float
    tolerance), and stays within the stated bound of the float32 model."""
    import torch

    import flashllm

    q = QuantScheme.named(name, 32)
    out = convert(tiny.ckpt, tmp_path / name, dtype="float32", quantize=name, group_size=32, progress=False)
    ours = flashllm.load(out).logits(IDS, prefill=4)
    with torch.no_grad():
        ref = hf_with_dequantized_ffn(tiny, q)(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    exact = flashllm.load(tiny.model_dir).logits(IDS, prefill=4)
    assert np.abs(ours - exact).max() <= FAMILY_BOUND[name] * np.abs(exact).max()
    assert np.abs(ours - exact).max() > 0  # the bundles really are quantized


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_every_mode_on_quantized_bundles_matches_dense(tiny_models, tmp_path, backend):
    """naive, hybrid and sparse (oracle, small cache) read quantized bundles and equal dense mode."""
    import flashllm

    if backend == "mlx":
        pytest.importorskip("mlx.core")
    out = convert(tiny_models("opt").ckpt, tmp_path / "q", dtype="float16", quantize="int4", progress=False)
    dense = flashllm.load(out, backend=backend, dtype="float32").logits(IDS, prefill=4)
    for mode, kw in (("naive", {}), ("hybrid", {"hybrid_fraction": 0.5}),
                     ("sparse", {"predictor": "oracle", "window": 2})):
        model = flashllm.load(out, backend=backend, mode=mode, dtype="float32", **kw)
        np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-4, rtol=1e-4)
        assert model.stats["bytes_read"] > 0


def test_quantized_hybrid_holds_no_float32_copy_of_a_layer(tmp_path):
    """Hybrid mode on int8 bundles, peak bytes of a fresh child process (the kernel's VmHWM;
    bench/quant/load_peak.py):
    - with glibc returning every block over 64 KiB: loading the resident share and streaming the rest
      dequantize a few rows at a time into the compute-dtype rows, so the peak stays within what the
      model holds plus the rows as read (loading) and less than one float32 copy of a layer's streamed
      rows (decoding). Dequantizing whole blocks, as before, held 2-3 float32 copies per layer;
    - with glibc's defaults, as a user runs it, under a budget: the runtime makes glibc return freed
      blocks (budget.return_freed_memory), so decoding needs less than one layer's streamed rows on
      top (without it 106 MiB here, 33 with it: freed blocks kept in glibc's heaps, what took the int8
      hybrid Table-3 run over its cgroup limit)."""
    from flashllm.format.spec import ArchSpec
    from bench.models import make_model
    from bench.quant import load_peak

    d, d_ffn, MiB = 512, 32768, 1 << 20
    spec = ArchSpec(**make_model._shape(make_model.OPT, 32768, d, 2, 8, d_ffn, 64))
    model_dir = make_model.write_model(spec, tmp_path / "m", "float16", progress=False, quantize="int8")
    r = load_peak.measure(model_dir, decode_tokens=2, mode="hybrid", hybrid_fraction=0.5, context=64,
                          dtype="bfloat16")
    raw_rows = d_ffn // 2 * 2 * QuantScheme.named("int8").part_bytes(d)  # one layer's resident share as read
    assert r["peak"] <= r["held"] + raw_rows, r
    assert r["run_transient"] < d_ffn // 2 * 2 * d * 4, r  # one layer's streamed up rows and down columns in float32
    r = load_peak.measure(model_dir, decode_tokens=2, glibc_defaults=True, mode="hybrid", dram_budget=160 * MiB,
                          quantize_resident="int8", context=64, dtype="bfloat16", compute_threads=1)
    streamed = (d_ffn - r["resident_neurons"]) * 2 * d * 2  # one layer's streamed rows in bfloat16
    assert r["run_transient"] < streamed, r


def test_quant_quality_rows_name_their_stored_model_and_load_options():
    from bench.quant import quality as quant_quality

    parse = quant_quality.parse_row
    assert parse("float32") == ("float32", {})
    assert parse("int4 g32 + resident int8") == ("int4 g32", {"quantize_resident": "int8"})
    assert parse("int4 g64 + resident int4 + KV int8") == ("int4 g64", {"quantize_resident": "int4", "kv_bits": 8})
    assert parse("KV int8") == ("float32", {"kv_bits": 8})
    for bad in ("int4 g64 + resident int2", "int3 g64", "int4 64"):
        with pytest.raises(SystemExit, match="row"):
            parse(bad)
