"""Batch mode: several prompts decoded together equal each decoded alone; weights are read once per step."""

import json

import numpy as np
import pytest

import flashllm
from flashllm.cli.main import main

rng = np.random.default_rng(1)
PROMPTS = [[int(t) for t in rng.integers(3, 96, size=n)] for n in (5, 9, 2)]  # different lengths
NEW = 6
MODES = {"dense": {}, "sparse": dict(predictor="oracle", window=2), "naive": {}, "hybrid": dict(hybrid_fraction=0.5)}


def one_at_a_time(model_dir, **options):
    model = flashllm.load(model_dir, **options)
    out = []
    for ids in PROMPTS:
        out.append(list(model.generate_ids(ids, max_new_tokens=NEW)))
    return out


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_batch_equals_one_at_a_time(tiny, mode):
    alone = one_at_a_time(tiny.model_dir, mode=mode, **MODES[mode])
    model = flashllm.load(tiny.model_dir, mode=mode, batch_size=len(PROMPTS), **MODES[mode])
    model.generate_batch(PROMPTS, max_new_tokens=NEW)
    assert [g.token_ids for g in model.last_generations] == alone
    assert model.stats["decode_tokens"] == sum(len(t) for t in alone) - len(PROMPTS)  # the first comes from the prompt


def test_batch_ids_need_no_tokenizer(tiny, tmp_path):
    """Token-id prompts decode in a batch on a model directory without tokenizer files (as make_model writes)."""
    import shutil

    model_dir = tmp_path / "m"
    shutil.copytree(tiny.model_dir, model_dir)
    manifest = json.loads((model_dir / "flashllm.json").read_text())
    for key in [k for k in manifest["files"] if k.startswith("tokenizer")]:
        (model_dir / manifest["files"].pop(key)["path"]).unlink()
    (model_dir / "flashllm.json").write_text(json.dumps(manifest))
    model = flashllm.load(model_dir, batch_size=len(PROMPTS))
    assert model.generate_batch_ids(PROMPTS, max_new_tokens=NEW) == one_at_a_time(tiny.model_dir)


@pytest.mark.parametrize("mode", list(MODES))
def test_batch_step_logits_equal_each_sequence_alone(tiny_models, mode):
    """One batch step over three sequences at different positions gives each one's own logits."""
    tiny = tiny_models("opt")  # learned positions: each row needs its own position's embedding
    batch = flashllm.load(tiny.model_dir, mode=mode, batch_size=3, **MODES[mode])
    alone = flashllm.load(tiny.model_dir, mode=mode, **MODES[mode])
    for i, ids in enumerate(PROMPTS):
        batch.forward(ids, 0, i)
    nxt = [7, 11, 13]
    got = batch.forward(nxt, [len(p) for p in PROMPTS], [0, 1, 2])
    for i, ids in enumerate(PROMPTS):
        want = alone.logits(ids + [nxt[i]], prefill=len(ids))[-1]
        np.testing.assert_allclose(got[i], want, atol=1e-4, rtol=1e-4)


def test_naive_batch_step_reads_each_layer_once(tiny_models):
    tiny = tiny_models("llama")
    model = flashllm.load(tiny.model_dir, mode="naive", batch_size=3)
    model.generate_batch(PROMPTS, max_new_tokens=4)
    steps = [c for c in model.token_stats if c["batch"] > 1]
    alone = flashllm.load(tiny.model_dir, mode="naive")
    alone.logits(PROMPTS[0] + [5], prefill=len(PROMPTS[0]))
    one_token = alone.token_stats[-1]["bytes_read"]
    assert steps and all(s["bytes_read"] == one_token for s in steps)
    assert model.stats["bytes_read"] == pytest.approx(one_token / 3)  # every step carried all three sequences


def test_sparse_batch_reads_the_union_once(tiny_models):
    """A sparse batch step caches the union of its sequences' predicted sets and reads each bundle once."""
    tiny = tiny_models("opt")
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=1, batch_size=3)
    seen = []
    model.hooks.add("predict", lambda layer, mask: seen.append((layer, mask.copy())))
    for i, ids in enumerate(PROMPTS):
        model.forward(ids, 0, i)
    seen.clear()
    model.forward([7, 11, 13], [len(p) for p in PROMPTS], [0, 1, 2])
    cost = model.token_stats[-1]
    for layer, mask in seen:
        assert mask.shape[0] == 3
        assert cost["neurons_cached"][layer] == mask.any(axis=0).sum()  # window 1: exactly the union


def test_sparse_batch_whose_union_overflows_the_cache_streams_it_exactly(tiny_models):
    """At a budget whose caches hold one token's set but not a batch's union, nothing is dropped for batching."""
    tiny = tiny_models("opt")
    rows = (100,) * 2  # of 128 neurons: about half fire per token on random weights, three tokens need more
    alone = one_at_a_time(tiny.model_dir, mode="sparse", predictor="oracle", window=1, cache_rows=rows)
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=1, cache_rows=rows, batch_size=3)
    model.generate_batch(PROMPTS, max_new_tokens=NEW)
    assert [g.token_ids for g in model.last_generations] == alone
    steps = [c for c in model.token_stats if c["batch"] > 1]
    assert any(c["neurons_streamed"] for c in steps) and not any(c["neurons_dropped"] for c in steps)


def test_batch_needs_enough_kv_caches_and_a_backend_that_batches(tiny_models):
    tiny = tiny_models("llama")
    with pytest.raises(flashllm.FlashLLMError, match="batch_size=3"):
        flashllm.load(tiny.model_dir, batch_size=2).generate_batch(PROMPTS)
    with pytest.raises(flashllm.FlashLLMError, match="batch_size"):
        flashllm.load(tiny.model_dir, batch_size=0)


def test_batch_kv_caches_count_against_the_budget(tiny_models):
    tiny = tiny_models("llama")
    one, three = (flashllm.load(tiny.model_dir, batch_size=b, context=32) for b in (1, 3))
    assert three.backend.kv_bytes() == 3 * one.backend.kv_bytes()
    assert three.dram_bytes() - one.dram_bytes() == 2 * one.backend.kv_bytes()


def test_cli_batch_file_matches_single_prompts(tiny_models, tmp_path, capsys):
    tiny = tiny_models("llama")
    prompts = ["the quick brown", "a small model streams", "def main"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts[:2]) + "\n\n" + prompts[2] + "\n")
    capsys.readouterr()
    assert main(["generate", str(tiny.model_dir), "--batch-file", str(path), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] == 3 and [r["prompt"] for r in out["results"]] == prompts
    for prompt, result in zip(prompts, out["results"]):
        main(["generate", str(tiny.model_dir), "--prompt", prompt, "--max-new-tokens", "5", "--json"])
        alone = json.loads(capsys.readouterr().out)
        assert (result["text"], result["token_ids"], result["stop_reason"]) == \
            (alone["text"], alone["token_ids"], alone["stop_reason"])


def test_cli_batch_file_errors_in_one_line(tiny_models, tmp_path, capsys):
    tiny = tiny_models("llama")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for path, needle in ((empty, "no prompts"), (tmp_path / "missing.txt", "cannot read")):
        capsys.readouterr()
        code = main(["generate", str(tiny.model_dir), "--batch-file", str(path)])
        err = capsys.readouterr().err
        assert code != 0 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err
