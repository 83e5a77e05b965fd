"""Family quirks beyond the shared parity tests: rope scaling past the original context, sliding windows
longer than the prompt, and clear errors for configs we do not support."""

import importlib.util

import numpy as np
import pytest

import flashllm
from flashllm.converters import convert
from flashllm.converters.families import family_for
from flashllm.format.rope import Rope
from tiny import COMMON, hf_logits, make_hf_model, save_checkpoint

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(importlib.util.find_spec("mlx") is None,
                                                                    reason="mlx is not installed"))]
ORIG = 16  # original_max_position_embeddings of the scaled tiny models
IDS = [int(t) for t in np.random.default_rng(2).integers(3, 96, size=28)]
SCALINGS = {  # rope kind -> (family, config overrides)
    "llama3": ("llama3", {}),
    "linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "dynamic": ("llama", dict(max_position_embeddings=ORIG, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "yarn": ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                original_max_position_embeddings=ORIG, beta_fast=8.0, beta_slow=1.0))),
    "longrope": ("phi3", {}),
}


def converted(tmp_path, family, **overrides):
    hf = make_hf_model(family, **overrides)
    ckpt = save_checkpoint(hf, family, tmp_path / "hf")
    return hf, convert(ckpt, tmp_path / "flash", dtype="float32", progress=False)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_frequencies_match_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family, overrides = SCALINGS[kind]
    hf = make_hf_model(family, **overrides) if kind in ("llama3", "longrope") else None
    config = hf.config if hf is not None else LlamaConfig(**{**COMMON, **overrides})
    spec = family_for({**config.to_dict(), "model_type": config.model_type})[1]
    rope = Rope(spec.rope_theta, spec.rope_dim, spec.max_positions,
                tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in spec.rope_scaling.items())))
    for seq_len in (ORIG, ORIG + 1, 4 * ORIG + 5):
        ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
        ours, factor = rope.inv_freq(seq_len)
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, err_msg=f"{kind} at {seq_len}")
        assert factor == pytest.approx(ref_factor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefill", [20, 10])  # prompt past the original context, or decode crossing it
@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_beyond_original_positions_matches_transformers(tmp_path, kind, prefill, backend):
    family, overrides = SCALINGS[kind]
    hf, model_dir = converted(tmp_path, family, **overrides)
    model = flashllm.load(model_dir, backend=backend, mode="dense")
    assert model.context >= len(IDS) > ORIG
    ref = hf_logits(hf, IDS, prefill)
    np.testing.assert_allclose(model.logits(IDS, prefill=prefill), ref, atol=1e-4, rtol=1e-4)
    plain = hf_logits(make_hf_model("llama" if family == "llama3" else family, **{
        **overrides, "rope_parameters": dict(rope_type="default", rope_theta=10000.0)}), IDS, prefill)
    assert np.abs(plain[ORIG:] - ref[ORIG:]).max() > 1e-2  # the scaling matters at these positions


SLIDING = {  # window 8 (or 4) < 20 tokens; Qwen2 slides only from layer max_window_layers on
    "mistral": ("mistral", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_longer_sequence_matches_transformers(tmp_path, name, backend):
    family, overrides = SLIDING[name]
    hf, model_dir = converted(tmp_path, family, **overrides)
    spec = flashllm.load(model_dir, mode="dense").spec
    assert spec.sliding_window and any(spec.window(i) for i in range(spec.n_layers))
    ids = IDS[:20]
    ref = hf_logits(hf, ids, 12)
    ours = flashllm.load(model_dir, backend=backend, mode="dense").logits(ids, prefill=12)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    wide = hf_logits(make_hf_model(family, **{**overrides, "sliding_window": 64}), ids, 12)
    assert np.abs(wide[-1] - ref[-1]).max() > 1e-2  # the window matters for the last tokens


def _cfg(model_type="llama", **kw):
    base = dict(model_type=model_type, vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, max_position_embeddings=64)
    return {**base, **kw}


@pytest.mark.parametrize("cfg, match", [
    (_cfg(rope_scaling={"type": "ntk-by-parts", "factor": 2.0}), "rope_type 'ntk-by-parts' is not supported"),
    (_cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "rope_parameters.low_freq_factor is required"),
    (_cfg(rope_parameters={"rope_type": "linear"}), "rope_parameters.factor is required"),
    (_cfg("phi3", rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [1.0]},
          original_max_position_embeddings=16), "rope_parameters.short_factor has 1 values, expected 8"),
    (_cfg("gemma2", sliding_window=8, layer_types=["chunked_attention", "full_attention"]),
     r"layer_types \['chunked_attention'\] are not supported"),
    (_cfg("gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_cfg("gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding_attention layers is not supported"),
    (_cfg("falcon", alibi=True), "alibi"),
    (_cfg("gemma3"), "model_type 'gemma3' is not supported"),
])
def test_unsupported_configs_name_the_field(cfg, match):
    with pytest.raises(flashllm.FlashLLMError, match=match):
        family_for(cfg)
