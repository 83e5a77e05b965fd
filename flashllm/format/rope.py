"""Rotary position embeddings: inverse frequencies for every supported scaling, in numpy, for all backends.

The scaling parameters are transformers' `rope_parameters` (rope_type, factor, ...), kept as given in
the spec. Frequencies follow transformers' float32 arithmetic. Two kinds depend on how far the
sequence reaches (`seq_len`, the last position of the current forward call + 1), exactly as in
transformers' cached generation: `dynamic` (NTK base grows past max_positions) and `longrope` (long
factors once past original_max_position_embeddings; keys already cached keep their rotation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashllm.errors import FlashLLMError

# rope_type -> the parameters it needs (beyond rope_theta)
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: dict, dim: int) -> None:
    """A clear error for an unknown rope type or a missing or mis-sized parameter."""
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise FlashLLMError(f"rope_parameters.rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    for key in ROPE_TYPES[kind]:
        if scaling.get(key) is None:
            raise FlashLLMError(f"rope_parameters.{key} is required for rope_type {kind!r}")
    for key in ("short_factor", "long_factor"):
        if kind == "longrope" and len(scaling[key]) != dim // 2:
            raise FlashLLMError(f"rope_parameters.{key} has {len(scaling[key])} values, expected {dim // 2}")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: base, rotated dims, scaling. `cos_sin` gives the tables a backend applies."""

    theta: float
    dim: int  # rotated dims (partial rotary: fewer than head_dim)
    max_positions: int  # config max_position_embeddings (dynamic's and longrope's reference)
    scaling: tuple = ()  # sorted (key, value) pairs of the rope_parameters

    @property
    def params(self) -> dict:
        return dict(self.scaling)

    @property
    def varies(self) -> bool:
        """Whether the frequencies depend on the sequence length reached."""
        return self.params.get("rope_type", "default") in ("dynamic", "longrope")

    def inv_freq(self, seq_len: int) -> tuple[np.ndarray, float]:
        """(float32 inverse frequencies [dim/2], attention factor) for a call reaching `seq_len` tokens."""
        p, dim, base = self.params, self.dim, self.theta
        kind = p.get("rope_type", "default")
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)

        def plain(b):
            return (1.0 / (np.float32(b) ** exponents)).astype(np.float32)

        if kind == "default":
            return plain(base), 1.0
        if kind == "linear":
            return (plain(base) / np.float32(p["factor"])).astype(np.float32), 1.0
        if kind == "dynamic":
            n, f = max(seq_len, self.max_positions), p["factor"]
            return plain(base * ((f * n / self.max_positions) - (f - 1)) ** (dim / (dim - 2))), 1.0
        if kind == "llama3":
            return _llama3(plain(base), p), 1.0
        if kind == "yarn":
            return _yarn(base, dim, exponents, self.max_positions, p)
        orig = p["original_max_position_embeddings"]  # longrope
        factor = p.get("factor") or self.max_positions / orig
        attn = p.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = np.asarray(p["long_factor"] if seq_len > orig else p["short_factor"], dtype=np.float32)
        return (1.0 / (ext * np.float32(base) ** exponents)).astype(np.float32), float(attn)

    def cos_sin(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 [count, dim] cos and sin for positions pos.. (halves repeated, attention factor applied)."""
        inv, attn = self.inv_freq(pos + count)
        freqs = np.arange(pos, pos + count, dtype=np.float32)[:, None] * inv[None, :]
        emb = np.concatenate((freqs, freqs), axis=-1)
        return (np.cos(emb) * np.float32(attn)).astype(np.float32), (np.sin(emb) * np.float32(attn)).astype(np.float32)


def _llama3(inv: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(base: float, dim: int, exponents: np.ndarray, max_positions: int, p: dict) -> tuple[np.ndarray, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    pos_freqs = np.float32(base) ** exponents
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attn)


def layer_ropes(spec) -> list[Rope | None]:
    """The rotary embedding of each layer (sliding layers may have their own base); None without rotary."""
    if spec.positional != "rotary":
        return [None] * spec.n_layers
    scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in spec.rope_scaling.items()))
    main = Rope(spec.rope_theta, spec.rope_dim, spec.max_positions, scaling)
    local = Rope(spec.local_rope_theta, spec.rope_dim, spec.max_positions) if spec.local_rope_theta else main
    return [local if spec.window(i) and spec.local_rope_theta else main for i in range(spec.n_layers)]
