"""Quantized arrays on MLX: resident matrices and FFN bundle rows in MLX's affine format, and an
int8 KV cache.

flashllm's asymmetric bundle quantization (w = q * scale + min per group along d_model, int4
nibbles low-first) is MLX's affine format byte for byte, so bundle rows go from flash into
quantized cache arrays without dequantization and the FFN runs on `mx.quantized_matmul`.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from flashllm.format.experts import bf16_values

KV_GROUP = 64


MLX_GROUPS = (64, 32, 128)  # group sizes mx.quantize takes, in order of preference


class QuantArray(NamedTuple):
    """An [n, d] matrix in MLX's affine format: w = scales * q + biases per group along d (mx.quantize);
    `packed` holds 32 // bits codes per uint32, value j at bits j * bits (flashllm's int4/int8 bundle
    codes read as little-endian uint32 are exactly this)."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    stack: tuple | None = None  # an expert slot's part: (packed, scales, biases) of all slots, [slots, n, ...]
    slot: int = -1  # which of them this matrix is

    def rows(self, idx) -> "QuantArray":
        return QuantArray(self.packed[idx], self.scales[idx], self.biases[idx], self.group_size, self.bits)

    def gather_matmul(self, x: mx.array, slots: mx.array) -> mx.array:
        """x[i] @ (slot slots[i] of this slot's stack).T for x [P, M, d]: several experts in one call."""
        packed, scales, biases = self.stack
        return mx.gather_qmm(x, packed, scales, biases, rhs_indices=slots, transpose=True,
                             group_size=self.group_size, bits=self.bits)

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """x @ w.T (transpose) or x @ w."""
        return mx.quantized_matmul(x, self.packed, self.scales, self.biases, transpose=transpose,
                                   group_size=self.group_size, bits=self.bits)

    def dequantize(self) -> mx.array:
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    def host_pieces(self) -> tuple[dict, list[np.ndarray]]:
        """(what `from_host_pieces` needs beside the arrays, the arrays in numpy): to keep the matrix on
        flash (flashllm/modes/quant_layers.py); 2-byte floats travel as their bits (numpy has no bfloat16)."""
        def bits(a):
            return np.array(a.view(mx.uint16) if a.dtype.size == 2 and a.dtype != mx.uint16 else a)

        meta = {"group_size": self.group_size, "bits": self.bits, "dtypes": [a.dtype for a in self[:3]]}
        return meta, [bits(a) for a in self[:3]]

    @classmethod
    def from_host_pieces(cls, meta: dict, arrays: list[np.ndarray]) -> "QuantArray":
        """The matrix `host_pieces` gave, from `arrays` (copied into MLX)."""
        parts = [mx.array(a) for a in arrays]
        parts = [a if a.dtype == dt else a.view(dt) for a, dt in zip(parts, meta["dtypes"])]
        return cls(*parts, meta["group_size"], meta["bits"])


def mlx_quantizable(layout) -> bool:
    """Whether MLX keeps this layout's bundles quantized (affine = flashllm's asymmetric scheme, a group
    size MLX supports); other quantized layouts are dequantized on insert."""
    q = layout.quant
    return q is not None and not q.symmetric and q.group_size in MLX_GROUPS


def quant_rows(block: np.ndarray, layout, part: str, dtype) -> QuantArray:
    """uint8 bundle rows [n, >= bundle_bytes] -> one part's rows as a QuantArray (no dequantization)."""
    q, base = layout.quant, layout.part_range(part).start
    lay = q.part_layout(layout.d_model)

    def piece(key, view):
        off, size = lay[key]
        return mx.array(np.ascontiguousarray(block[:, base + off:base + off + size]).view(view))

    return QuantArray(piece("codes", np.uint32), piece("scales", np.float16).astype(dtype),
                      piece("mins", np.float16).astype(dtype), q.group_size, q.bits)


class MLXExpertSlots:
    """Preallocated expert cache slots that keep quantized experts in MLX's affine format: flashllm's
    asymmetric expert parts (groups along each part's input dimension; W_down stored [d_model, d_ffn])
    are that format byte for byte, so inserting a stored bundle copies its codes, scales and mins into
    a slot, no dequantization, and each use is `mx.quantized_matmul` (int4 and int8 alike)."""

    KIND = "MLX affine format (copied on insert)"  # what the runtime's stats call these slots

    @staticmethod
    def fits(layout) -> bool:
        return mlx_quantizable(layout)

    @staticmethod
    def slot_bytes(layout, itemsize: int) -> int:
        """Codes plus scales and mins in the compute dtype, for the three parts."""
        q = layout.quant
        return sum(rows * (cols * q.bits // 8 + 2 * q.groups(cols) * itemsize)
                   for rows, cols in map(layout.part_shape, layout.parts))

    def __init__(self, capacity: int, layout, dtype):
        self.layout, q = layout, layout.quant
        self.parts = {}
        for p in layout.parts:
            rows, cols = layout.part_shape(p)
            self.parts[p] = [mx.zeros((capacity, rows, cols * q.bits // 32), dtype=mx.uint32),
                             mx.zeros((capacity, rows, q.groups(cols)), dtype=dtype),
                             mx.zeros((capacity, rows, q.groups(cols)), dtype=dtype)]
        mx.eval(self._arrays())

    def _arrays(self) -> list[mx.array]:
        return [a for arrays in self.parts.values() for a in arrays]

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arrays())

    def insert(self, slot: int, raw: np.ndarray) -> None:
        """One stored expert bundle (uint8, >= bundle_bytes) into `slot`."""
        lay = self.layout
        if lay.packing:
            self._insert_packed(slot, raw)
            return
        for p, arrays in self.parts.items():
            stored = lay.part_raw(raw, p)
            pieces = lay.quant.part_layout(lay.part_shape(p)[1])
            for k, (key, view) in enumerate((("codes", np.uint32), ("scales", np.float16), ("mins", np.float16))):
                off, size = pieces[key]
                arrays[k][slot] = mx.array(np.ascontiguousarray(stored[:, off:off + size]).view(view)
                                           ).astype(arrays[k].dtype)
        mx.eval(self._arrays())  # in place now, while nothing else references the slot arrays

    def _insert_packed(self, slot: int, raw: np.ndarray) -> None:
        """A bundle stored in torch's int4 layout (ExpertLayout.packed_pieces): codes unpacked to MLX's
        order, scale as stored (bfloat16), bias = zero - 8 * scale (w = (q - 8) * scale + zero)."""
        lay, f = self.layout, self.layout.d_ffn
        for name, parts in (("up_gate", (("up", 0), ("gate", f))), ("down", (("down", 0),))):
            codes, sz = lay.stored_codes(raw, name), bf16_values(lay.packed(raw, name + "_sz"))
            scale, bias = sz[..., 0].T, sz[..., 1].T - 8 * sz[..., 0].T
            for p, start in parts:
                arrays, rows = self.parts[p], slice(start, start + lay.part_shape(p)[0])
                for k, values in enumerate((np.ascontiguousarray(codes[rows]).view(np.uint32), scale[rows], bias[rows])):
                    arrays[k][slot] = mx.array(np.ascontiguousarray(values)).astype(arrays[k].dtype)
        mx.eval(self._arrays())

    def rows(self, slot: int) -> dict:
        """The slot's parts as `MLXBackend.ffn` takes them: gate and up rows, and W_down as `down_t`
        (x @ W_down.T, like a linear layer)."""
        q, out = self.layout.quant, {}
        for p, (codes, scales, mins) in self.parts.items():
            out["down_t" if p == "down" else p] = QuantArray(codes[slot], scales[slot], mins[slot], q.group_size, q.bits,
                                                             (codes, scales, mins), slot)
        return out


class MLXKVCache:
    """Per layer [1, kv heads, context, head dim] K and V buffers, updated by slice assignment (per-layer
    arrays let MLX update in place); in the compute dtype, or int8 codes with a float32 scale and
    minimum per group of up to 64 values along the head dim (FlexGen's grouping)."""

    def __init__(self, spec, context: int, dtype, bits: int = 16):
        shape, hd = (1, spec.n_kv_heads, context, spec.head_dim), spec.head_dim
        self.bits, self.dtype = bits, dtype
        self.group = KV_GROUP if hd % KV_GROUP == 0 else hd
        n = spec.n_layers
        if bits == 16:
            self.k, self.v = ([mx.zeros(shape, dtype=dtype) for _ in range(n)] for _ in range(2))
        else:
            self.k, self.v = ([mx.zeros(shape, dtype=mx.uint8) for _ in range(n)] for _ in range(2))
            gshape = (*shape[:3], hd // self.group, 2)  # (scale, min) per group
            self.k_sm, self.v_sm = ([mx.zeros(gshape, dtype=mx.float32) for _ in range(n)] for _ in range(2))
        mx.eval(self._arrays())

    def _arrays(self) -> list:
        return self.k + self.v + (self.k_sm + self.v_sm if self.bits == 8 else [])

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arrays())

    def update(self, layer: int, pos: int, k: mx.array, v: mx.array, lo: int):
        """Store k, v ([1, kv heads, T, head dim]) at pos..; return keys and values of lo..pos+T."""
        end = pos + k.shape[2]
        if self.bits == 16:
            self.k[layer][:, :, pos:end], self.v[layer][:, :, pos:end] = k, v
            return self.k[layer][:, :, lo:end], self.v[layer][:, :, lo:end]
        out = []
        for new, codes, sm in ((k, self.k[layer], self.k_sm[layer]), (v, self.v[layer], self.v_sm[layer])):
            g = new.astype(mx.float32).reshape(*new.shape[:3], -1, self.group)
            low, high = g.min(axis=-1), g.max(axis=-1)
            scale = (high - low) / 255
            q = mx.clip(mx.round((g - low[..., None]) / mx.where(scale == 0, 1, scale)[..., None]), 0, 255)
            codes[:, :, pos:end] = q.astype(mx.uint8).reshape(new.shape)
            sm[:, :, pos:end] = mx.stack((scale, low), axis=-1)
            c, s = codes[:, :, lo:end], sm[:, :, lo:end]
            vals = c.reshape(*c.shape[:3], -1, self.group).astype(mx.float32) * s[..., :1] + s[..., 1:]
            out.append(vals.reshape(c.shape).astype(self.dtype))
        return out[0], out[1]
