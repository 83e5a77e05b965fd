"""`flashllm convert ORG/NAME` against an offline Hugging Face cache laid out as huggingface_hub lays it out
(HF_HOME/hub/models--org--name/{refs/main, snapshots/REV}), with HF_HUB_OFFLINE=1: no network."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flashllm
from flashllm.errors import FlashLLMError
from flashllm.format import manifest as fmt
from gguf_files import tiny_gguf, train_vocab

REV = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(hf_home, repo_id: str, files: dict, rev: str = REV, main: bool = True):
    """Put `files` (name -> source path) into the cache as snapshot `rev` of `repo_id` (refs/main -> rev)."""
    root = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, snap / name)
    if main:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(rev)
    return snap


def run_convert(hf_home, *args):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "flashllm.cli.main", "convert", *map(str, args)],
                          capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_models):
    """An HF cache holding org/tiny (a transformers checkpoint, two revisions) and org/tiny-gguf (a GGUF repo)."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    tiny = tiny_models("llama")
    files = {p.name: p for p in tiny.ckpt.iterdir() if p.is_file()}
    cache_repo(hf_home, "org/tiny", files)
    cache_repo(hf_home, "org/tiny", files, rev=OTHER, main=False)
    _, gguf_path = tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen2", "Q8_0", train_vocab())
    cache_repo(hf_home, "org/tiny-gguf", {"tiny-Q8_0.gguf": gguf_path})
    return hf_home, tiny, gguf_path


def test_a_cached_repo_converts_offline_and_the_manifest_names_it(hub, tmp_path):
    hf_home, tiny, _ = hub
    r = run_convert(hf_home, "org/tiny", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    source = fmt.read_manifest(tmp_path / "out").data["source"]
    assert source["repo"] == "org/tiny" and source["revision"] == REV and source["path"].endswith(REV)
    ids = [1, 5, 9, 20]
    np.testing.assert_array_equal(flashllm.load(tmp_path / "out", mode="dense").logits(ids),
                                  flashllm.load(tiny.model_dir, mode="dense").logits(ids))
    inspect = subprocess.run([sys.executable, "-m", "flashllm.cli.main", "inspect", str(tmp_path / "out")],
                             capture_output=True, text=True)
    assert f"= org/tiny@{REV}" in inspect.stdout
    r = run_convert(hf_home, "org/tiny", tmp_path / "other", "--revision", OTHER)
    assert r.returncode == 0 and fmt.read_manifest(tmp_path / "other").data["source"]["revision"] == OTHER


def test_a_gguf_repo_converts_the_named_file(hub, tmp_path):
    hf_home, _, gguf_path = hub
    r = run_convert(hf_home, "org/tiny-gguf", tmp_path / "out", "--gguf-file", "tiny-Q8_0.gguf")
    assert r.returncode == 0, r.stderr
    m = fmt.read_manifest(tmp_path / "out")
    assert m.data["source"]["repo"] == "org/tiny-gguf" and m.data["source"]["format"] == "gguf"
    assert m.layout.quant.bits == 8 and (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.parametrize("args,needle", [
    (("org/absent",), "org/absent: not in the Hugging Face cache"),
    (("org/tiny", "--revision", "v9"), "org/tiny at revision 'v9': not in the Hugging Face cache"),
    (("org/tiny-gguf",), "org/tiny-gguf: config.json is not in the Hugging Face cache"),
    (("org/tiny-gguf", "--gguf-file", "other.gguf"), "other.gguf is not in the Hugging Face cache"),
])
def test_offline_misses_are_one_clear_line(hub, tmp_path, args, needle):
    r = run_convert(hub[0], *args, tmp_path / "out")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert needle in r.stderr and "HF_HUB_OFFLINE is set" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_revision_on_a_local_path_is_refused(tiny_models, tmp_path):
    r = run_convert(tmp_path, tiny_models("llama").ckpt, tmp_path / "out", "--revision", "main")
    assert r.returncode != 0 and "--revision and --gguf-file apply to a Hub repo id" in r.stderr


@pytest.mark.parametrize("error,needle", [("GatedRepoError", "a gated repository; accept its terms"),
                                          ("RepositoryNotFoundError", "no such repository on the Hugging Face Hub"),
                                          ("RevisionNotFoundError", "no revision 'v2' in the repository")])
def test_hub_errors_are_one_line(monkeypatch, error, needle):
    import huggingface_hub
    from huggingface_hub import errors

    from flashllm.converters.hub import fetch

    from types import SimpleNamespace

    def refuse(*args, **kwargs):  # what huggingface_hub reads of an HTTP response
        response = SimpleNamespace(headers={}, request=None, status_code=404)
        raise getattr(errors, error)("refused by the test", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(FlashLLMError, match=needle) as info:
        fetch("org/name", "v2")
    assert str(info.value).startswith("org/name: ") and "\n" not in str(info.value)
