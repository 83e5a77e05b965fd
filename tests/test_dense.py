"""Dense mode against the independent reference: transformers' own forward and greedy generate."""

import numpy as np
import pytest
import torch

import flashllm

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12, 3, 71, 29, 55, 9, 40]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("prefill", [16, 5, 1])
def test_dense_logits_match_transformers(tiny, prefill):
    model = flashllm.load(tiny.model_dir, mode="dense")
    ours = model.logits(IDS, prefill=prefill)
    ref = hf_logits(tiny.hf, IDS)
    assert ours.shape == (len(IDS), tiny.hf.config.vocab_size)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref).max() > 0.5  # the reference is not trivially flat


def test_greedy_generate_matches_transformers(tiny):
    model = flashllm.load(tiny.model_dir, mode="dense")
    prompt = IDS[:6]
    ours = list(model.generate_ids(prompt, max_new_tokens=12))
    with torch.no_grad():
        ref = tiny.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref[:len(ours)]
    assert len(ours) == 12 or ours[-1] == tiny.hf.config.eos_token_id


def test_text_generation_is_deterministic_and_streams(tiny_models):
    model = flashllm.load(tiny_models("llama").model_dir)
    text = model.generate("the quick brown", max_new_tokens=10)
    pieces = list(model.stream("the quick brown", max_new_tokens=10))
    assert "".join(pieces) == text
    sampled = [model.generate("the quick", max_new_tokens=10, temperature=0.8, top_p=0.9, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1]
    stats = model.stats
    for key in ("bytes_read", "reads", "io_ms", "mem_ms", "compute_ms", "predictor_ms", "total_ms", "dram_bytes"):
        assert key in stats
    assert stats["total_ms"] > 0 and stats["dram_bytes"] > 0


def test_sampling_respects_top_p():
    from flashllm.generate import sample

    logits = np.array([5.0, 4.9, -10, -10], dtype=np.float32)
    rng = np.random.default_rng(0)
    seen = {sample(logits, 1.0, 0.5, rng) for _ in range(50)}
    assert seen == {0}
    seen = {sample(logits, 1.0, 1.0, rng) for _ in range(200)}
    assert seen == {0, 1}
