"""Dense-FFN architecture adapters: one Family per HF model_type (OPT, Llama, Qwen, Gemma, Phi, Falcon, ...)."""

from __future__ import annotations

from flashllm.errors import FlashLLMError
from flashllm.format.spec import ArchSpec
from flashllm.converters.families.common import (LLAMA_FFN, LLAMA_GLOBALS, LLAMA_LAYER, Family, activation, common_spec,
                                                  llama_spec, rope, windows)


def _opt_spec(cfg: dict) -> ArchSpec:
    if not cfg.get("do_layer_norm_before", True):
        raise FlashLLMError("config.json: OPT with do_layer_norm_before=false (post-norm, opt-350m) is not supported")
    if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise FlashLLMError("config.json: OPT with word_embed_proj_dim != hidden_size (opt-350m) is not supported")
    act, thr = activation(cfg, "activation_function")
    bias = cfg.get("enable_bias", True)
    return common_spec(cfg, "opt", d_ffn=cfg["ffn_dim"], n_kv_heads=cfg["num_attention_heads"], norm="layernorm",
                   norm_eps=1e-5, positional="learned", activation=act, activation_threshold=thr,
                   qkv_bias=bias, o_bias=bias, ffn_bias=bias, tied_embeddings=cfg.get("tie_word_embeddings", True))


def _qwen_spec(cfg: dict, family: str) -> ArchSpec:
    """Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm); sliding layers from max_window_layers."""
    default_types = ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                     for i in range(cfg["num_hidden_layers"])]
    sliding = windows(cfg, default_types, enabled=cfg.get("use_sliding_window", False))
    if family == "qwen2":
        return llama_spec(cfg, family, qkv_bias=True, o_bias=False, **sliding)
    return llama_spec(cfg, family, qk_norm=True, **sliding)


def _phi3_spec(cfg: dict) -> ArchSpec:
    cfg = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):  # older Phi-3 configs call longrope "su" (or "yarn")
        params = dict(cfg.get(key) or {})
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params.pop("type", None)
            cfg[key] = {**params, "rope_type": "longrope"}
    return llama_spec(cfg, "phi3")


def _falcon_spec(cfg: dict) -> ArchSpec:
    if cfg.get("alibi"):
        raise FlashLLMError("config.json: Falcon with alibi positions is not supported yet")
    heads, d = cfg["num_attention_heads"], cfg["hidden_size"]
    new_arch = cfg.get("new_decoder_architecture", False)
    if new_arch:
        kv, parallel = cfg.get("num_kv_heads") or heads, True
        ffn_norm = (cfg.get("num_ln_in_parallel_attn") or 2) == 2
        if not cfg.get("parallel_attn", True) and not ffn_norm:
            raise FlashLLMError("config.json: Falcon new_decoder_architecture without parallel_attn is not supported")
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
        parallel = cfg.get("parallel_attn", True)
        ffn_norm = not parallel
    act, thr = activation(cfg, "activation")
    bias = cfg.get("bias", False)
    return common_spec(cfg, "falcon", n_kv_heads=kv, d_ffn=cfg.get("ffn_hidden_size") or 4 * d, norm="layernorm",
                   norm_eps=cfg.get("layer_norm_epsilon", 1e-5), **rope(cfg, d // heads), parallel_attn=parallel,
                   ffn_norm=ffn_norm, activation=act, activation_threshold=thr, qkv_bias=bias, o_bias=bias,
                   ffn_bias=bias, tied_embeddings=cfg.get("tie_word_embeddings", True))


def _phi_spec(cfg: dict) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return common_spec(cfg, "phi", d_ffn=cfg["intermediate_size"], norm="layernorm", norm_eps=cfg.get("layer_norm_eps", 1e-5),
                   **rope(cfg, d // heads), parallel_attn=True, ffn_norm=False, activation=act,
                   activation_threshold=thr, qkv_bias=True, o_bias=True, ffn_bias=True,
                   qk_norm=cfg.get("qk_layernorm", False), lm_head_bias=True,
                   tied_embeddings=cfg.get("tie_word_embeddings", False))


def _persimmon_spec(cfg: dict) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return common_spec(cfg, "persimmon", n_kv_heads=heads, d_ffn=cfg["intermediate_size"], norm="layernorm",
                   norm_eps=cfg.get("layer_norm_eps", 1e-5), **rope(cfg, d // heads), activation=act,
                   activation_threshold=thr, qkv_bias=True, o_bias=True, ffn_bias=True,
                   qk_norm=cfg.get("qk_layernorm", True), tied_embeddings=cfg.get("tie_word_embeddings", False))


def _gemma_spec(cfg: dict, family: str) -> ArchSpec:
    """Gemma 1/2/3: GeGLU, (1 + w) RMSNorm (folded at conversion), embeddings times sqrt(d); Gemma 2/3 add
    pre/post norms, query_pre_attn_scalar, soft-capping and sliding layers (Gemma 3: own rope base, q/k norm)."""
    if cfg.get("use_bidirectional_attention"):
        raise FlashLLMError("config.json: use_bidirectional_attention (Gemma encoders) is not supported")
    act, _ = activation({"act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"}, "act")
    d, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or d // heads
    kw = dict(d_ffn=cfg["intermediate_size"], norm="rmsnorm", norm_eps=cfg.get("rms_norm_eps", 1e-6),
              activation=act, gated_ffn=True, qkv_bias=cfg.get("attention_bias", False),
              o_bias=cfg.get("attention_bias", False), embed_scale=d ** 0.5,
              tied_embeddings=cfg.get("tie_word_embeddings", True))
    if family == "gemma":
        return common_spec(cfg, family, **kw, **rope(cfg, head_dim))
    kw.update(post_norms=True, attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
              final_softcap=cfg.get("final_logit_softcapping") or 0.0)
    if family == "gemma2":  # layers 0, 2, 4, ... slide
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return common_spec(cfg, family, **kw, **rope(cfg, head_dim), **windows(cfg, default),
                       attn_softcap=cfg.get("attn_logit_softcapping") or 0.0)
    pattern = cfg.get("sliding_window_pattern", 6)  # Gemma 3: every 6th layer is global
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # older configs: rope_theta and rope_scaling for global layers, rope_local_base_freq for local ones
        full = {**(cfg.get("rope_scaling") or {}), **params, "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    local_rope = rope(cfg, head_dim, {"rope_theta": 10000.0, **local})
    if local_rope["rope_scaling"]:
        raise FlashLLMError("config.json: rope scaling on Gemma 3's sliding_attention layers is not supported")
    return common_spec(cfg, family, **kw, **rope(cfg, head_dim, {"rope_theta": 1e6, **full}), **windows(cfg, default),
                   local_rope_theta=local_rope["rope_theta"], qk_norm=True)


_GEMMA_LAYER = {**LLAMA_LAYER, "post_attn_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffn_norm": "post_feedforward_layernorm", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}

FAMILIES = [
    Family(("opt",), _opt_spec,
           {"embed": "model.decoder.embed_tokens", "pos_embed": "model.decoder.embed_positions",
            "final_norm": "model.decoder.final_layer_norm", "lm_head": "lm_head"},
           "model.decoder.layers.{i}.",
           {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm", "q": "self_attn.q_proj",
            "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj"},
           {"up": "fc1", "down": "fc2"}),
    Family(("llama",), llama_spec, LLAMA_GLOBALS, "model.layers.{i}.", LLAMA_LAYER, LLAMA_FFN),
    Family(("mistral",), lambda cfg: llama_spec(cfg, "mistral"), LLAMA_GLOBALS, "model.layers.{i}.",
           LLAMA_LAYER, LLAMA_FFN),
    Family(("qwen2",), lambda cfg: _qwen_spec(cfg, "qwen2"), LLAMA_GLOBALS, "model.layers.{i}.", LLAMA_LAYER,
           LLAMA_FFN),
    Family(("qwen3",), lambda cfg: _qwen_spec(cfg, "qwen3"), LLAMA_GLOBALS, "model.layers.{i}.",
           {**LLAMA_LAYER, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}, LLAMA_FFN),
    Family(("gemma",), lambda cfg: _gemma_spec(cfg, "gemma"), LLAMA_GLOBALS, "model.layers.{i}.", LLAMA_LAYER,
           LLAMA_FFN, norm_offset=1.0),
    Family(("gemma2", "gemma3_text"), lambda cfg: _gemma_spec(cfg, cfg["model_type"].removesuffix("_text")),
           LLAMA_GLOBALS, "model.layers.{i}.", _GEMMA_LAYER, LLAMA_FFN, norm_offset=1.0),
    Family(("phi3",), _phi3_spec, LLAMA_GLOBALS, "model.layers.{i}.",
           {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "o": "self_attn.o_proj"},
           {"down": "mlp.down_proj"}, fused_qkv="self_attn.qkv_proj", qkv_grouped=False, fused_gate_up="mlp.gate_up_proj"),
    Family(("falcon", "RefinedWeb", "RefinedWebModel"), _falcon_spec,
           {"embed": "transformer.word_embeddings", "final_norm": "transformer.ln_f", "lm_head": "lm_head"},
           "transformer.h.{i}.",
           {"attn_norm": ("input_layernorm", "ln_attn"), "ffn_norm": ("post_attention_layernorm", "ln_mlp"),
            "o": "self_attention.dense"},
           {"up": "mlp.dense_h_to_4h", "down": "mlp.dense_4h_to_h"}, fused_qkv="self_attention.query_key_value"),
    Family(("phi",), _phi_spec,
           {"embed": "model.embed_tokens", "final_norm": "model.final_layernorm", "lm_head": "lm_head"},
           "model.layers.{i}.",
           {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
            "v": "self_attn.v_proj", "o": "self_attn.dense", "q_norm": "self_attn.q_layernorm",
            "k_norm": "self_attn.k_layernorm"},
           {"up": "mlp.fc1", "down": "mlp.fc2"}),
    Family(("persimmon",), _persimmon_spec,
           {"embed": "model.embed_tokens", "final_norm": "model.final_layernorm", "lm_head": "lm_head"},
           "model.layers.{i}.",
           {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "o": "self_attn.dense",
            "q_norm": "self_attn.q_layernorm", "k_norm": "self_attn.k_layernorm"},
           {"up": "mlp.dense_h_to_4h", "down": "mlp.dense_4h_to_h"}, fused_qkv="self_attn.query_key_value"),
]
