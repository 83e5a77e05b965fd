"""The torch backend's self-attention: q/k/v projections, rotary, the KV cache update and the attention itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashllm.format.rope import Rope
from flashllm.backends.torch.quant import KVCache


class TorchAttention:
    """A part of `TorchBackend` (backend.py beside it): attention of one block over its KV cache, one sequence's tokens
    or one token per sequence; a decode token's in one native call where the kernels load. Uses the backend's
    spec, weights, KV caches, norms, projections, rotary tables, kernels and timers."""

    # decode attention in one thread when compute threads > 1 (waking OpenMP workers costs more than it saves)
    serial_attention = True
    native_attention = True  # a decode token's attention in one native call where the kernels load (bench switch)

    def _rope(self, x: torch.Tensor, rope: Rope, pos: int) -> torch.Tensor:
        """x [T, heads, head_dim] rotated in float32 (x * cos + rotate_half(x) * sin), in x's dtype."""
        rd = self.spec.rope_dim
        cos, sin = self.rope_tables(rope, pos, x.shape[0])
        xr, rest = x[..., :rd].float(), x[..., rd:]
        half = rd // 2
        if self.tuned:  # rotate_half(x) * sin as the swapped halves times (-sin, sin): the same products
            swapped = xr.unflatten(-1, (2, half)).flip(-2).flatten(-2)
            out = torch.addcmul(xr * cos, swapped, self._signed_sin(rope, sin)).to(x.dtype)
            return out if rd == x.shape[-1] else torch.cat((out, rest), dim=-1)
        rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        return torch.cat(((xr * cos + rotated * sin).to(x.dtype), rest), dim=-1)

    def _signed_sin(self, rope: Rope, sin: torch.Tensor) -> torch.Tensor:
        """The sin table with its first half negated, made once per forward call and rope."""
        hit = self._rope_rows[rope]
        if len(hit) == 4:
            half = sin.shape[-1] // 2
            hit = self._rope_rows[rope] = (*hit, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
        return hit[4]

    def attention(self, layer: int, x: torch.Tensor, pos, slot=0) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention of block `layer` for one sequence's tokens at positions pos.. in KV cache
        `slot`, or (lists `pos`, `slot`) one token per sequence; returns (output, normed input)."""
        s, p, T = self.spec, f"layers.{layer}.", x.shape[0]
        if T == 1 and isinstance(pos, int):
            block = self._attention_block(layer, x, pos, self.kvs[slot])
            if block is not None:
                return block
        h = self.norm(p + "attn_norm", x)
        t0 = self._tic()
        q, k, v, fused = self._toc("attn_proj", t0, self._qkv(p, h))  # [T, heads, head_dim] each
        if s.qk_norm and s.qk_norm_full:
            q = self.norm(p + "q_norm", q.reshape(T, -1)).view(T, s.n_heads, s.head_dim)
            k = self.norm(p + "k_norm", k.reshape(T, -1)).view(T, s.n_kv_heads, s.head_dim)
        if s.qk_norm and not s.qk_norm_full:
            q, k = self.norm(p + "q_norm", q), self.norm(p + "k_norm", k)
        t0 = self._tic()
        qk = fused[:, :s.n_heads + s.n_kv_heads] if fused is not None and not s.qk_norm else None
        serial = self.serial_attention and self.threads > 1 and T == 1 and self.device.type == "cpu"
        if serial:  # a decode token's ~10 small ops: waking a second OpenMP thread costs more than it saves
            torch.set_num_threads(1)
        try:
            if isinstance(pos, int):
                out = self._attend(layer, q, k, v, pos, self.kvs[slot], qk)
            else:  # batch decode: the projections above ran once for every sequence; keys are per sequence
                out = torch.cat([self._attend(layer, q[i:i + 1], k[i:i + 1], v[i:i + 1], at, self.kvs[kv],
                                              None if qk is None else qk[i:i + 1])
                                 for i, (at, kv) in enumerate(zip(pos, slot))])
        finally:
            if serial:
                torch.set_num_threads(self.threads)
        out = self._toc("attention", t0, out)
        t0 = self._tic()
        return self._toc("attn_proj", t0, self._linear(p + "o", out)), h

    def attention_residual(self, layer: int, x: torch.Tensor, pos, slot=0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attention, its FFN norm): for one decode token in the same native call as the attention block
        where it applies, else as `Backend.attention_residual` computes it."""
        if x.shape[0] == 1 and isinstance(pos, int):
            block = self._attention_block(layer, x, pos, self.kvs[slot], residual=True)
            if block is not None:
                return block
        return super().attention_residual(layer, x, pos, slot)

    def _attention_block(self, layer: int, x: torch.Tensor, pos: int, kv: KVCache, residual: bool = False):
        """(output, normed input) of one decode token's attention block in one native call (norm, fused q/k/v,
        `NativeKernels.attend`, o: the calls `attention` makes one by one, so the same result), or with `residual`
        (x + output, its FFN norm), where the kernels load and the layer fits them (RMS norm, fused q/k/v, 16-bit
        KV, no q/k norms or soft-capping); else None. Where the parts are timed, each step is charged to its part
        by the call's own clock (the residual's add with its norm)."""
        args = self._block_args[layer]
        if args is None or not self.native_attention or kv.bits != 16:
            return None
        s = self.spec
        window, timed = s.window(layer), self.parts is not None
        out = self.native.attn_block(x, args, kv, layer, pos, max(0, pos - window + 1) if window else 0,
                                     self._rope_ptrs(layer, pos), timed, residual)
        if out is not None and timed:
            steps = ("norms", "attn_proj", "attention", "attn_proj", "norms")[:5 if residual else 4]
            for part, seconds in zip(steps, self.native.block_times):
                self.parts.add_ms(part, seconds * 1e3)
        return out

    def _rope_ptrs(self, layer: int, pos: int) -> tuple:
        """(values, cos address, sin address) of layer `layer`'s rotary tables at `pos` (one token), looked up
        once per forward call and rope (`rope_tables` holds the tensors); (0, None, None) without rotary."""
        if self.spec.positional != "rotary":
            return 0, None, None
        rope = self.ropes[layer]
        tables, addr = self._rope_addr.get(rope, (None, None))
        if tables is None or tables is not self._rope_rows.get(rope) or tables[:2] != (pos, 1):
            cos, sin = self.rope_tables(rope, pos, 1)
            tables, addr = self._rope_rows[rope], (cos.numel(), cos.data_ptr(), sin.data_ptr())
            self._rope_addr[rope] = tables, addr
        return addr

    def prepare_attention(self) -> None:
        """At load, once the resident weights are in place (and fused): each layer's fixed arguments of the
        one-call attention block, or None where it does not apply (`attention` then takes the op-by-op path)."""
        self._block_args = [self._block_of(layer) for layer in range(self.spec.n_layers)]

    def _block_of(self, layer: int) -> tuple | None:
        """Layer `layer`'s fixed arguments of the one-call attention block (`NativeKernels.block_args`), or None
        where the block does not apply to it."""
        s, p = self.spec, f"layers.{layer}."
        if self.native is None or s.norm == "layernorm" or s.qk_norm or s.attn_softcap \
                or self.w.get(p + "qkv.weight") is None:
            return None
        weights = (self.w.get(p + n) for n in ("attn_norm.weight", "qkv.weight", "qkv.bias", "o.weight", "o.bias",
                                                 "ffn_norm.weight"))
        return self.native.block_args(*weights, s.n_heads, s.n_kv_heads, s.head_dim, s.norm_eps,
                                      s.attn_scale or s.head_dim ** -0.5)

    def _attend(self, layer: int, q, k, v, pos: int, kv: KVCache, qk=None) -> torch.Tensor:
        """Rotary, KV cache update and attention of one sequence's new tokens ([T, heads, head_dim]);
        `qk`: q's and k's heads side by side (a view of the fused projection), rotated in one call."""
        s, T = self.spec, q.shape[0]
        S, window = pos + T, s.window(layer)
        lo = max(0, pos - window + 1) if window else 0  # earliest key any of the new queries sees
        scale = s.attn_scale or s.head_dim ** -0.5
        if T == 1 and self._native_attend is not None and self.native_attention:
            cos_sin = None
            if s.positional == "rotary":
                cos_sin = tuple(t.reshape(-1) for t in self.rope_tables(self.ropes[layer], pos, 1))
            out = self._native_attend(q, k, v, kv.k[layer], kv.v[layer], pos, lo, scale, cos_sin)
            if out is not None:  # (tensors of another layout: torch's)
                return out
        if s.positional == "rotary" and qk is not None:
            qk = self._rope(qk, self.ropes[layer], pos)
            q, k = qk[:, :s.n_heads], qk[:, s.n_heads:]
        elif s.positional == "rotary":
            q, k = self._rope(q, self.ropes[layer], pos), self._rope(k, self.ropes[layer], pos)
        keys, vals = kv.update(layer, pos, k, v, lo)  # [kv heads, keys, head_dim] each
        group = s.n_heads // s.n_kv_heads
        if T == 1 and self.tuned and not s.attn_softcap:  # one new token sees every key from lo on
            return self._decode_attention(q[0], keys, vals, scale)
        gqa = group > 1 and self.tuned and not s.attn_softcap  # SDPA shares each kv head itself (no copies)
        if group > 1 and not gqa:
            keys, vals = keys.repeat_interleave(group, dim=0), vals.repeat_interleave(group, dim=0)
        qpos = torch.arange(pos, S, device=self.device)[:, None]
        kpos = torch.arange(lo, S, device=self.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= (qpos - kpos) < window
        q = q.transpose(0, 1)
        if s.attn_softcap:  # Gemma 2: cap * tanh(scores / cap) before the mask; SDPA has no soft-capping
            scores = torch.tanh((q @ keys.transpose(1, 2)) * scale / s.attn_softcap) * s.attn_softcap
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
            out = weights.to(vals.dtype) @ vals
        else:
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1).reshape(T, s.n_heads * s.head_dim)

    @staticmethod
    def _decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
        """One query token q [heads, head_dim] over head-major keys and values [kv heads, S, head_dim]: eager
        attention (scores in the compute dtype, softmax in float32) as two batched matrix-vector products,
        each kv head's query group sharing its rows; [1, heads * head_dim]."""
        kv_heads, head_dim = keys.shape[0], keys.shape[2]
        qg = q.reshape(kv_heads, -1, head_dim)  # query head i reads kv head i // group
        weights = torch.softmax((qg @ keys.transpose(1, 2)).float() * scale, dim=-1).to(vals.dtype)
        return (weights @ vals).reshape(1, -1)

    def _qkv(self, p: str, h: torch.Tensor):
        """(q, k, v, fused) of block prefix `p`: q, k, v [T, heads, head_dim]; where `fuse_resident` fused
        the projections, one call whose [T, all heads, head_dim] output is `fused` (q, k, v are its
        views), else three calls and fused None."""
        s, T = self.spec, h.shape[0]
        w = self.w.get(p + "qkv.weight")
        if w is None:
            return (*(self._linear(p + n, h).view(T, heads, s.head_dim)
                      for n, heads in zip("qkv", (s.n_heads, s.n_kv_heads, s.n_kv_heads))), None)
        fused = self.linear(h, w, self.w.get(p + "qkv.bias")).view(T, s.n_heads + 2 * s.n_kv_heads, s.head_dim)
        return (*fused.split((s.n_heads, s.n_kv_heads, s.n_kv_heads), dim=1), fused)
