"""Bad input gives one clear line naming the problem, a non-zero exit, and nothing half-written."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashllm
from flashllm.cli.main import main


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def ckpt(tiny_models, tmp_path):
    """A private copy of the tiny OPT checkpoint that a test may damage."""
    src = tiny_models("opt").ckpt
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def flash(tiny_models, tmp_path):
    """A private copy of the converted tiny Llama model directory."""
    dst = tmp_path / "flash"
    shutil.copytree(tiny_models("llama").model_dir, dst)
    return dst


def assert_convert_fails(capsys, src, out, *needles):
    code, err = run_cli(capsys, "convert", src, out)
    assert code != 0
    assert err.startswith("flashllm: error:") and err.count("\n") == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no partial dirs


def rewrite_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_config(capsys, ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    assert_convert_fails(capsys, ckpt, tmp_path / "out", "config.json", "missing")


def test_unknown_model_type(capsys, ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt_bigcode"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_convert_fails(capsys, ckpt, tmp_path / "out", "gpt_bigcode", "not supported")


def test_missing_tensor_leaves_nothing(capsys, ckpt, tmp_path):
    rewrite_weights(ckpt, lambda t: t.pop("model.decoder.layers.1.fc2.weight"))
    assert_convert_fails(capsys, ckpt, tmp_path / "out", "model.decoder.layers.1.fc2.weight", "missing")


def test_wrong_shape(capsys, ckpt, tmp_path):
    def edit(t):
        t["model.decoder.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    rewrite_weights(ckpt, edit)
    assert_convert_fails(capsys, ckpt, tmp_path / "out", "k_proj.weight", "(32, 64)", "(64, 64)")


def test_truncated_safetensors(capsys, ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    assert_convert_fails(capsys, ckpt, tmp_path / "out", "model.safetensors", "truncated")


def test_existing_output_is_not_overwritten(capsys, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_cli(capsys, "convert", ckpt, out)
    assert code != 0 and "already exists" in err


def test_a_folder_that_is_no_model_is_not_offered_to_force(capsys, ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    code, err = run_cli(capsys, "convert", ckpt, out)
    assert code != 0 and "not a flashllm model directory" in err and "--force" not in err
    assert "model" in err.split("e.g.")[-1] and (out / "notes.txt").read_text() == "mine\n"


def test_manifest_pointing_outside_the_directory(capsys, flash, tmp_path):
    manifest = json.loads((flash / "flashllm.json").read_text())
    shutil.copy(flash / "resident.safetensors", tmp_path / "elsewhere.safetensors")
    manifest["files"]["resident"]["path"] = "../elsewhere.safetensors"
    (flash / "flashllm.json").write_text(json.dumps(manifest))
    with pytest.raises(flashllm.FlashLLMError, match="outside the model directory"):
        flashllm.load(flash)
    code, err = run_cli(capsys, "inspect", flash)
    assert code != 0 and "outside the model directory" in err


def test_truncated_ffn_file(capsys, flash):
    path = flash / "ffn.bin"
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(flashllm.FlashLLMError, match=r"ffn\.bin.*truncated"):
        flashllm.load(flash)
    code, err = run_cli(capsys, "generate", flash, "--prompt", "hi")
    assert code != 0 and "ffn.bin" in err and "Traceback" not in err


def test_corrupt_ffn_file_fails_checksum_in_load_and_inspect(capsys, flash):
    """`inspect` without --verify checks what load checks: it never passes a model that load refuses."""
    with open(flash / "ffn.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(flashllm.FlashLLMError, match="checksum") as refused:
        flashllm.load(flash)
    code, err = run_cli(capsys, "inspect", flash)
    assert code == 1 and err == f"flashllm: error: {refused.value}\n"


def test_prompt_longer_than_context(capsys, flash):
    model = flashllm.load(flash, context=8)
    with pytest.raises(flashllm.FlashLLMError, match="context"):
        model.generate("the quick brown fox jumps over the lazy dog", max_new_tokens=2)
    with pytest.raises(flashllm.FlashLLMError, match="context"):
        model.logits(list(range(1, 12)))
    code, err = run_cli(capsys, "generate", flash, "--prompt", "the quick brown fox jumps over the lazy dog",
                        "--context", "8")
    assert code != 0 and "context" in err


def test_bad_mode_and_device(flash):
    with pytest.raises(flashllm.FlashLLMError, match="mode"):
        flashllm.load(flash, mode="turbo")
    if not torch.cuda.is_available():
        with pytest.raises(flashllm.FlashLLMError, match="CUDA is not available"):
            flashllm.load(flash, device="cuda")


def test_mlx_backend_without_mlx_says_how_to_install(flash, monkeypatch):
    """--backend mlx where MLX is not installed is a clear error, not a ModuleNotFoundError traceback."""
    monkeypatch.delitem(sys.modules, "flashllm.backends.mlx.backend", raising=False)
    monkeypatch.setitem(sys.modules, "mlx", None)  # import mlx.core now fails as if MLX were absent
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    with pytest.raises(flashllm.FlashLLMError, match=r"MLX is not installed; in the flashllm checkout, install it with `pip install -e \"\.\[mlx\]\" "
                       r"--config-settings editable_mode=strict`"):
        flashllm.load(flash, backend="mlx")


def test_serve_without_its_extra_says_how_to_install(monkeypatch):
    """The install hint is the checkout's extra (flashllm is not a PyPI package: `pip install flashllm[serve]`
    would fetch something else or nothing)."""
    from flashllm.serve import app as serve

    monkeypatch.setitem(sys.modules, "starlette", None)
    with pytest.raises(flashllm.FlashLLMError, match=r"starlette is missing\): in the flashllm checkout, pip install -e \"\.\[serve\]\""):
        serve.require()


def test_console_script_exit_code(flash, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashllm.cli.main", "inspect", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "no such model directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_wrong_model_path_says_which_mistake_it_is(capsys, tmp_path):
    """A path that does not exist, a directory without a manifest, a Hugging Face checkpoint given where a
    converted model goes and a file: each its own one-line error, the checkpoint's naming the convert command to run."""
    from flashllm.cli.main import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "notes.md").write_text("a file")
    errors = []
    for path in (tmp_path / "nope", tmp_path / "empty", tmp_path / "ckpt", tmp_path / "notes.md"):
        assert main(["inspect", str(path)]) == 1
        errors.append(capsys.readouterr().err.replace(str(path), "PATH").strip())
    assert errors[0] == "flashllm: error: PATH: no such model directory"
    assert "not a flashllm model directory" in errors[1] and "run `flashllm convert HF_DIR PATH` first" in errors[1]
    assert "a Hugging Face checkpoint" in errors[2] and "run `flashllm convert PATH OUT_DIR`" in errors[2]
    assert errors[3] == "flashllm: error: PATH: a file, not a model directory (give the directory `flashllm " \
                        "convert` wrote)"  # not advice to convert onto the file
    assert all(len(e.splitlines()) == 1 for e in errors)
