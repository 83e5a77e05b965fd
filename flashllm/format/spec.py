"""ArchSpec: every architecture difference the decoder block needs, expressed as data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from flashllm.errors import FlashLLMError
from flashllm.format.rope import check_scaling

NORMS = ("layernorm", "rmsnorm")
POSITIONALS = ("learned", "rotary")  # alibi: not yet supported
ACTIVATIONS = ("relu", "relu2", "fatrelu", "gelu", "gelu_tanh", "silu")
ROUTER_SOFTMAX = ("before_topk", "after_topk")  # softmax over all experts, or over the top-k logits
LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class ArchSpec:
    """The shape and behaviour of a decoder-only transformer, filled by a converter adapter."""

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ffn: int
    max_positions: int
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positional: str = "rotary"
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # 0 = head_dim; smaller = partial rotary (Phi, Persimmon)
    rope_scaling: dict = field(default_factory=dict)  # transformers' rope_parameters: rope_type, factor, ... (flashllm.format.rope)
    sliding_window: int = 0  # 0 = full causal attention
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding" (uses sliding_window); () = all layers alike
    local_rope_theta: float = 0.0  # rope base of the sliding layers, unscaled (Gemma 3); 0 = as the others
    parallel_attn: bool = False  # attention and FFN both read the block input (Falcon, Phi)
    ffn_norm: bool = True  # the FFN has its own input norm (False: shares the attention norm)
    activation: str = "relu"
    activation_threshold: float = 0.0  # fatrelu: x if x > threshold else 0
    gated_ffn: bool = False  # act(gate x) * (up x), Llama-style
    qkv_bias: bool = False
    o_bias: bool = False
    ffn_bias: bool = False  # biases on up (and gate) rows and on the down projection
    qk_norm: bool = False  # norm (spec.norm) over head_dim of q and k before rotary (Persimmon, Qwen3, Gemma 3)
    qk_norm_full: bool = False  # with qk_norm: over the whole q and k projections instead (OLMoE)
    post_norms: bool = False  # norms on the attention and FFN outputs before each residual add (Gemma 2/3)
    attn_scale: float = 0.0  # query scaling; 0 = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # cap * tanh(scores / cap) on attention scores (Gemma 2); 0 = none
    final_softcap: float = 0.0  # the same on the logits
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(d_model)); a tied lm_head is not scaled
    lm_head_bias: bool = False
    tied_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every end-of-sequence id config.json lists (Llama-3: several)
    # mixture of experts (n_experts 0: a dense FFN); each expert is a gated FFN of d_ffn neurons
    n_experts: int = 0
    top_k: int = 0  # experts per token
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    router_softmax: str = "before_topk"
    d_shared_expert: int = 0  # an always-on expert of this many neurons (Qwen2-MoE); 0: none
    shared_expert_gate: bool = False  # the shared expert's output is scaled by sigmoid(w . x)

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))  # a JSON list after a round trip
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a JSON list after a round trip
        checks = [
            (self.norm in NORMS, f"norm {self.norm!r} (expected one of {NORMS})"),
            (self.positional in POSITIONALS, f"positional {self.positional!r} (expected one of {POSITIONALS})"),
            (self.activation in ACTIVATIONS, f"activation {self.activation!r} (expected one of {ACTIVATIONS})"),
            (min(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.n_kv_heads,
                 self.head_dim, self.d_ffn, self.max_positions) > 0, "non-positive dimension"),
            (self.n_heads % self.n_kv_heads == 0, f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}"),
            (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, f"rotary_dim {self.rotary_dim}"),
            (not self.n_experts or (1 <= self.top_k <= self.n_experts and self.gated_ffn and not self.ffn_bias),
             f"experts: top_k {self.top_k} of {self.n_experts} (gated, bias-free experts expected)"),
            (self.router_softmax in ROUTER_SOFTMAX, f"router_softmax {self.router_softmax!r} (expected one of {ROUTER_SOFTMAX})"),
            (not self.layer_types or len(self.layer_types) == self.n_layers, f"layer_types: {len(self.layer_types)} "
             f"entries for {self.n_layers} layers"),
            (set(self.layer_types) <= set(LAYER_TYPES), f"layer_types {sorted(set(self.layer_types))} "
             f"(expected entries of {LAYER_TYPES})"),
        ]
        for ok, what in checks:
            if not ok:
                raise FlashLLMError(f"unsupported architecture spec: {what}")
        if self.positional == "rotary":
            check_scaling(self.rope_scaling, self.rope_dim)

    def window(self, layer: int) -> int:
        """The attention window of `layer` (0: full causal attention)."""
        if self.layer_types and self.layer_types[layer] != "sliding":
            return 0
        return self.sliding_window

    @property
    def context_limit(self) -> int:
        """Positions the model attends over: max_positions, times the factor under dynamic NTK scaling."""
        if self.rope_scaling.get("rope_type") == "dynamic":
            return int(self.max_positions * self.rope_scaling["factor"])
        return self.max_positions

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def bundle_parts(self) -> tuple[str, ...]:
        """Rows/columns stored per neuron, in file order."""
        return ("gate", "up", "down") if self.gated_ffn else ("up", "down")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ArchSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FlashLLMError(f"architecture spec has unknown fields {unknown} (written by a newer flashllm?)")
        try:
            return cls(**data)
        except TypeError as exc:
            raise FlashLLMError(f"architecture spec is incomplete: {exc}") from None
