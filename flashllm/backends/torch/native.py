"""Torch tensors to flashllm's native CPU kernels (backends/native): one decode token's mat-vec and sparse
FFN over cache rows. Each method returns None where a kernel does not apply (several tokens, a quantized or
non-CPU tensor, another dtype or activation): the caller then takes its torch path."""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from flashllm.backends import native
from flashllm.backends.torch.quant import QuantRows

# compute dtypes the native kernels serve (float32 stays on torch's BLAS, which is as fast there)
NATIVE_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# activations the quantized kernels take (their weights are never float32: these serve float32 compute too)
QUANT_DTYPES = {**NATIVE_DTYPES, torch.float32: "float32"}


class NativeKernels:
    """The loaded kernels with the backend's thread count; `linear` and `ffn` as the torch backend calls them."""

    def __init__(self, lib: native.Kernels, threads: int):
        self.lib, self.threads = lib, threads
        self.calls = {"linear": 0, "ffn": 0, "norm": 0, "attend": 0, "block": 0, "qlinear": 0, "qffn": 0,
                      "qmatmul": 0, "experts": 0}  # kernel calls made (tests check the path)
        self.block_times = (ctypes.c_double * 5)()  # attn_block's seconds per step, where the parts are timed
        self._ffn_calls = {}  # (ids of an FFN's rows, biases, ...) -> (weak refs to them, its checked kernel call)
        self._low_rank_bufs = {}  # (rank, neurons, dtype) -> `low_rank`'s two output tensors

    @staticmethod
    def _plain(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
        return t is None or (type(t) is torch.Tensor and t.dtype == dtype and t.device.type == "cpu")

    def linear(self, x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [1, in] @ w[out, in].T + b as [1, out] (rounded once), into `out` (a contiguous [1, out] of x's dtype)
        where given, or None: not for this kernel."""
        dt = NATIVE_DTYPES.get(x.dtype)
        if dt is None or x.dim() != 2 or x.shape[0] != 1 or not self._plain(w, x.dtype) or not self._plain(b, x.dtype) \
                or w.dim() != 2 or w.stride(1) != 1 or x.device.type != "cpu" or w.shape[1] != x.shape[1] \
                or (b is not None and b.shape != (w.shape[0],)):
            return None
        x = x.contiguous()
        b = None if b is None else b.contiguous()
        y = torch.empty(1, w.shape[0], dtype=x.dtype) if out is None else out
        rc = self.lib.matvec(native.DTYPES[dt], w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), x.data_ptr(),
                        None if b is None else b.data_ptr(), y.data_ptr(), self.threads)
        if rc:
            raise MemoryError("native mat-vec: out of memory")
        self.calls["linear"] += 1
        return y

    def low_rank(self, x: torch.Tensor, proj_in, proj_out, bias) -> np.ndarray | None:
        """A low-rank predictor's logits proj_out (proj_in x) + bias [1, n] as float32 numpy: the two `linear` calls
        into buffers made once, then one copy into numpy (the same bits as `linear`, `linear`, `to_host`); None:
        not for this kernel. It runs twice per layer and token (prediction and read-ahead), and the output tensors
        and float32 copy made per call would cost more than its 1-4 MB of weights."""
        if not (type(proj_in) is type(proj_out) is torch.Tensor and proj_in.dim() == proj_out.dim() == 2):
            return None
        key = (proj_in.shape[0], proj_out.shape[0], x.dtype)
        bufs = self._low_rank_bufs.get(key)
        if bufs is None:
            bufs = self._low_rank_bufs[key] = (torch.empty(1, key[0], dtype=x.dtype), torch.empty(1, key[1], dtype=x.dtype))
        mid = self.linear(x, proj_in, None, out=bufs[0])
        y = None if mid is None else self.linear(mid, proj_out, bias, out=bufs[1])
        if y is None:
            return None
        logits = np.empty((1, key[1]), dtype=np.float32)
        torch.from_numpy(logits).copy_(y)
        return logits

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
        """w * rms_norm(x) over x's last dimension, as TorchBackend.norm's torch path rounds it (float32 norm,
        rounded to x's dtype, then the scale); None: not for this kernel."""
        dt = NATIVE_DTYPES.get(x.dtype)
        if dt is None or not self._plain(x, x.dtype) or not self._plain(w, x.dtype) or w.shape != x.shape[-1:]:
            return None
        x, w = x.contiguous(), w.contiguous()
        y = torch.empty_like(x)
        self.lib.rmsnorm(native.DTYPES[dt], x.data_ptr(), w.data_ptr(), x.numel() // w.numel(), w.numel(), eps,
                          y.data_ptr())
        self.calls["norm"] += 1
        return y

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               pos: int, lo: int, scale: float, cos_sin) -> torch.Tensor | None:
        """One token's rotary (`cos_sin`: float32 [rope dim] tables for `pos`, or None), KV write at `pos` into one
        layer's caches (K and V [kv heads, ctx, hd]) and attention over keys lo..pos, as
        [1, heads * hd]; q [1, heads, hd], k and v [1, kv heads, hd]. None where the kernel does not apply."""
        dt = NATIVE_DTYPES.get(q.dtype)
        heads, hd = q.shape[1], q.shape[2]
        kvh = k.shape[1]
        if dt is None or q.shape[0] != 1 or not all(self._plain(t, q.dtype) and t.is_contiguous()
                                                    for t in (q, k, v, k_cache, v_cache)) \
                or k.shape != (1, kvh, hd) or v.shape != k.shape or heads % kvh or k_cache.shape[0] != kvh \
                or k_cache.shape[2] != hd or v_cache.shape != k_cache.shape \
                or not 0 <= lo <= pos < k_cache.shape[1]:
            return None
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        if cos is not None and not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
                                    and sin.is_contiguous() and cos.numel() == sin.numel() <= hd):
            return None
        out = torch.empty(1, heads * hd, dtype=q.dtype)
        rc = self.lib.attend(native.DTYPES[dt], q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), k_cache.shape[1], pos, lo, heads, kvh, hd,
                             0 if cos is None else cos.numel(), None if cos is None else cos.data_ptr(),
                             None if sin is None else sin.data_ptr(), float(scale), out.data_ptr(), self.threads)
        if rc:
            raise MemoryError("native attention: out of memory")
        self.calls["attend"] += 1
        return out

    def block_args(self, norm_w, wqkv, bqkv, wo, bo, ffn_w, heads: int, kvh: int, hd: int, eps: float, scale: float):
        """One layer's fixed arguments of `attn_block`, checked once (resident weights do not change after load), or
        None where its weights do not fit: plain CPU tensors of one native dtype, the norm's [d], q/k/v fused as
        [(heads + 2 kv heads) * hd, d], the output projection [d_out, heads * hd], rows of unit stride, biases (or
        None) one per row; the FFN norm's weight `ffn_w` [d] (with d_out == d; else, or None, no residual form)."""
        dt = norm_w.dtype
        d, rows = norm_w.numel(), (heads + 2 * kvh) * hd
        if dt not in NATIVE_DTYPES or not all(self._plain(t, dt) for t in (norm_w, wqkv, bqkv, wo, bo)) \
                or norm_w.dim() != 1 or not norm_w.is_contiguous() or wqkv.dim() != 2 or wo.dim() != 2 \
                or wqkv.shape != (rows, d) or wo.shape[1] != heads * hd or wqkv.stride(1) != 1 or wo.stride(1) != 1 \
                or (bqkv is not None and (bqkv.shape != (rows,) or not bqkv.is_contiguous())) \
                or (bo is not None and (bo.shape != wo.shape[:1] or not bo.is_contiguous())) or heads % kvh:
            return None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        ffn_ok = ffn_w is not None and self._plain(ffn_w, dt) and ffn_w.shape == (d,) and ffn_w.is_contiguous() \
            and wo.shape[0] == d
        return (native.DTYPES[NATIVE_DTYPES[dt]], dt, d, wo.shape[0],
                (norm_w.data_ptr(), float(eps), d, wqkv.data_ptr(), wqkv.stride(0), ptr(bqkv), wo.data_ptr(),
                 wo.stride(0), ptr(bo), wo.shape[0]), (heads, kvh, hd), float(scale), ffn_w.data_ptr() if ffn_ok else None)

    def attn_block(self, x: torch.Tensor, args: tuple, kv, layer: int, pos: int, lo: int, rope: tuple,
                   timed: bool, residual: bool = False) -> tuple | None:
        """One decode token's attention block (norm, fused q/k/v projection, `attend`, output projection) in one
        call with a layer's `block_args`, over 16-bit KV cache `kv` (K and V [layers, kv heads, ctx, hd],
        contiguous, `layer_ptrs`) and the rotary tables for `pos` as `rope` = (values, cos address, sin address):
        float32 [values] each, or (0, None, None): (output [1, d_out], normed input [1, d]); `residual`: (x + output,
        its FFN norm) instead, where `block_args` found the FFN norm; None where x or the caches do not fit (or
        no FFN norm). `timed`: the seconds of each step are left in `block_times`. Everything fixed is checked and
        looked up once: each tensor op here costs ~10 us on caches the weight streams flushed."""
        code, dt, d, d_out, weights, heads_kvh_hd, scale, ffn_w = args
        if x.dtype != dt or x.shape != (1, d) or not x.is_contiguous() or kv.dtype != dt \
                or not 0 <= lo <= pos < kv.context or (residual and ffn_w is None):
            return None
        a, b = torch.empty_like(x), torch.empty(1, d_out, dtype=dt)  # (h, y), or (x_out, ffn_in)
        # the C call's (h, y, ffn_w, x_out, ffn_in)
        outputs = (None, None, ffn_w, a.data_ptr(), b.data_ptr()) if residual else (a.data_ptr(), b.data_ptr(), None,
                                                                                     None, None)
        rc = self.lib.attn_block(code, x.data_ptr(), *weights, *kv.layer_ptrs[layer], kv.context, pos, lo,
                                 *heads_kvh_hd, *rope, scale, *outputs, self.threads,
                                 self.block_times if timed else None)
        if rc:
            raise MemoryError("native attention block: out of memory")
        self.calls["block"] += 1
        return (a, b) if residual else (b, a)

    def qlinear(self, x: torch.Tensor, w: QuantRows, b: torch.Tensor | None) -> torch.Tensor | None:
        """x [1, d] @ w.T + b over quantized rows kept as stored, as [1, rows] of x's dtype; None: not for it."""
        dt = NATIVE_DTYPES.get(x.dtype, "float32" if x.dtype == torch.float32 else None)
        if dt is None or x.dim() != 2 or x.shape != (1, w.d) or not self._plain(b, x.dtype) \
                or (b is not None and b.shape != (len(w),)):
            return None
        x, q = x.contiguous(), w.scheme
        b = None if b is None else b.contiguous()
        y = torch.empty(1, len(w), dtype=x.dtype)
        rc = self.lib.qmatvec(q.bits, int(q.symmetric), q.group_size, w.ptr(), len(w), w.d, w.raw.strides[0],
                              native.DTYPES[dt], x.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                              self.threads)
        if rc:
            raise MemoryError("native quantized mat-vec: out of memory")
        self.calls["qlinear"] += 1
        return y

    def qmatmul(self, x: torch.Tensor, raw: np.ndarray, scheme, b: torch.Tensor | None) -> torch.Tensor | None:
        """x [..., in] @ W.T + b as [..., out] of x's dtype, W the quantized rows `raw` (uint8 [out, part bytes],
        flashllm/format/quant.py's layout, `scheme`), any number of tokens: the int8-activation kernel
        (kernels_qdot.c); None: not for this kernel."""
        dt, n = QUANT_DTYPES.get(x.dtype), raw.shape[0]
        if dt is None or x.device.type != "cpu" or raw.strides[1] != 1 or x.shape[-1] == 0 \
                or (b is not None and not (self._plain(b, x.dtype) and b.shape == (n,))):
            return None
        xc = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        rc = self.lib.qmatmul(scheme.bits, int(scheme.symmetric), scheme.group_size, raw.ctypes.data, n, xc.shape[1],
                              raw.strides[0], native.DTYPES[dt], xc.shape[0], xc.data_ptr(),
                              None if b is None else b.contiguous().data_ptr(), y.data_ptr(), self.threads)
        if rc == -2:
            return None
        if rc:
            raise MemoryError("native quantized mat-vec: out of memory")
        self.calls["qmatmul"] += 1
        return y

    def experts(self, x: torch.Tensor, slots, ids: np.ndarray, start: np.ndarray, tokens: np.ndarray,
                weights: np.ndarray, act: str, act_param: float, acc: torch.Tensor) -> bool:
        """acc [T, d] (float32) += weights[k] * expert(x[tokens[k]]) for the experts in slots `ids` of `slots`
        (NativeExpertSlots) and their (token, weight) pairs start[i]..start[i + 1]: one native call (kernels_experts.c's
        fl_experts); False (acc untouched) where it does not apply."""
        dt, code, lay = QUANT_DTYPES.get(x.dtype), native.ACTIVATIONS.get(act), slots.layout
        if dt is None or code is None or x.device.type != "cpu" or acc.dtype != torch.float32 \
                or not acc.is_contiguous() or acc.shape != x.shape or x.shape[-1] != lay.d_model:
            return False
        x, q, ptrs = x.contiguous(), lay.quant, slots.addresses(ids)
        rc = self.lib.experts(q.bits, int(q.symmetric), q.group_size, len(ids), ptrs.ctypes.data, start.ctypes.data,
                              tokens.ctypes.data, weights.ctypes.data, lay.d_model, lay.d_ffn, slots.ld_in,
                              slots.ld_down, native.DTYPES[dt], x.shape[0], x.data_ptr(), code, float(act_param),
                              acc.data_ptr(), self.threads)
        if rc == -2:
            return False
        if rc:
            raise MemoryError("native experts: out of memory")
        self.calls["experts"] += 1
        return True

    def ffn(self, x: torch.Tensor, rows: dict, up_bias, gate_bias, gate_pre, act: str, act_param: float,
            threshold: float | None, index: np.ndarray | None, acc: torch.Tensor, gated: bool,
            y: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, zero: bool = False):
        """acc [1, d] (float32) += the FFN contributions of cache rows `rows` (views [n, d] of one row store,
        or only rows `index`): the one-pass kernel; None (acc untouched) where it does not apply. `zero`: acc
        starts from zero; `y` [1, d] of x's dtype: also the FFN's output, acc rounded plus `down_bias`
        (TorchBackend.ffn_result's math, in the same call)."""
        if x.shape[0] != 1 or x.device.type != "cpu" or acc.dtype != torch.float32 or not acc.is_contiguous():
            return None
        call = self._ffn_call(x, rows, up_bias, gate_bias, gate_pre is None, act, act_param, gated)
        if call is None:
            return None
        fn, n, d, kind = call
        pre = None if gate_pre is None else gate_pre.contiguous()
        db = None if down_bias is None else down_bias.contiguous()
        if x.shape[1] != d or acc.numel() != d or (pre is not None and not (self._plain(pre, x.dtype) and pre.numel() == n)) \
                or (y is not None and not (self._plain(y, x.dtype) and y.is_contiguous() and y.numel() == d)) \
                or (db is not None and not (y is not None and self._plain(db, x.dtype) and db.numel() == d)):
            return None
        index = self._checked(index, n)
        rc = fn(None if index is None else index.ctypes.data, n if index is None else len(index), x.contiguous().data_ptr(),
                None if pre is None else pre.data_ptr(), int(threshold is not None), float(threshold or 0.0),
                acc.data_ptr(), self.threads, int(zero), None if y is None else y.data_ptr(),
                None if db is None else db.data_ptr())
        if rc:
            raise MemoryError("native FFN: out of memory")
        self.calls[kind] += 1
        return acc

    def _ffn_call(self, x, rows, up_bias, gate_bias, own_gate: bool, act, act_param, gated):
        """(call(index, n, x, gate_pre, has_threshold, threshold, acc, threads, zero, y, down_bias), rows, d, "ffn" or
        "qffn") of the FFN kernel for these cache rows and per-row biases, or None where no kernel takes them. Made once per
        views dict and kept while its tensors live (a row store's views change only when its row count does):
        the checks cost about 0.1 ms per call on the caches a token's weight streams have just flushed."""
        key = (id(rows), id(up_bias), id(gate_bias), own_gate, x.dtype, act, act_param, gated)
        hit, held = self._ffn_calls.get(key), (*rows.values(), up_bias, gate_bias)
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], held)):
            return hit[1]
        call = self._ffn_args(x, rows, up_bias, gate_bias, own_gate, act, act_param, gated)
        if call is not None and all(t is None or isinstance(t, (torch.Tensor, QuantRows)) for t in held):
            if len(self._ffn_calls) >= 64:  # views of row counts no longer used: start again
                self._ffn_calls.clear()
            none = lambda: None  # noqa: E731
            self._ffn_calls[key] = ([none if t is None else weakref.ref(t) for t in held], call)
        return call

    def _ffn_args(self, x, rows, up_bias, gate_bias, own_gate: bool, act, act_param, gated):
        """`_ffn_call`'s checks and call: the float kernel over float16/bfloat16 rows, the quantized one over
        QuantRows of one row store (float32, float16 or bfloat16 activations)."""
        quant = isinstance(rows.get("up"), QuantRows)
        dt = NATIVE_DTYPES.get(x.dtype, "float32" if quant and x.dtype == torch.float32 else None)
        code = native.ACTIVATIONS.get(act)
        parts = [rows.get("up"), rows.get("gate") if own_gate and gated else None, rows.get("down")]
        present = [t for t in parts if t is not None]
        if dt is None or code is None or parts[0] is None or parts[2] is None or (gated and own_gate and parts[1] is None):
            return None
        if quant:
            if not all(isinstance(t, QuantRows) and t.same_rows(present[0]) for t in present):
                return None
            n, d = present[0].shape
            ld, ptr = present[0].raw.strides[0], [None if t is None else t.ptr() for t in parts]
        else:
            if not all(self._plain(t, x.dtype) and t.stride(1) == 1 and t.stride(0) == present[0].stride(0)
                       and t.shape == present[0].shape for t in present):
                return None
            n, d = present[0].shape
            ld, ptr = present[0].stride(0), [None if t is None else t.data_ptr() for t in parts]
        # per-row biases: views of the row store's (updated in place as rows are placed), never copies
        if not all(t is None or (self._plain(t, x.dtype) and t.is_contiguous() and t.numel() == n)
                   for t in (up_bias, gate_bias)):
            return None
        ub, gb = (None if t is None else t.data_ptr() for t in (up_bias, gate_bias))
        dtc, lib, g, a = native.DTYPES[dt], self.lib, int(gated), float(act_param)
        if quant:
            q = present[0].scheme

            def call(index, count, xp, pre, has_t, t, acc, threads, zero, y, db):
                return lib.qffn(q.bits, int(q.symmetric), q.group_size, ptr[0], ptr[1], ptr[2], ld, d, index, count,
                                dtc, xp, ub, gb, pre, g, code, a, has_t, t, acc, threads, zero, y, db)
        else:
            def call(index, count, xp, pre, has_t, t, acc, threads, zero, y, db):
                return lib.ffn(dtc, ptr[0], ptr[1], ptr[2], ld, d, index, count, xp, ub, gb, pre, g, code, a, has_t, t,
                               acc, threads, zero, y, db)
        return call, n, d, "qffn" if quant else "ffn"

    @staticmethod
    def _checked(index: np.ndarray | None, n: int) -> np.ndarray | None:
        """A row index list as contiguous int64, every entry in 0..n-1."""
        if index is None:
            return None
        index = np.ascontiguousarray(index, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= n):
            raise IndexError(f"FFN row index out of range 0..{n - 1}")
        return index
