"""What every architecture adapter shares: the Family adapter, config.json helpers, the Llama-style names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.format.rope import check_scaling
from flashllm.format.spec import ArchSpec

from flashllm.converters.checkpoint import Checkpoint

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
        """The resident tensor with canonical `name` (see flashllm.format.manifest.resident_shapes), as values."""
        t = self._tensor(ckpt, spec, name, shape)
        return t.astype(np.float32) + self.norm_offset if self.norm_offset and name.endswith("norm.weight") else t

    def _tensor(self, ckpt: Checkpoint, spec: ArchSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
        hf = self.source(ckpt, name)
        if name == "pos_embed.weight":  # OPT keeps 2 unused rows before position 0
            full = ckpt.get(hf)
            return check_shape(full[full.shape[0] - shape[0]:], hf, shape)
        if name == "lm_head.weight" and not ckpt.has(hf):
            raise FlashLLMError(f"{ckpt.root}: tensor {hf!r} is missing and config.json does not tie embeddings")
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] in ("q", "k", "v") and self.fused_qkv:
            split = split_fused_qkv if self.qkv_grouped else split_concat_qkv
            return check_shape(split(ckpt.get(hf), spec)["qkv".index(parts[2])], hf, shape)
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


def check_shape(t: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(t.shape) != tuple(shape):
        raise FlashLLMError(f"tensor {name!r} gives shape {tuple(t.shape)}, expected {tuple(shape)} from config.json")
    return t


def common_spec(cfg: dict, family: str, **kw) -> ArchSpec:
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    base = dict(family=family, vocab_size=cfg["vocab_size"], d_model=d, n_layers=cfg["num_hidden_layers"],
                n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or d // heads, max_positions=cfg.get("max_position_embeddings", 2048),
                bos_token_id=cfg.get("bos_token_id"), **eos_ids(cfg))
    base.update(kw)
    return ArchSpec(**base)


def eos_ids(cfg: dict) -> dict:
    """eos_token_id (the first, for older readers) and eos_token_ids (all; Llama-3 lists several)."""
    value = cfg.get("eos_token_id")
    ids = tuple(value) if isinstance(value, list) else () if value is None else (value,)
    return {"eos_token_id": ids[0] if ids else None, "eos_token_ids": ids}


def llama_spec(cfg: dict, family: str = "llama", **kw) -> ArchSpec:
    act, thr = activation(cfg, "hidden_act")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    base = dict(d_ffn=cfg["intermediate_size"], norm="rmsnorm", norm_eps=cfg.get("rms_norm_eps", 1e-6),
                **rope(cfg, cfg.get("head_dim") or d // heads), **windows(cfg),
                activation=act, activation_threshold=thr, gated_ffn=True,
                qkv_bias=cfg.get("attention_bias", False), o_bias=cfg.get("attention_bias", False),
                ffn_bias=cfg.get("mlp_bias", False), tied_embeddings=cfg.get("tie_word_embeddings", False))
    return common_spec(cfg, family, **{**base, **kw})


LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
                "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
LLAMA_FFN = {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
LLAMA_GLOBALS = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
