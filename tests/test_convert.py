"""Converter: checkpoint layouts (sharded, .bin), storage dtypes, and the on-disk format contract."""

import copy
import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import flashllm
from flashllm.format import manifest as fmt
from flashllm.cli.main import main
from flashllm.converters import convert
from flashllm.format.safetensors_io import SafetensorsFile
from tiny import hf_logits, make_hf_model, save_checkpoint

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_storage_bytes_round_as_torch_casts(dtype):
    """The converter stores values without torch: its rounding (bfloat16 included) is torch's, bit for bit."""
    from flashllm.format.safetensors_io import storage_bytes

    rng = np.random.default_rng(0)
    f32 = np.finfo(np.float32)
    bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)  # every exponent, subnormals included
    values = np.concatenate([bits.view(np.float32), np.array(
        [0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, f32.max, -f32.max, f32.tiny, 65504.0, 65520.0, 1 + 2**-8, 1 + 3 * 2**-8,
         1 + 2**-11, 1 + 3 * 2**-11, 2**-24, 2**-25, 3 * 2**-26], dtype=np.float32)]).reshape(2, -1)
    cast = torch.from_numpy(values).to(getattr(torch, dtype))
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch casts
        got = storage_bytes(values, dtype)
    assert got.dtype == np.uint8 and got.shape == (2, values.shape[1] * cast.element_size())
    stored = torch.from_numpy(got.copy()).view(cast.dtype)
    nan = np.isnan(values)  # NaN payloads differ between casts (torch's own scalar and vector paths too)
    assert torch.isnan(stored[torch.from_numpy(nan)]).all()
    as_int = torch.int32 if dtype == "float32" else torch.int16
    np.testing.assert_array_equal(stored.view(as_int).numpy()[~nan], cast.view(as_int).numpy()[~nan])


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


def test_float16_storage_matches_the_rounded_weights(tiny_models, tmp_path):
    """float16 files, computed in float32 (--dtype float32): the only change is rounding each weight to
    float16, so transformers on the same rounded weights is the reference, to float32 accuracy."""
    tiny = tiny_models("phi")
    out = convert(tiny.ckpt, tmp_path / "f16", dtype="float16", progress=False)
    model = flashllm.load(out, dtype="float32")
    assert fmt.read_manifest(out).data["dtype"] == "float16" and model.backend.dtype == torch.float32
    rounded = copy.deepcopy(tiny.hf).to(torch.float16).to(torch.float32)
    np.testing.assert_allclose(model.logits(IDS, prefill=3), hf_logits(rounded, IDS), atol=1e-4, rtol=1e-4)


def test_float16_computes_in_float16_as_accurately_as_transformers(tiny_models, tmp_path):
    """float16 files compute in float16 by default on the torch CPU backend: the error against the
    float32 forward of the same rounded weights is bounded by transformers' own float16 forward (x 1.5)."""
    tiny = tiny_models("llama")
    out = convert(tiny.ckpt, tmp_path / "f16", dtype="float16", progress=False)
    model = flashllm.load(out)
    assert model.backend.dtype == torch.float16
    rounded = copy.deepcopy(tiny.hf).to(torch.float16)
    ref = hf_logits(copy.deepcopy(rounded).to(torch.float32), IDS)
    hf_error = np.abs(hf_logits(rounded, IDS) - ref).max()
    our_error = np.abs(model.logits(IDS, prefill=3) - ref).max()
    assert 0 < our_error <= 1.5 * hf_error, (our_error, hf_error)


def test_bfloat16_is_as_accurate_as_transformers_in_bfloat16(tiny_models, tmp_path):
    """bfloat16 files computed in bfloat16: the error against the float32 forward is bounded by what
    transformers' own bfloat16 forward of the same checkpoint incurs (x 1.5: different rounding order)."""
    tiny = tiny_models("phi")
    out = convert(tiny.ckpt, tmp_path / "bf16", dtype="bfloat16", progress=False)
    model = flashllm.load(out)
    assert fmt.read_manifest(out).data["dtype"] == "bfloat16" and model.backend.dtype == torch.bfloat16
    ref = hf_logits(tiny.hf, IDS)
    hf_error = np.abs(hf_logits(copy.deepcopy(tiny.hf).to(torch.bfloat16), IDS) - ref).max()
    our_error = np.abs(model.logits(IDS, prefill=3) - ref).max()
    assert 0 < our_error <= 1.5 * hf_error, (our_error, hf_error)


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
    assert fmt.read_manifest(tiny.model_dir).spec.tied_embeddings
    stored = SafetensorsFile(tiny.model_dir / fmt.RESIDENT_FILE)
    assert "embed.weight" in stored.entries and "lm_head.weight" not in stored.entries
    np.testing.assert_array_equal(stored.read("embed.weight"), tiny.hf.lm_head.weight.detach().numpy())


def test_inspect_json(tiny_models, capsys):
    tiny = tiny_models("persimmon")
    capsys.readouterr()
    assert main(["inspect", str(tiny.model_dir), "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"]["family"] == "persimmon" and info["spec"]["qk_norm"] is True
    assert info["spec"]["activation"] == "relu2" and info["checksums_verified"] == "all"
    assert info["files"]["ffn"] == (tiny.model_dir / "ffn.bin").stat().st_size


# -- safety: nothing of the user's is lost, nothing is silently left out -------------------------------

@pytest.fixture
def ckpt(tiny_models, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may change."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_models("llama").ckpt, dst)
    return dst


def convert_fails(capsys, *argv, needles=()):
    capsys.readouterr()
    code = main(["convert", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("flashllm: error:") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def no_partial_dirs(parent):
    return not [p for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_force_replaces_only_a_model_directory_or_an_empty_one(capsys, ckpt, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("years of work")
    convert_fails(capsys, ckpt, user, "--force", needles=["not a flashllm model directory", "nothing was changed"])
    assert (user / "thesis.txt").read_text() == "years of work" and sorted(os.listdir(user)) == ["thesis.txt"]
    (tmp_path / "file").write_text("keep")
    convert_fails(capsys, ckpt, tmp_path / "file", "--force", needles=["not a directory"])
    assert (tmp_path / "file").read_text() == "keep"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(ckpt), str(empty), "--force"]) == 0 and (empty / fmt.MANIFEST).is_file()
    capsys.readouterr()
    (empty / "predictors.json").write_text("{}")  # written beside the model: replaced with the model, and said so
    assert main(["convert", str(ckpt), str(empty), "--force"]) == 0
    assert "flashllm: note: removed with the replaced model: predictors.json\n" in capsys.readouterr().err
    assert sorted(os.listdir(empty)) == sorted(os.listdir(tiny_dir := convert(ckpt, tmp_path / "ref")))
    assert no_partial_dirs(tmp_path) and tiny_dir.is_dir()
    (empty / "notes.txt").write_text("mine")  # a file of the user's in a model directory: refused, nothing deleted
    (empty / "runs").mkdir()
    before = sorted(os.listdir(empty))
    convert_fails(capsys, ckpt, empty, "--force", needles=["holds what flashllm did not write (notes.txt, runs)",
                                                           "nothing was changed"])
    assert sorted(os.listdir(empty)) == before and (empty / "notes.txt").read_text() == "mine"


def test_an_existing_empty_directory_is_written_into_not_renamed(capsys, ckpt, tmp_path, monkeypatch):
    """`convert SRC /mnt/ssd --force` onto an empty mount point: the model is built on that directory's own file
    system, inside it, and moved up into it; the directory itself is never renamed (a mount point cannot be: the
    rename failed with "Device or resource busy" after the whole model had been written on the parent's disk).
    A file system's lost+found there stays; a model there is replaced the same way."""
    import flashllm.converters.writer as writer

    mount = tmp_path / "ssd"
    (mount / "lost+found").mkdir(parents=True)
    inode = mount.stat().st_ino
    replace = os.replace

    def busy_mount_point(src, dst):
        if os.path.abspath(src) == str(mount):
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        return replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", busy_mount_point)
    for _ in range(2):  # into the empty directory, then over the model it holds
        assert main(["convert", str(ckpt), str(mount), "--force"]) == 0, capsys.readouterr().err
        assert mount.stat().st_ino == inode
        assert sorted(os.listdir(mount)) == sorted(["lost+found", *os.listdir(convert(ckpt, tmp_path / "ref",
                                                                                      force=True))])
        assert flashllm.load(mount).spec.n_layers > 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ref", "ssd"]  # nothing written beside it


def test_a_failed_conversion_into_an_existing_directory_leaves_it_as_it_was(capsys, ckpt, tmp_path, monkeypatch):
    import flashllm.converters.writer as writer

    empty = tmp_path / "empty"
    empty.mkdir()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_ffn", full)
    convert_fails(capsys, ckpt, empty, "--force", needles=["no space left"])
    assert os.listdir(empty) == [] and sorted(os.listdir(tmp_path)) == ["ckpt", "empty"]


def test_a_directory_of_other_files_is_refused_before_any_work_with_a_subdirectory_named(capsys, ckpt, tmp_path,
                                                                                         monkeypatch):
    import flashllm.converters.writer as writer

    def no_reading(src):
        raise AssertionError("the checkpoint was read before the output was checked")

    monkeypatch.setattr(writer, "Checkpoint", no_reading)
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "photos").mkdir()
    convert_fails(capsys, ckpt, disk, "--force", needles=["not a flashllm model directory", "nothing was changed",
                                                          f"a new subdirectory of it instead, e.g. {disk / 'model'}"])
    assert os.listdir(disk) == ["photos"]


def test_companion_files_are_the_ones_flashllm_commands_write():
    from flashllm.planner.solver import PLAN_FILE
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_META
    from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE

    assert sorted(fmt.COMPANION_FILES) == sorted([PLAN_FILE, PREDICTOR_FILE, PREDICTOR_META, SPARSITY_FILE])


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_output_overlapping_the_checkpoint_is_refused(capsys, ckpt, where):
    out = {"same": ckpt, "inside": ckpt / "flash", "contains": ckpt.parent}[where]
    before = sorted(os.listdir(ckpt))
    convert_fails(capsys, ckpt, out, "--force", needles=["checkpoint", "another output"])
    assert sorted(os.listdir(ckpt)) == before and (ckpt / "model.safetensors").is_file()


def test_unwritable_output_is_found_before_any_work(capsys, ckpt, tmp_path, monkeypatch):
    import flashllm.converters.writer as writer

    def no_reading(src):
        raise AssertionError("the checkpoint was read before the output was checked")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(writer, "Checkpoint", no_reading)
    monkeypatch.setattr(writer.Path, "mkdir", read_only)
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["cannot write", "Read-only file system"])


def test_disk_full_leaves_nothing_half_written(capsys, ckpt, tmp_path, monkeypatch):
    import flashllm.converters.writer as writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_ffn", full)
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["no space left"])
    assert not (tmp_path / "out").exists() and no_partial_dirs(tmp_path)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["needs", "GiB", "free"])
    assert not (tmp_path / "out").exists() and no_partial_dirs(tmp_path)


def test_qwen2_checkpoint_labelled_llama_is_refused(capsys, tmp_path):
    """Qwen2 = Llama + q/k/v biases; converting it as llama would drop the biases (logits off by ~1.8)."""
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64)
    ckpt = save_checkpoint(transformers.Qwen2ForCausalLM(cfg), "qwen2", tmp_path / "hf")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["not used by the 'llama' adapter",
                                                          "model.layers.0.self_attn.k_proj.bias", "model_type"])


def edit_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_extra_tensor_is_named_and_buffers_are_ignored(capsys, ckpt, tmp_path):
    edit_weights(ckpt, lambda t: t.update({"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert main(["convert", str(ckpt), str(tmp_path / "ok")]) == 0
    edit_weights(ckpt, lambda t: t.update({"model.layers.1.mlp.adapter.weight": torch.ones(4, 4)}))
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["1 tensors", "model.layers.1.mlp.adapter.weight"])


def test_tied_lm_head_must_equal_the_embeddings(capsys, tiny_models, tmp_path):
    ckpt = tmp_path / "opt"
    shutil.copytree(tiny_models("opt").ckpt, ckpt)
    edit_weights(ckpt, lambda t: t.update({"lm_head.weight": t["model.decoder.embed_tokens.weight"].clone()}))
    assert main(["convert", str(ckpt), str(tmp_path / "ok")]) == 0
    edit_weights(ckpt, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    convert_fails(capsys, ckpt, tmp_path / "out", needles=["ties the embeddings", "lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unknown_storage_dtype_is_an_error(capsys, ckpt, tmp_path, dtype):
    name = "model.layers.0.mlp.up_proj.weight"
    edit_weights(ckpt, lambda t: t.update({name: t[name].to(dtype)}))
    err = convert_fails(capsys, ckpt, tmp_path / "out", "--dtype", "float32", needles=[name])
    assert str(dtype).removeprefix("torch.") in err or "F8_E4M3" in err
