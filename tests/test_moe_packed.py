"""int4 experts stored packed in torch's CPU int4 kernel layout (`convert --expert-layout torch-cpu`):
read straight into torch's expert slots, the same logits as the portable rows layout, repacked when the
layout is another CPU's, unpacked by MLX and by the dequantizing paths."""

import json
import shutil

import numpy as np
import pytest
import torch

import flashllm
from flashllm.format import manifest as fmt
from flashllm.backends.torch import quant as torch_quant
from flashllm.converters import convert
from flashllm.errors import FlashLLMError
from flashllm.format.experts import PACKING_BLOCKS, pack_nibbles, packing_name, unpack_nibbles

from test_moe import IDS, _budget_for_slots

CONVERT = dict(dtype="float32", quantize="int4", group_size=32, progress=False)


@pytest.fixture(scope="module")
def packed_moe(tiny_models, tmp_path_factory):
    """(the portable int4 model, the same checkpoint stored packed for this CPU) of tiny qwen2_moe."""
    tiny, root = tiny_models("qwen2_moe"), tmp_path_factory.mktemp("packed")
    return convert(tiny.ckpt, root / "rows", **CONVERT), convert(tiny.ckpt, root / "packed", expert_layout="torch-cpu", **CONVERT)


def _foreign_block(layout) -> int:
    """A block of another CPU's int4 layout that this model's shapes allow."""
    own = torch_quant._pack_block()
    return next(b for b in PACKING_BLOCKS if b != own and layout.d_model % b == 0 and 2 * layout.d_ffn % b == 0)


def test_nibble_packing_round_trips_for_every_block():
    codes = np.random.default_rng(0).integers(0, 256, (128, 48), dtype=np.uint8)
    for block in PACKING_BLOCKS:
        packed = np.zeros_like(codes)
        pack_nibbles(codes, packed, block)
        assert not np.array_equal(packed, codes)
        np.testing.assert_array_equal(unpack_nibbles(packed, block), codes)


def test_packed_experts_are_read_in_place_and_compute_what_the_repacked_rows_compute(packed_moe):
    """Same file size; the manifest names the packing; dense and streamed (2 slots, with and without
    prefetch) logits are bit for bit those of the portable model, whose experts are repacked on insert."""
    rows, packed = packed_moe
    manifest = fmt.read_manifest(packed)
    assert manifest.layout.packing == torch_quant.int4_packing() == manifest.data["ffn"]["expert_packing"]
    assert manifest.data["files"]["ffn"]["size"] == fmt.read_manifest(rows).data["files"]["ffn"]["size"]
    want = flashllm.load(rows, mode="dense").logits(IDS, prefill=4)
    np.testing.assert_array_equal(flashllm.load(packed, mode="dense").logits(IDS, prefill=4), want)
    for prefetch in (False, True):
        budget = _budget_for_slots(packed, 2, expert_read_ahead=prefetch)
        model = flashllm.load(packed, mode="sparse", dram_budget=budget, expert_read_ahead=prefetch)
        assert model.stats["cache_capacity"] == [2] * model.spec.n_layers
        np.testing.assert_array_equal(model.logits(IDS, prefill=4), want)
        stats = model.stats
        assert stats["expert_slots"] == "int4 kernel layout (read in place)"
        assert stats["expert_misses"] > 0 and stats["dram_bytes"] <= budget
        assert stats["expert_staging_bytes"] == 0  # reads land in the slots: no staging buffer


def test_experts_packed_for_another_cpu_are_repacked_on_insert(packed_moe, tmp_path, monkeypatch):
    rows, packed = packed_moe
    lay = fmt.read_manifest(packed).layout
    other = packing_name(_foreign_block(lay))
    monkeypatch.setattr(torch_quant, "int4_packing", lambda: other)  # the converter's machine
    tiny_ckpt = json.loads((rows / fmt.MANIFEST).read_text())["source"]["path"]
    foreign = convert(tiny_ckpt, tmp_path / "foreign", expert_layout="torch-cpu", **CONVERT)
    monkeypatch.undo()
    assert fmt.read_manifest(foreign).layout.packing == other
    want = flashllm.load(rows, mode="dense").logits(IDS, prefill=4)
    budget = _budget_for_slots(foreign, 2)
    model = flashllm.load(foreign, mode="sparse", dram_budget=budget)
    np.testing.assert_array_equal(model.logits(IDS, prefill=4), want)
    assert model.stats["expert_slots"] == "int4 kernel layout (repacked on insert)"


def test_packed_experts_dequantize_to_what_the_int4_kernel_computes(packed_moe):
    """ExpertLayout.dequantize of a packed bundle (the plain kernels, CUDA, MLX) gives the weights torch's
    int4 kernel multiplies by: the kernel times an identity matrix, to bfloat16 rounding."""
    _, packed = packed_moe
    lay = fmt.read_manifest(packed).layout
    raw = np.fromfile(packed / fmt.EXPERTS_FILE, dtype=np.uint8, count=lay.stride)
    values = lay.dequantize(raw).reshape(len(lay.parts), lay.d_ffn, lay.d_model)
    slots = torch_quant.Int4ExpertSlots(1, lay, torch.float32, np.zeros((1, lay.stride), dtype=np.uint8))
    slots.insert(0, raw)
    up_gate, down_t = slots.rows(0)["up_gate"], slots.rows(0)["down_t"]
    w = up_gate.linear(torch.eye(lay.d_model)).T.numpy()  # [2 d_ffn, d_model]: up rows, then gate rows
    np.testing.assert_allclose(w, np.concatenate([values[lay.parts.index("up")], values[lay.parts.index("gate")]]),
                               rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(down_t.linear(torch.eye(lay.d_ffn)).numpy(), values[lay.parts.index("down")],
                               rtol=1e-2, atol=1e-6)
    plain = flashllm.load(packed, mode="dense", kernels="plain").logits(IDS, prefill=4)
    tuned = flashllm.load(packed, mode="dense").logits(IDS, prefill=4)
    assert 0 < np.abs(tuned - plain).max() / np.abs(plain).max() < 0.05  # bfloat16 activations only


def test_mlx_loads_packed_experts(packed_moe):
    """MLX unpacks them on insert into its affine slots: streamed equals MLX dense exactly, and both equal
    torch on the dequantized experts (the plain kernels) within float32 rounding."""
    pytest.importorskip("mlx.core")
    _, packed = packed_moe
    plain = flashllm.load(packed, mode="dense", kernels="plain").logits(IDS, prefill=4)
    kw = dict(backend="mlx", device="cpu", expert_read_ahead=True)
    dense = flashllm.load(packed, mode="dense", **kw).logits(IDS, prefill=4)
    np.testing.assert_allclose(dense, plain, atol=1e-4, rtol=1e-4)
    model = flashllm.load(packed, mode="sparse", dram_budget=_budget_for_slots(packed, 2, **kw), **kw)
    np.testing.assert_array_equal(model.logits(IDS, prefill=4), dense)
    assert model.stats["expert_slots"] == "MLX affine format (copied on insert)" and model.stats["expert_misses"] > 0


def test_bad_packing_requests_and_manifests_are_clear_errors(packed_moe, tiny_models, tmp_path):
    rows, packed = packed_moe
    ckpt = tiny_models("qwen2_moe").ckpt
    with pytest.raises(FlashLLMError, match="--expert-layout torch-cpu: stores the int4 experts"):
        convert(ckpt, tmp_path / "int8", expert_layout="torch-cpu", **{**CONVERT, "quantize": "int8"})
    with pytest.raises(FlashLLMError, match="--expert-layout tiled: expected one of portable, torch-cpu"):
        convert(ckpt, tmp_path / "tiled", expert_layout="tiled", **CONVERT)
    assert not (tmp_path / "int8").exists() and not (tmp_path / "tiled").exists()
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    data = json.loads((bad / fmt.MANIFEST).read_text())
    data["ffn"]["expert_packing"] = "torch_cpu_int4_n7"
    (bad / fmt.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(FlashLLMError, match="expert packing 'torch_cpu_int4_n7' is not known"):
        fmt.read_manifest(bad)
