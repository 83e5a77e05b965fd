"""GGUF metadata -> the config.json an HF checkpoint of the same model would carry (architecture as data).

llama.cpp's converter writes an HF config as `{arch}.*` keys; this maps them back, so that one family adapter
(converters/families) describes the model whichever way it arrived. Llama 3's rope scaling, which llama.cpp
stores only as the per-frequency factors it computed (`rope_freqs.weight`), is recovered from those factors.
"""

from __future__ import annotations

import math

import numpy as np

from flashllm.errors import FlashLLMError

# GGUF general.architecture -> (HF model_type, llama.cpp permuted q/k rows for its rope layout, norms stored +1)
ARCHITECTURES = {
    "llama": ("llama", True, False),  # also Mistral and, with experts, Mixtral
    "qwen2": ("qwen2", False, False),
    "qwen3": ("qwen3", False, False),
    "qwen2moe": ("qwen2_moe", False, False),
    "qwen3moe": ("qwen3_moe", False, False),
    "olmoe": ("olmoe", False, False),
    "phi3": ("phi3", False, False),
    "gemma": ("gemma", False, True),
    "gemma2": ("gemma2", False, True),
    "gemma3": ("gemma3_text", False, True),
}
# Architectures flashllm converts from HF checkpoints but not (yet) from GGUF, with the reason.
NOT_YET = {
    "phi2": "Phi-2 GGUF files are not supported yet",
    "falcon": "Falcon GGUF files are not supported yet",
}

# HF config key <- GGUF key suffix (after `{arch}.`), first present wins
_KEYS = {
    "hidden_size": ("embedding_length",),
    "num_hidden_layers": ("block_count",),
    "intermediate_size": ("feed_forward_length",),
    "num_attention_heads": ("attention.head_count",),
    "num_key_value_heads": ("attention.head_count_kv",),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon",),
    "rope_theta": ("rope.freq_base",),
    "max_position_embeddings": ("context_length",),
    "head_dim": ("attention.key_length",),
    "num_experts": ("expert_count",),
    "num_experts_per_tok": ("expert_used_count",),
    "moe_intermediate_size": ("expert_feed_forward_length",),
    "shared_expert_intermediate_size": ("expert_shared_feed_forward_length",),
    "sliding_window": ("attention.sliding_window",),
    "attn_logit_softcapping": ("attn_logit_softcapping",),
    "final_logit_softcapping": ("final_logit_softcapping",),
}
# What llama.cpp fixes in code rather than in a Gemma file's metadata (llama-model.cpp, load_hparams): the
# 27B models' attention scale is 1 / sqrt(d_model / heads) (block count 46 for Gemma 2, 62 for Gemma 3),
# every other one's 1 / sqrt(head_dim); Gemma 2 slides every other layer over 4096 tokens unless the file says
# another window; Gemma 3 slides 5 of every 6 layers with rope base 10000 on them.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def hf_config(meta: dict, tensor_names: set[str], rope: dict[str, np.ndarray]) -> dict:
    """The HF config dict for GGUF metadata `meta` (key -> value) of a file holding `tensor_names`; `rope`: the
    rope scaling tensors it holds (ROPE_TENSORS, without .weight)."""
    arch = meta.get("general.architecture")
    if arch in NOT_YET:
        raise FlashLLMError(f"{NOT_YET[arch]}; supported GGUF architectures: {supported()}")
    if arch not in ARCHITECTURES:
        raise FlashLLMError(f"GGUF architecture {arch!r} is not supported (supported: {supported()})")
    model_type = ARCHITECTURES[arch][0]
    cfg = {"model_type": model_type}
    for key, suffixes in _KEYS.items():
        for suffix in suffixes:
            if f"{arch}.{suffix}" in meta:
                cfg[key] = meta[f"{arch}.{suffix}"]
                break
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise FlashLLMError(f"GGUF metadata: {arch}.{_KEYS[key][0]} is missing")
    if isinstance(cfg.get("num_key_value_heads"), list):
        raise FlashLLMError("GGUF metadata: per-layer head counts are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    cfg["vocab_size"] = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    cfg["hidden_act"] = "silu"
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{theirs}" in meta:
            cfg[ours] = meta[f"tokenizer.ggml.{theirs}"]
    if model_type == "llama" and cfg.get("num_experts"):
        cfg["model_type"] = "mixtral"
        cfg["num_local_experts"] = cfg.pop("num_experts")
    if model_type in ("qwen2_moe", "qwen3_moe") and "moe_intermediate_size" not in cfg:
        cfg["moe_intermediate_size"] = cfg.get("intermediate_size")
    if model_type == "olmoe":
        cfg["intermediate_size"] = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    if model_type == "qwen3_moe":
        cfg["norm_topk_prob"] = True  # llama.cpp always renormalises Qwen3-MoE's top-k weights
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch.startswith("gemma"):
        _gemma(meta, arch, cfg, head_dim)
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary and rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
    cfg["rope_scaling"] = _rope_scaling(meta, arch, cfg, rope)
    return cfg


def _gemma(meta: dict, arch: str, cfg: dict, head_dim: int) -> None:
    """Gemma's config as llama.cpp reads the file (see _GEMMA_27B_LAYERS)."""
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS.get(arch)
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim
    if arch == "gemma2":
        cfg.setdefault("sliding_window", 4096)
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = 10000.0
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: whether it slides
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            cfg["sliding_window_pattern"] = pattern or 6


def _rope_scaling(meta: dict, arch: str, cfg: dict, rope: dict[str, np.ndarray]) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs" in rope:
        if kind not in (None, "none"):
            raise FlashLLMError(f"GGUF: rope_freqs.weight with rope scaling {kind!r} is not supported")
        return llama3_scaling(rope["rope_freqs"], cfg)
    if "rope_factors_long" in rope:  # Phi-3's longrope: per-frequency factors for short and long sequences
        out = {"rope_type": "longrope", "short_factor": rope.get("rope_factors_short", rope["rope_factors_long"]),
               "long_factor": rope["rope_factors_long"], "original_max_position_embeddings": orig}
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        out = {k: v.reshape(-1).tolist() if isinstance(v, np.ndarray) else v for k, v in out.items()}
        return {**out, **({"attention_factor": attn} if attn else {})}
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise FlashLLMError(f"GGUF: rope scaling {kind!r} is not supported")


def llama3_scaling(rope_freqs: np.ndarray, cfg: dict) -> dict:
    """Llama 3 rope scaling from the factors llama.cpp divides each frequency by (1 where unscaled, `factor`
    for long wavelengths, a smooth ramp between). The factors fix `factor` and the two wavelength bounds
    `orig / low_freq_factor` and `orig / high_freq_factor`; low_freq_factor 1 is chosen, and the result is
    checked to reproduce every factor."""
    heads = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = float(cfg.get("rope_theta", 10000.0))
    r = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if r.size != dim // 2:
        raise FlashLLMError(f"GGUF: rope_freqs.weight has {r.size} factors, expected {dim // 2}")
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    factor = float(r.max())
    if factor <= 1.0 + 1e-6:
        return None
    ramp = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    smooth = (1 / r[ramp] - 1 / factor) / (1 - 1 / factor)  # = (orig / wavelen - low) / (high - low)
    below = float(wavelen[~(r >= factor * (1 - 1e-6))].max(initial=0.0))  # the longest unscaled or ramp wavelength
    above = float(wavelen[r >= factor * (1 - 1e-6)].min())
    if ramp.sum() >= 2:  # smooth is linear in 1 / wavelen: slope orig / (high - low), intercept -low / (high - low)
        slope, icept = np.polyfit(1 / wavelen[ramp], smooth, 1)
        orig, high_bound = slope / -icept, slope / (1 - icept)  # with low_freq_factor 1: orig / low, orig / high
    else:  # orig / low anywhere between the last ramp (or unscaled) wavelength and the first scaled one
        orig = _round_bound(below, above)
        if ramp.sum() == 1:  # the ramp point fixes orig / high
            high_bound = orig / (1 + (orig / wavelen[ramp][0] - 1) / smooth[0])
        else:
            high_bound = (below + orig) / 2 if below else orig / 2
    high = float(orig / high_bound)
    orig, high = (float(round(x)) if abs(x - round(x)) < 1e-4 * x else float(x) for x in (orig, high))
    orig = int(orig) if orig.is_integer() else orig
    out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
           "original_max_position_embeddings": orig}
    if not np.allclose(_llama3_factors(wavelen, out), r, rtol=1e-4):
        raise FlashLLMError("GGUF: rope_freqs.weight is not a Llama 3 rope scaling this converter can recover")
    return out


def _llama3_factors(wavelen: np.ndarray, p: dict) -> np.ndarray:
    """What each frequency is divided by under Llama 3 scaling `p` (transformers' formula)."""
    orig, low, high, factor = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"], \
        p["factor"]
    smooth = (orig / wavelen - low) / (high - low)
    mixed = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mixed))


def _round_bound(below: float, above: float) -> float:
    """A value strictly between `below` and `above`: the largest power of two there (context lengths are), else
    the midpoint."""
    power = 2.0 ** math.floor(math.log2(above))
    power = power / 2 if power >= above else power
    return power if power > below else (below + above) / 2
