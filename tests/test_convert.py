"""Converter: checkpoint layouts (sharded, .bin), storage dtypes, and the on-disk format contract."""

import json

import numpy as np
import pytest
import torch

import flashllm
from flashllm import format as fmt
from flashllm.cli import main
from flashllm.converters import convert
from tiny import make_hf_model, save_checkpoint

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def test_sharded_safetensors_checkpoint(tmp_path):
    hf = make_hf_model("llama", seed=1)
    ckpt = save_checkpoint(hf, "llama", tmp_path / "hf", max_shard_size="40KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    out = convert(ckpt, tmp_path / "flash", progress=False)
    np.testing.assert_allclose(flashllm.load(out).logits(IDS, prefill=4), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_pytorch_bin_checkpoint_loads_weights_only(tmp_path):
    hf = make_hf_model("opt", seed=2)
    ckpt = save_checkpoint(hf, "opt", tmp_path / "hf")
    (ckpt / "model.safetensors").unlink()
    torch.save(hf.state_dict(), ckpt / "pytorch_model.bin")
    out = convert(ckpt, tmp_path / "flash", progress=False)
    np.testing.assert_allclose(flashllm.load(out).logits(IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-2), ("bfloat16", 1.5e-1)])
def test_half_precision_storage(tiny_models, tmp_path, dtype, tol):
    tiny = tiny_models("phi")
    out = convert(tiny.ckpt, tmp_path / dtype, dtype=dtype, progress=False)
    model = flashllm.load(out)
    assert fmt.read_manifest(out).data["dtype"] == dtype
    assert model.backend.dtype == (torch.float32 if dtype == "float16" else torch.bfloat16)
    ours, ref = model.logits(IDS, prefill=3), hf_logits(tiny.hf, IDS)
    assert np.abs(ours - ref).max() < tol * np.abs(ref).max()


def test_bundles_hold_up_row_and_down_column(tiny_models):
    """Neuron i's bundle is [gate row i, up row i, down column i], at layer offset + i * stride."""
    tiny = tiny_models("llama")
    m = fmt.read_manifest(tiny.model_dir)
    lay = m.layout
    assert lay.parts == ("gate", "up", "down")
    assert all(off % 4096 == 0 for off in lay.layer_offsets)
    mlp = tiny.hf.model.layers[1].mlp
    raw = (tiny.model_dir / "ffn.bin").read_bytes()
    for i in (0, 7, lay.d_ffn - 1):
        start = lay.layer_offsets[1] + i * lay.stride
        bundle = np.frombuffer(raw[start:start + lay.bundle_bytes], dtype=np.float32).reshape(3, -1)
        np.testing.assert_array_equal(bundle[0], mlp.gate_proj.weight[i].detach().numpy())
        np.testing.assert_array_equal(bundle[1], mlp.up_proj.weight[i].detach().numpy())
        np.testing.assert_array_equal(bundle[2], mlp.down_proj.weight[:, i].detach().numpy())


def test_tied_embeddings_are_stored_once(tiny_models):
    tiny = tiny_models("opt")
    spec = fmt.read_manifest(tiny.model_dir).spec
    assert spec.tied_embeddings
    assert "lm_head.weight" not in fmt.resident_shapes(spec)


def test_inspect_json(tiny_models, capsys):
    tiny = tiny_models("persimmon")
    capsys.readouterr()
    assert main(["inspect", str(tiny.model_dir), "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"]["family"] == "persimmon" and info["spec"]["qk_norm"] is True
    assert info["spec"]["activation"] == "relu2" and info["checksums_verified"] == "all"
    assert info["files"]["ffn"] == (tiny.model_dir / "ffn.bin").stat().st_size
