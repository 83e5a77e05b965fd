"""One small adapter per HF architecture family: config.json -> ArchSpec, canonical -> HF tensor names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from flashllm.errors import FlashLLMError
from flashllm.spec import ArchSpec

from .checkpoint import Checkpoint

ACTIVATIONS = {"relu": "relu", "relu2": "relu2", "silu": "silu", "swish": "silu", "gelu": "gelu",
               "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "fatrelu": "fatrelu"}


def activation(cfg: dict, key: str) -> tuple[str, float]:
    """(activation, fatrelu threshold) from the config's activation field."""
    name = cfg.get(key) or "relu"
    if name not in ACTIVATIONS:
        raise FlashLLMError(f"config.json: activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    threshold = float(cfg.get("hidden_act_param") or cfg.get("activation_threshold") or 0.0)
    return ACTIVATIONS[name], threshold if name == "fatrelu" else 0.0


def rope(cfg: dict, head_dim: int) -> dict:
    """Rotary parameters from either the old (rope_theta, rope_scaling) or new (rope_parameters) keys."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise FlashLLMError(f"config.json: rope scaling {kind!r} is not supported yet (only default rotary)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    return {"positional": "rotary", "rope_theta": float(theta),
            "rotary_dim": 0 if rotary_dim == head_dim else rotary_dim}


def split_fused_qkv(t: torch.Tensor, spec: ArchSpec) -> tuple[torch.Tensor, ...]:
    """Fused query_key_value rows grouped as [kv_heads, q_per_kv + 2, head_dim] (Falcon, Persimmon)."""
    groups, per = spec.n_kv_heads, spec.n_heads // spec.n_kv_heads
    g = t.reshape(groups, per + 2, spec.head_dim, *t.shape[1:])
    return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in (g[:, :per], g[:, per], g[:, per + 1]))


@dataclass(frozen=True)
class Family:
    """How one HF family names its tensors, and how its config maps to an ArchSpec."""

    model_types: tuple[str, ...]
    to_spec: Callable[[dict], ArchSpec]
    globals: dict[str, str]  # canonical module -> HF module
    layer_prefix: str
    layer: dict[str, str | tuple[str, ...]]  # canonical per-layer module -> HF module(s), first present wins
    ffn: dict[str, str]  # bundle part -> HF linear module
    fused_qkv: str | None = None  # HF module holding q, k and v rows together
    rename: dict[str, str] = field(default_factory=dict)  # canonical param suffix -> HF suffix

    def tensor(self, ckpt: Checkpoint, spec: ArchSpec, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The resident tensor with canonical `name` (see flashllm.format.resident_shapes)."""
        parts = name.split(".")
        if parts[0] != "layers":
            hf = f"{self.globals[parts[0]]}.{parts[1]}"
            if name == "pos_embed.weight":  # OPT keeps 2 unused rows before position 0
                full = ckpt.get(hf)
                return _check(full[full.shape[0] - shape[0]:], hf, shape)
            if name == "lm_head.weight" and not ckpt.has(hf):
                raise FlashLLMError(f"{ckpt.root}: tensor {hf!r} is missing and config.json does not tie embeddings")
            return ckpt.get(hf, shape)
        prefix = self.layer_prefix.format(i=parts[1])
        module, param = parts[2], parts[3] if len(parts) > 3 else None
        if module.endswith("_bias"):  # FFN biases: up_bias, gate_bias, down_bias
            return ckpt.get(f"{prefix}{self.ffn[module[:-5]]}.bias", shape)
        if module in ("q", "k", "v") and self.fused_qkv:
            fused = ckpt.get(f"{prefix}{self.fused_qkv}.{param}")
            return _check(split_fused_qkv(fused, spec)["qkv".index(module)], f"{prefix}{self.fused_qkv}", shape)
        cands = self.layer[module] if isinstance(self.layer[module], tuple) else (self.layer[module],)
        names = [f"{prefix}{c}.{param}" for c in cands]
        return ckpt.get(next((n for n in names if ckpt.has(n)), names[0]), shape)

    def ffn_rows(self, ckpt: Checkpoint, spec: ArchSpec, i: int) -> dict[str, torch.Tensor]:
        """Per bundle part, a [d_ffn, d_model] matrix whose row j belongs to neuron j."""
        prefix = self.layer_prefix.format(i=i)
        rows = {}
        for part in spec.bundle_parts:
            shape = (spec.d_model, spec.d_ffn) if part == "down" else (spec.d_ffn, spec.d_model)
            w = ckpt.get(f"{prefix}{self.ffn[part]}.weight", shape)
            rows[part] = w.t() if part == "down" else w
        return rows


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise FlashLLMError(f"tensor {name!r} gives shape {tuple(t.shape)}, expected {tuple(shape)} from config.json")
    return t


def _common(cfg: dict, family: str, **kw) -> ArchSpec:
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    base = dict(family=family, vocab_size=cfg["vocab_size"], d_model=d, n_layers=cfg["num_hidden_layers"],
                n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or d // heads, max_positions=cfg.get("max_position_embeddings", 2048),
                bos_token_id=cfg.get("bos_token_id"), **_eos(cfg))
    base.update(kw)
    return ArchSpec(**base)


def _eos(cfg: dict) -> dict:
    """eos_token_id (the first, for older readers) and eos_token_ids (all; Llama-3 lists several)."""
    value = cfg.get("eos_token_id")
    ids = tuple(value) if isinstance(value, list) else () if value is None else (value,)
    return {"eos_token_id": ids[0] if ids else None, "eos_token_ids": ids}


def _opt_spec(cfg: dict) -> ArchSpec:
    if not cfg.get("do_layer_norm_before", True):
        raise FlashLLMError("config.json: OPT with do_layer_norm_before=false (post-norm, opt-350m) is not supported")
    if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise FlashLLMError("config.json: OPT with word_embed_proj_dim != hidden_size (opt-350m) is not supported")
    act, thr = activation(cfg, "activation_function")
    bias = cfg.get("enable_bias", True)
    return _common(cfg, "opt", d_ffn=cfg["ffn_dim"], n_kv_heads=cfg["num_attention_heads"], norm="layernorm",
                   norm_eps=1e-5, positional="learned", activation=act, activation_threshold=thr,
                   qkv_bias=bias, o_bias=bias, ffn_bias=bias, tied_embeddings=cfg.get("tie_word_embeddings", True))


def _llama_spec(cfg: dict, family: str = "llama") -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return _common(cfg, family, d_ffn=cfg["intermediate_size"], norm="rmsnorm", norm_eps=cfg.get("rms_norm_eps", 1e-6),
                   **rope(cfg, cfg.get("head_dim") or d // heads), sliding_window=cfg.get("sliding_window") or 0,
                   activation=act, activation_threshold=thr, gated_ffn=True,
                   qkv_bias=cfg.get("attention_bias", False), o_bias=cfg.get("attention_bias", False),
                   ffn_bias=cfg.get("mlp_bias", False), tied_embeddings=cfg.get("tie_word_embeddings", False))


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
    return _common(cfg, "falcon", n_kv_heads=kv, d_ffn=cfg.get("ffn_hidden_size") or 4 * d, norm="layernorm",
                   norm_eps=cfg.get("layer_norm_epsilon", 1e-5), **rope(cfg, d // heads), parallel_attn=parallel,
                   ffn_norm=ffn_norm, activation=act, activation_threshold=thr, qkv_bias=bias, o_bias=bias,
                   ffn_bias=bias, tied_embeddings=cfg.get("tie_word_embeddings", True))


def _phi_spec(cfg: dict) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return _common(cfg, "phi", d_ffn=cfg["intermediate_size"], norm="layernorm", norm_eps=cfg.get("layer_norm_eps", 1e-5),
                   **rope(cfg, d // heads), parallel_attn=True, ffn_norm=False, activation=act,
                   activation_threshold=thr, qkv_bias=True, o_bias=True, ffn_bias=True,
                   qk_norm=cfg.get("qk_layernorm", False), lm_head_bias=True,
                   tied_embeddings=cfg.get("tie_word_embeddings", False))


def _persimmon_spec(cfg: dict) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return _common(cfg, "persimmon", n_kv_heads=heads, d_ffn=cfg["intermediate_size"], norm="layernorm",
                   norm_eps=cfg.get("layer_norm_eps", 1e-5), **rope(cfg, d // heads), activation=act,
                   activation_threshold=thr, qkv_bias=True, o_bias=True, ffn_bias=True,
                   qk_norm=cfg.get("qk_layernorm", True), tied_embeddings=cfg.get("tie_word_embeddings", False))


_LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
                "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
_LLAMA_FFN = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_LLAMA_GLOBALS = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}

FAMILIES = [
    Family(("opt",), _opt_spec,
           {"embed": "model.decoder.embed_tokens", "pos_embed": "model.decoder.embed_positions",
            "final_norm": "model.decoder.final_layer_norm", "lm_head": "lm_head"},
           "model.decoder.layers.{i}.",
           {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm", "q": "self_attn.q_proj",
            "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj"},
           {"up": "fc1", "down": "fc2"}),
    Family(("llama",), _llama_spec, _LLAMA_GLOBALS, "model.layers.{i}.", _LLAMA_LAYER, _LLAMA_FFN),
    Family(("mistral",), lambda cfg: _llama_spec(cfg, "mistral"), _LLAMA_GLOBALS, "model.layers.{i}.",
           _LLAMA_LAYER, _LLAMA_FFN),
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


def all_families() -> list[Family]:
    """The dense families above and the mixture-of-experts ones (which build on them)."""
    from .moe_families import MOE_FAMILIES

    return FAMILIES + MOE_FAMILIES


def family_for(cfg: dict) -> tuple[Family, ArchSpec]:
    """The adapter for this config and the spec it gives; clear errors for unknown or broken configs."""
    model_type = cfg.get("model_type")
    families = all_families()
    for fam in families:
        if model_type in fam.model_types:
            try:
                return fam, fam.to_spec(cfg)
            except KeyError as exc:
                raise FlashLLMError(f"config.json: missing field {exc} for model_type {model_type!r}") from None
    known = sorted(t for f in families for t in f.model_types)
    raise FlashLLMError(f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(known)})")
