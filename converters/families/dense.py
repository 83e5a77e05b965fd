"""One small adapter per HF architecture family: config.json -> ArchSpec, canonical -> HF tensor names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flashllm import format as fmt
from flashllm.errors import FlashLLMError
from flashllm.rope import check_scaling
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


def rope(cfg: dict, head_dim: int, params: dict | None = None) -> dict:
    """Rotary spec fields from the old (rope_theta, rope_scaling) or transformers 5 (rope_parameters) keys.

    `params`: one layer type's rope_parameters where they are nested per layer type (Gemma 3)."""
    if params is None:
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    scaling = {"rope_type": kind, **params} if kind != "default" else {}
    if kind in ("llama3", "yarn", "longrope"):  # as transformers: a top-level value wins (Phi-3)
        orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = orig or cfg.get("max_position_embeddings")
    try:
        check_scaling(scaling, rotary_dim)
    except FlashLLMError as exc:
        raise FlashLLMError(f"config.json: {exc}") from None
    return {"positional": "rotary", "rope_theta": float(theta), "rope_scaling": scaling,
            "rotary_dim": 0 if rotary_dim == head_dim else rotary_dim}


def windows(cfg: dict, default_types: list[str] | None = None, enabled: bool = True) -> dict:
    """sliding_window and per-layer layer_types ("full"/"sliding") from config.json.

    Without layer_types (in the config or `default_types`) every layer uses the window (Mistral, Phi-3)."""
    window = (cfg.get("sliding_window") or 0) if enabled else 0
    types = cfg.get("layer_types") or default_types
    if not window or not types:
        return {"sliding_window": window, "layer_types": ()}
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted(set(types) - set(names))
    if unknown:
        raise FlashLLMError(f"config.json: layer_types {unknown} are not supported (expected {sorted(names)})")
    mapped = tuple(names[t] for t in types)
    if "sliding" not in mapped:
        return {"sliding_window": 0, "layer_types": ()}
    return {"sliding_window": window, "layer_types": () if "full" not in mapped else mapped}


def split_fused_qkv(t: np.ndarray, spec: ArchSpec) -> tuple[np.ndarray, ...]:
    """Fused query_key_value rows grouped as [kv_heads, q_per_kv + 2, head_dim] (Falcon, Persimmon)."""
    groups, per = spec.n_kv_heads, spec.n_heads // spec.n_kv_heads
    g = t.reshape(groups, per + 2, spec.head_dim, *t.shape[1:])
    return tuple(np.ascontiguousarray(x.reshape(-1, *t.shape[1:])) for x in (g[:, :per], g[:, per], g[:, per + 1]))


def split_concat_qkv(t: np.ndarray, spec: ArchSpec) -> tuple[np.ndarray, ...]:
    """Fused qkv_proj rows as all q heads, then all k heads, then all v heads (Phi-3)."""
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return t[:q], t[q:q + kv], t[q + kv:]


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
    qkv_grouped: bool = True  # fused rows per kv group (Falcon, Persimmon), else all q, all k, all v (Phi-3)
    fused_gate_up: str | None = None  # HF module holding the gate rows, then the up rows (Phi-3)
    norm_offset: float = 0.0  # added to every norm weight at conversion (Gemma's (1 + w) RMSNorm)
    rename: dict[str, str] = field(default_factory=dict)  # canonical param suffix -> HF suffix

    def source(self, ckpt: Checkpoint, name: str) -> str:
        """The HF tensor that canonical resident `name` is read from (q, k, v: the fused tensor if any)."""
        parts = name.split(".")
        if parts[0] != "layers":
            return f"{self.globals[parts[0]]}.{parts[1]}"
        prefix = self.layer_prefix.format(i=parts[1])
        module, param = parts[2], parts[3] if len(parts) > 3 else None
        if module.endswith("_bias"):  # FFN biases: up_bias, gate_bias, down_bias
            return f"{prefix}{self.ffn[module[:-5]]}.bias"
        if module in ("q", "k", "v") and self.fused_qkv:
            return f"{prefix}{self.fused_qkv}.{param}"
        cands = self.layer[module] if isinstance(self.layer[module], tuple) else (self.layer[module],)
        names = [f"{prefix}{c}.{param}" for c in cands]
        return next((n for n in names if ckpt.has(n)), names[0])

    def ffn_source(self, i: int, part: str) -> str:
        """The HF weight whose rows (up, gate) or columns (down) hold layer i's neurons for `part`."""
        prefix = self.layer_prefix.format(i=i)
        if self.fused_gate_up and part in ("gate", "up"):
            return f"{prefix}{self.fused_gate_up}.weight"
        return f"{prefix}{self.ffn[part]}.weight"

    def tensor(self, ckpt: Checkpoint, spec: ArchSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The resident tensor with canonical `name` (see flashllm.format.resident_shapes), as values."""
        t = self._tensor(ckpt, spec, name, shape)
        return t.astype(np.float32) + self.norm_offset if self.norm_offset and name.endswith("norm.weight") else t

    def _tensor(self, ckpt: Checkpoint, spec: ArchSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
        hf = self.source(ckpt, name)
        if name == "pos_embed.weight":  # OPT keeps 2 unused rows before position 0
            full = ckpt.get(hf)
            return _check(full[full.shape[0] - shape[0]:], hf, shape)
        if name == "lm_head.weight" and not ckpt.has(hf):
            raise FlashLLMError(f"{ckpt.root}: tensor {hf!r} is missing and config.json does not tie embeddings")
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] in ("q", "k", "v") and self.fused_qkv:
            split = split_fused_qkv if self.qkv_grouped else split_concat_qkv
            return _check(split(ckpt.get(hf), spec)["qkv".index(parts[2])], hf, shape)
        return ckpt.get(hf, shape)

    def ffn_rows(self, ckpt: Checkpoint, spec: ArchSpec, i: int) -> dict[str, np.ndarray]:
        """Per bundle part, a [d_ffn, d_model] matrix whose row j belongs to neuron j."""
        f, rows = spec.d_ffn, {}
        if self.fused_gate_up:
            gate_up = ckpt.get(self.ffn_source(i, "gate"), (2 * f, spec.d_model))
            rows = {"gate": gate_up[:f], "up": gate_up[f:]}
        for part in spec.bundle_parts:
            if part in rows:
                continue
            shape = (spec.d_model, spec.d_ffn) if part == "down" else (spec.d_ffn, spec.d_model)
            w = ckpt.get(self.ffn_source(i, part), shape)
            rows[part] = w.T if part == "down" else w
        return rows

    def streamed_sources(self, ckpt: Checkpoint, spec: ArchSpec) -> list[str]:
        """The HF tensors whose neurons go to the streamed file (the FFN weights)."""
        return [self.ffn_source(i, p) for i in range(spec.n_layers) for p in spec.bundle_parts]

    def sources(self, ckpt: Checkpoint, spec: ArchSpec) -> list[str]:
        """The stored names of every tensor the conversion reads; an error names checkpoint tensors it
        would leave out (they change the model: e.g. a Qwen2 checkpoint labelled llama has q/k/v biases)."""
        wanted = [self.source(ckpt, n) for n in fmt.resident_shapes(spec)] + self.streamed_sources(ckpt, spec)
        used = {stored for stored in map(ckpt.resolve, wanted) if stored is not None}
        unused = sorted(n for n in ckpt.where if n not in used and not self._ignorable(ckpt, spec, n))
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise FlashLLMError(f"{ckpt.root}: {len(unused)} tensors are not used by the {spec.family!r} adapter "
                                f"({shown}); is model_type in config.json right?")
        return sorted(used)

    def _ignorable(self, ckpt: Checkpoint, spec: ArchSpec, stored: str) -> bool:
        """Tensors that carry nothing the model needs: rotary buffers, and a tied lm_head equal to the embeddings."""
        if stored.endswith("rotary_emb.inv_freq"):
            return True
        lm_head = ckpt.resolve(f"{self.globals['lm_head']}.weight")
        if stored == lm_head and spec.tied_embeddings:
            if not np.array_equal(ckpt.get(stored), ckpt.get(f"{self.globals['embed']}.weight")):
                raise FlashLLMError(f"{ckpt.root}: config.json ties the embeddings, but {stored!r} differs from "
                                    f"them (set tie_word_embeddings to false?)")
            return True
        return False


def _check(t: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
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


def _llama_spec(cfg: dict, family: str = "llama", **kw) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    base = dict(d_ffn=cfg["intermediate_size"], norm="rmsnorm", norm_eps=cfg.get("rms_norm_eps", 1e-6),
                **rope(cfg, cfg.get("head_dim") or d // heads), **windows(cfg),
                activation=act, activation_threshold=thr, gated_ffn=True,
                qkv_bias=cfg.get("attention_bias", False), o_bias=cfg.get("attention_bias", False),
                ffn_bias=cfg.get("mlp_bias", False), tied_embeddings=cfg.get("tie_word_embeddings", False))
    return _common(cfg, family, **{**base, **kw})


def _qwen_spec(cfg: dict, family: str) -> ArchSpec:
    """Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm); sliding layers from max_window_layers."""
    default_types = ["sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
                     for i in range(cfg["num_hidden_layers"])]
    sliding = windows(cfg, default_types, enabled=cfg.get("use_sliding_window", False))
    if family == "qwen2":
        return _llama_spec(cfg, family, qkv_bias=True, o_bias=False, **sliding)
    return _llama_spec(cfg, family, qk_norm=True, **sliding)


def _phi3_spec(cfg: dict) -> ArchSpec:
    cfg = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):  # older Phi-3 configs call longrope "su" (or "yarn")
        params = dict(cfg.get(key) or {})
        if params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params.pop("type", None)
            cfg[key] = {**params, "rope_type": "longrope"}
    return _llama_spec(cfg, "phi3")


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
        return _common(cfg, family, **kw, **rope(cfg, head_dim))
    kw.update(post_norms=True, attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
              final_softcap=cfg.get("final_logit_softcapping") or 0.0)
    if family == "gemma2":  # layers 0, 2, 4, ... slide
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return _common(cfg, family, **kw, **rope(cfg, head_dim), **windows(cfg, default),
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
    return _common(cfg, family, **kw, **rope(cfg, head_dim, {"rope_theta": 1e6, **full}), **windows(cfg, default),
                   local_rope_theta=local_rope["rope_theta"], qk_norm=True)


_LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
                "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
_LLAMA_FFN = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_LLAMA_GLOBALS = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
_GEMMA_LAYER = {**_LLAMA_LAYER, "post_attn_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffn_norm": "post_feedforward_layernorm", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}

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
    Family(("qwen2",), lambda cfg: _qwen_spec(cfg, "qwen2"), _LLAMA_GLOBALS, "model.layers.{i}.", _LLAMA_LAYER,
           _LLAMA_FFN),
    Family(("qwen3",), lambda cfg: _qwen_spec(cfg, "qwen3"), _LLAMA_GLOBALS, "model.layers.{i}.",
           {**_LLAMA_LAYER, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}, _LLAMA_FFN),
    Family(("gemma",), lambda cfg: _gemma_spec(cfg, "gemma"), _LLAMA_GLOBALS, "model.layers.{i}.", _LLAMA_LAYER,
           _LLAMA_FFN, norm_offset=1.0),
    Family(("gemma2", "gemma3_text"), lambda cfg: _gemma_spec(cfg, cfg["model_type"].removesuffix("_text")),
           _LLAMA_GLOBALS, "model.layers.{i}.", _GEMMA_LAYER, _LLAMA_FFN, norm_offset=1.0),
    Family(("phi3",), _phi3_spec, _LLAMA_GLOBALS, "model.layers.{i}.",
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
