"""The decoder math on MLX (Metal on Apple silicon, MLX's CPU build elsewhere); same contract as torch.

Weights arrive from the shared runtime as raw bytes or numpy arrays of the storage dtype (bfloat16,
which numpy lacks, as its 16-bit patterns reinterpreted in MLX); they are converted once into MLX
arrays of the compute dtype. MLX is lazy: the
graph of a token is built layer by layer and evaluated when the host needs a value (the predictor's
mask in `greater`, the logits). The neuron-cache row stores evaluate their updates at once, so that
the stats' memory-management time is the real cost and not just graph building; attention and FFN
work still pending when a predictor needs its mask is counted in `predictor_ms` (as with CUDA's
asynchronous kernels in the torch backend), while `total_ms` is exact.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.format.rope import Rope, layer_ropes
from flashllm.format.spec import ArchSpec
from flashllm.backends.base import Backend, default_compute_dtype
from flashllm.backends.mlx.quant import (MLX_GROUPS, MLXExpertSlots, MLXKVCache, QuantArray, mlx_quantizable, quant_rows)
from flashllm.backends.mlx.rows import BYTE_VIEWS, MLXRowStore

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _device(device: str | None) -> mx.Device:
    """cpu, gpu (Metal on a Mac), or None/"auto": the GPU where MLX has one, else the CPU."""
    if device in (None, "auto"):
        return mx.gpu if mx.is_available(mx.gpu) else mx.cpu
    if device == "cpu":
        return mx.cpu
    if device == "gpu":
        if not mx.is_available(mx.gpu):
            where = "this MLX build has no GPU support (Linux installs the CPU build, mlx[cpu])" \
                if sys.platform != "darwin" else "Metal is not available to MLX on this Mac"
            raise FlashLLMError(f"device 'gpu': {where}; use --device cpu")
        return mx.gpu
    if device.startswith("cuda"):
        raise FlashLLMError(f"device {device!r}: the MLX backend runs on Apple silicon (--device gpu, Metal) or "
                            f"--device cpu; for CUDA use --backend torch")
    raise FlashLLMError(f"device {device!r}: the MLX backend supports cpu and gpu")


class MLXBackend(Backend):
    """Holds resident weights and the KV cache as MLX arrays and computes one decoder.

    MLX's default device is process-wide: loading an MLX model makes its device the default, so
    the shared runtime's own array arithmetic (residual adds) runs there too.
    """

    name = "mlx"
    # the one staging buffer flash reads land in: torch's CPU bound (>= 64 rows, <= one layer; base.staging_rows).
    # Every byte of it comes out of the neuron caches at a budget: at 8 MiB (one whole layer of the embedded
    # model) MLX held 1585 cache rows at the demo's settings against torch's 3370; larger fills go in chunks.
    STAGING_BYTES = 256 << 10
    STAGING_BUFFERS = 1

    def __init__(self, spec: ArchSpec, device: str | None, dtype: str | None, storage_dtype: str, context: int,
                 quantized_ffn: bool = False, kv_bits: int = 16):
        if dtype is not None and dtype not in DTYPES:
            raise FlashLLMError(f"dtype {dtype!r}: the MLX backend computes in {', '.join(DTYPES)}")
        self.spec = spec
        self.device = _device(device)
        mx.set_default_device(self.device)
        self.dtype_name = default_compute_dtype(dtype, storage_dtype, self.device == mx.cpu, float16_on_cpu=False)
        self.storage_dtype_name = storage_dtype
        self.dtype = self._mx = DTYPES[self.dtype_name]
        self.itemsize = self.dtype.size
        self.context = context
        self.w: dict[str, mx.array] = {}
        # one preallocated [1, kv_heads, context, head_dim] buffer per layer, updated by slice
        # assignment: per-layer arrays let MLX update in place (a single [layers, ...] array would be
        # copied whole while an earlier layer's attention still references it in the lazy graph)
        self.kvs = [MLXKVCache(spec, context, self._mx, kv_bits)]  # batch decoding: torch only, so one
        self.act = self.activation(spec.activation, spec.activation_threshold)
        self._staging = None
        self.ropes = layer_ropes(spec)
        self._rope_rows: dict[Rope, tuple] = {}  # rope -> (pos, count, cos, sin) of the current call

    # -- weights -------------------------------------------------------------------------------
    def tensor(self, array) -> mx.array:
        """A weight block (numpy or MLX) as a contiguous MLX array in the compute dtype."""
        out = (array if isinstance(array, mx.array) else mx.array(np.ascontiguousarray(array))).astype(self._mx)
        mx.eval(out)
        return out

    def storage_view(self, raw: np.ndarray, dtype: str | None = None) -> mx.array:
        np_view, mx_view = BYTE_VIEWS[dtype or self.storage_dtype_name]
        out = mx.array(np.ascontiguousarray(raw).view(np_view))
        return out.view(mx_view) if mx_view is not None else out

    def kv_bytes(self) -> int:
        return self.kvs[0].nbytes()

    @staticmethod
    def nbytes_of(t: mx.array | QuantArray) -> int:
        return sum(int(a.nbytes) for a in t[:3]) if isinstance(t, QuantArray) else int(t.nbytes)

    def quantized(self, t: mx.array, bits: int, gather: bool) -> QuantArray:
        """mx.quantize's affine format, groups of 64 (32 or 128 where 64 does not divide the row), of `t`
        (any float dtype) in the compute dtype."""
        group = next((g for g in MLX_GROUPS if t.shape[-1] % g == 0), None)
        if group is None:
            raise FlashLLMError(f"--quantize-resident int{bits}: a {t.shape[0]}x{t.shape[1]} matrix has no MLX group "
                                f"size in {MLX_GROUPS} dividing {t.shape[1]}")
        out = QuantArray(*mx.quantize(self.tensor(t), group_size=group, bits=bits), group, bits)
        mx.eval(out[:3])
        return out

    def bundle_rows(self, block: np.ndarray, layout, parts: tuple[str, ...] | None = None,
                    keep_quantized: bool = False) -> dict:
        """As Backend.bundle_rows; with `keep_quantized`, MLX-compatible quantized parts stay QuantArrays."""
        if not (keep_quantized and mlx_quantizable(layout)):
            return super().bundle_rows(block, layout, parts)
        return {p: quant_rows(block, layout, p, self._mx) for p in parts or layout.parts}

    def cache_row_bytes(self, layout) -> int:
        if not mlx_quantizable(layout):
            return super().cache_row_bytes(layout)
        groups = layout.quant.groups(layout.d_model)
        per_part = layout.d_model * layout.quant.bits // 8 + 2 * groups * self.itemsize
        return len(layout.parts) * per_part + 2 * self.itemsize

    def row_store(self, capacity: int, layout, biases: dict):
        return MLXRowStore(self, capacity, layout, biases)

    def expert_slot_bytes(self, layout) -> int | None:
        """Quantized experts of MLX's affine format (asymmetric; groups of 32/64/128) stay quantized."""
        return MLXExpertSlots.slot_bytes(layout, self.itemsize) if MLXExpertSlots.fits(layout) else None

    def expert_slots(self, layout, capacity: int) -> MLXExpertSlots:
        return MLXExpertSlots(capacity, layout, self._mx)

    def reads_in_place(self) -> bool:
        """Flash reads never land in MLX arrays directly: they go through the staging buffer."""
        return False

    def staging(self, stride: int) -> np.ndarray:
        """One page-aligned staging buffer shared by every cache of this backend (reads are sequential)."""
        from flashllm.hugepages import aligned_empty

        if self._staging is None or self._staging.shape[1] != stride:
            self._staging = aligned_empty((self.staging_rows(stride), stride), np.uint8)
        return self._staging

    def host_buffer(self, shape) -> np.ndarray:
        """A page-aligned host buffer for flash reads."""
        from flashllm.hugepages import aligned_empty

        return aligned_empty(shape, np.uint8)

    @property
    def on_gpu(self) -> bool:
        """False: on Apple silicon the GPU shares DRAM, so everything counts against one DRAM budget."""
        return False

    def linear(self, x: mx.array, w: mx.array | QuantArray, b: mx.array | None) -> mx.array:
        if isinstance(w, QuantArray):
            y = w.matmul(x, transpose=True)
            return y if b is None else y + b
        return x @ w.T if b is None else mx.addmm(b, x, w.T)

    def columns(self, x: mx.array, ids: np.ndarray) -> mx.array:
        return mx.take(x, mx.array(ids.astype(np.int32)), axis=1)

    def matmul(self, x: mx.array, w: mx.array | QuantArray) -> mx.array:
        """x @ w (the FFN's down projection over cached columns)."""
        return w.matmul(x, transpose=False) if isinstance(w, QuantArray) else x @ w

    def to_host(self, x: mx.array) -> np.ndarray:
        """x as a float32 numpy array (evaluates the graph so far: a predictor's scores, the logits)."""
        return np.array(x.astype(mx.float32))

    square, tanh = map(staticmethod, (mx.square, mx.tanh))

    @staticmethod
    def relu(x: mx.array) -> mx.array:
        return mx.maximum(x, 0)

    @staticmethod
    def gelu(x: mx.array) -> mx.array:
        return 0.5 * x * (1 + mx.erf(x * (2 ** -0.5)))

    @staticmethod
    def gelu_tanh(x: mx.array) -> mx.array:
        return 0.5 * x * (1 + mx.tanh((2 / np.pi) ** 0.5 * (x + 0.044715 * x ** 3)))

    @staticmethod
    def silu(x: mx.array) -> mx.array:
        return x * mx.sigmoid(x)

    @staticmethod
    def scalar(value: float, dtype) -> mx.array:
        return mx.array(value, dtype=dtype)

    @staticmethod
    def rope_array(table: np.ndarray) -> mx.array:
        return mx.array(table)


    def zeros_like(self, x: mx.array) -> mx.array:
        return mx.zeros_like(x)

    def zeros(self, shape) -> mx.array:
        """A preallocated array of `shape` in the compute dtype (e.g. expert slots, updated by assignment)."""
        out = mx.zeros(tuple(shape), dtype=self._mx)
        mx.eval(out)
        return out

    # -- forward pieces ------------------------------------------------------------------------
    def norm(self, name: str, x: mx.array) -> mx.array:
        w, b, eps = self.w[name + ".weight"], self.w.get(name + ".bias"), self.spec.norm_eps
        if self.spec.norm == "layernorm":
            return mx.fast.layer_norm(x, w, b, eps)
        return mx.fast.rms_norm(x, w, eps)

    def embedding_rows(self, ids: list[int]) -> mx.array:
        table, idx = self.w["embed.weight"], mx.array(ids, dtype=mx.int32)
        return table.rows(idx).dequantize() if isinstance(table, QuantArray) else table[idx]

    def _linear(self, name: str, x: mx.array) -> mx.array:
        return self.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _rope(self, x: mx.array, rope: Rope, pos: int) -> mx.array:
        """HF rotate-half rotary on the first rope_dim dims of [1, heads, T, head_dim], tables from flashllm.format.rope."""
        rd, T = self.spec.rope_dim, x.shape[2]
        cos, sin = self.rope_tables(rope, pos, T)
        xr, half = x[..., :rd].astype(mx.float32), rd // 2
        rotated = mx.concatenate((-xr[..., half:], xr[..., :half]), axis=-1)
        out = (xr * cos + rotated * sin).astype(x.dtype)
        return out if rd == x.shape[-1] else mx.concatenate((out, x[..., rd:]), axis=-1)

    def attention(self, layer: int, x: mx.array, pos: int, slot: int = 0) -> tuple[mx.array, mx.array]:
        """Self-attention of block `layer` for tokens at positions pos..; returns (output, normed input).
        One sequence only (`slot` 0): MLX has no batch decoding yet (see Backend.new_kv)."""
        s, p, T = self.spec, f"layers.{layer}.", x.shape[0]
        h = self.norm(p + "attn_norm", x)
        q, k, v = (self._linear(p + n, h) for n in "qkv")
        if s.qk_norm and s.qk_norm_full:
            q, k = self.norm(p + "q_norm", q), self.norm(p + "k_norm", k)
        q = q.reshape(T, s.n_heads, s.head_dim)
        k, v = k.reshape(T, s.n_kv_heads, s.head_dim), v.reshape(T, s.n_kv_heads, s.head_dim)
        if s.qk_norm and not s.qk_norm_full:
            q, k = self.norm(p + "q_norm", q), self.norm(p + "k_norm", k)
        q, k, v = (a.transpose(1, 0, 2)[None] for a in (q, k, v))  # [1, heads, T, head_dim]
        if s.positional == "rotary":
            q, k = self._rope(q, self.ropes[layer], pos), self._rope(k, self.ropes[layer], pos)
        S, window = pos + T, s.window(layer)
        lo = max(0, pos - window + 1) if window else 0  # earliest key any query sees
        keys, vals = self.kvs[slot].update(layer, pos, k, v, lo)
        mask = None
        if T > 1:  # causal (and windowed) among the new tokens; one decode token sees all of lo..S-1
            qpos, kpos = mx.arange(pos, S)[:, None], mx.arange(lo, S)[None, :]
            mask = kpos <= qpos
            if window:
                mask = mask & ((qpos - kpos) < window)
        scale = s.attn_scale or s.head_dim ** -0.5
        if s.attn_softcap:  # Gemma 2: cap * tanh(scores / cap) before the mask; the fused kernel has no cap
            group = s.n_heads // s.n_kv_heads
            keys, vals = mx.repeat(keys, group, axis=1), mx.repeat(vals, group, axis=1)
            scores = mx.tanh((q @ keys.transpose(0, 1, 3, 2)) * scale / s.attn_softcap) * s.attn_softcap
            if mask is not None:
                scores = mx.where(mask, scores, -mx.inf)
            out = mx.softmax(scores.astype(mx.float32), axis=-1).astype(vals.dtype) @ vals
        else:  # GQA/MQA: the fused kernel takes kv heads untiled
            out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=mask)
        return self._linear(p + "o", out[0].transpose(1, 0, 2).reshape(T, s.n_heads * s.head_dim)), h

    def ffn(self, x: mx.array, rows: dict[str, mx.array], up_bias, gate_bias, down_bias,
            threshold: float | None = None, gate_pre: mx.array | None = None, index: np.ndarray | None = None,
            acc: mx.array | None = None, finish: bool = False) -> mx.array:
        """FFN over the neurons whose bundle parts are `rows[part]` ([n, d] each; down rows = columns, or
        `down_t` [d, n]: W_down as quantized expert slots hold it);
        with `threshold`, neurons with |act(pre)| <= threshold contribute zero (calibrated sparsity);
        `gate_pre` [T, n]: the gate pre-activations, from resident gate rows (then `rows` has no gate).
        `index`, `acc`, `finish`: as TorchBackend.ffn (only rows `index`; added to the float32 `acc`, which MLX
        returns as a new array: use the result); each call's part is rounded to the compute dtype first."""
        if index is not None:
            idx = mx.array(np.asarray(index, dtype=np.int32))
            rows = {k: v.rows(idx) if isinstance(v, QuantArray) else v[idx] for k, v in rows.items()}
            up_bias, gate_bias = (None if b is None else b[idx] for b in (up_bias, gate_bias))
            gate_pre = None if gate_pre is None else gate_pre[:, idx]
        if acc is not None:
            acc = acc + self.ffn(x, rows, up_bias, gate_bias, None, threshold, gate_pre).astype(mx.float32)
            return self.ffn_result(acc, x, down_bias) if finish else acc
        up = self.linear(x, rows["up"], up_bias)
        if gate_pre is None and self.spec.gated_ffn:
            gate_pre = self.linear(x, rows["gate"], gate_bias)
        a = self.act(gate_pre) if self.spec.gated_ffn else self.act(up)
        if threshold is not None:
            a = a * (mx.abs(a) > threshold)
        h = a * up if self.spec.gated_ffn else a
        if "down_t" in rows:  # W_down [d_model, n] (quantized expert slots)
            return self.linear(h, rows["down_t"], down_bias)
        y = self.matmul(h, rows["down"])
        return y + down_bias if down_bias is not None else y

    def ffn_acc(self, x: mx.array) -> mx.array:
        return mx.zeros((x.shape[0], self.spec.d_model), dtype=mx.float32)

    @staticmethod
    def ffn_result(acc: mx.array, x: mx.array, down_bias) -> mx.array:
        y = acc.astype(x.dtype)
        return y + down_bias if down_bias is not None else y

    def moe_experts(self, x: mx.array, groups: list, acc: mx.array | None = None) -> mx.array:
        """Routed experts added into a float32 accumulator [T, d_model] (see TorchBackend.moe_experts); experts
        in quantized slots of one layer's MLXExpertSlots, all in one `mx.gather_qmm` per part."""
        acc = mx.zeros(x.shape, dtype=mx.float32) if acc is None else acc
        if groups and all(_slot_rows(groups[0][0], rows) for rows, _, _ in groups):
            return self._gathered_experts(x, groups, acc)
        for rows, tokens, weights in groups:
            idx = mx.array(tokens.astype(np.int32))
            out = self.ffn(x[idx], rows, None, None, None).astype(mx.float32) * mx.array(weights)[:, None]
            acc = acc.at[idx].add(out)
        return acc

    def _gathered_experts(self, x: mx.array, groups: list, acc: mx.array) -> mx.array:
        """`moe_experts` over quantized slots: each (token, expert) pair is one row of a gathered batch, so
        every expert of the call is one `mx.gather_qmm` per part (the math of `ffn` per expert)."""
        tokens = np.concatenate([t for _, t, _ in groups]).astype(np.int32)
        slots = np.concatenate([np.full(len(t), rows["up"].slot, dtype=np.uint32) for rows, t, _ in groups])
        weights = np.concatenate([w for _, _, w in groups]).astype(np.float32)
        order = np.argsort(slots, kind="stable")  # sorted slot indices: gather_qmm may take a faster path
        tokens, slots, weights = tokens[order], slots[order], weights[order]
        idx, at = mx.array(slots), mx.array(tokens)
        rows, xs = groups[0][0], x[at][:, None, :]  # [pairs, 1, d_model]
        up = rows["up"].gather_matmul(xs, idx)
        h = self.act(rows["gate"].gather_matmul(xs, idx)) * up if self.spec.gated_ffn else self.act(up)
        out = rows["down_t"].gather_matmul(h, idx)[:, 0, :]
        return acc.at[at].add(out.astype(mx.float32) * mx.array(weights)[:, None])

    def moe_output(self, x: mx.array, acc: mx.array, shared: dict | None = None, shared_gate=None) -> mx.array:
        """The routed experts' float32 sum plus the shared expert (scaled by sigmoid(shared_gate . x) if
        given), in x's dtype."""
        if shared is not None:
            out = self.ffn(x, shared, None, None, None)
            acc = acc + (mx.sigmoid(self.linear(x, shared_gate, None)) * out if shared_gate is not None else out
                         ).astype(mx.float32)
        return acc.astype(x.dtype)


def _slot_rows(first: dict, rows: dict) -> bool:
    """Whether an expert's `rows` are quantized slots of the same slot arrays as `first`'s (and nothing else)."""
    return rows.keys() == first.keys() and "down_t" in rows and all(
        isinstance(t, QuantArray) and t.stack is not None and t.stack[0] is first[p].stack[0] for p, t in rows.items())
