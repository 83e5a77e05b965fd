"""A neuron cache's rows as MLX arrays (`MLXBackend.row_store`): where flash reads land, how they are placed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from flashllm.backends.mlx.quant import QuantArray, mlx_quantizable, quant_rows
from flashllm.stats import untimed

# how raw bytes of a dtype cross into MLX: (numpy view, MLX view of it or None)
BYTE_VIEWS = {"float32": (np.float32, None), "float16": (np.float16, None), "bfloat16": (np.uint16, mx.bfloat16)}

class MLXRowStore:
    """A neuron cache's preallocated bundle rows (plus per-row FFN biases) as MLX arrays.

    One [capacity, d_model] array per bundle part rather than one [capacity, bundle] matrix: MLX's
    matmul copies a row-strided view before multiplying, so per-part arrays keep the FFN's
    `rows[:n]` operands copy-free; row i of every part still holds neuron pointer[i].

    The path from flash to the cache: the I/O engine preads bundles into the backend's page-aligned
    numpy staging buffer (O_DIRECT / F_NOCACHE), `mx.array` copies that block once into an MLX
    buffer (MLX cannot adopt foreign memory), and an indexed update scatters it into the cache rows,
    converting to the compute dtype. On Apple silicon both arrays live in unified memory, so there
    is no host-to-device transfer: the remaining copies are that one memcpy plus the scatter itself.
    Swap-delete is an indexed update too (`part[dst] = part[src]`), done in place by MLX when no
    pending graph still references the array. Bundles quantized in MLX's affine format (quant.py beside this file)
    stay quantized: each part is a QuantArray whose codes, scales and mins are scattered as read,
    and the FFN runs `mx.quantized_matmul` on them.
    """

    def __init__(self, backend, capacity: int, layout, biases: dict):
        self.layout, self.backend = layout, backend
        dt = backend.dtype
        self.quantized = mlx_quantizable(layout)  # rows stay in MLX's affine format (see quant.py beside this file)
        if self.quantized:
            q, d = layout.quant, layout.d_model
            self.parts = {p: QuantArray(mx.zeros((capacity, d * q.bits // 32), dtype=mx.uint32),
                                        mx.zeros((capacity, q.groups(d)), dtype=dt),
                                        mx.zeros((capacity, q.groups(d)), dtype=dt), q.group_size, q.bits)
                          for p in layout.parts}
        else:
            self.parts = {p: mx.zeros((capacity, layout.d_model), dtype=dt) for p in layout.parts}
        self.full_bias = {k: v for k, v in biases.items() if v is not None}
        self.bias = {k: mx.zeros((capacity,), dtype=dt) for k in self.full_bias}
        # numpy view of the staging bytes, and the MLX dtype they are reinterpreted as
        self._np_view, self._mx_view = BYTE_VIEWS[backend.storage_dtype_name]
        self.staging = backend.staging(layout.stride)
        mx.eval(self._arrays())

    def _row_arrays(self) -> list[mx.array]:
        return [a for p in self.parts.values() for a in (p[:3] if self.quantized else (p,))]

    def _arrays(self) -> list[mx.array]:
        return [*self._row_arrays(), *self.bias.values()]

    def nbytes(self) -> int:
        """Bytes of the rows and per-row biases (the shared staging buffer is counted once, elsewhere)."""
        return sum(map(self.backend.nbytes_of, self._arrays()))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        d, s = mx.array(dst.astype(np.int32)), mx.array(src.astype(np.int32))
        arrays = self._arrays()
        # gather first: a pending `a[s]` would keep `a` referenced and make the scatter copy the
        # whole array (measured: 29 ms vs 0.3 ms for 67 rows of a 16384 x 512 array on CPU)
        moved = [a[s] for a in arrays]
        mx.eval(moved)
        for a, m in zip(arrays, moved):
            a[d] = m
        mx.eval(arrays)

    def fill(self, read, ids: np.ndarray, rows: np.ndarray, cost=None):
        """Bundles of neurons `ids` into rows `rows` via `read(ids, dest, dest_rows)`; IOStats (None if no
        ids). Reading is timed as `io_ms`; placing (copy out of staging, cast, scatter) as `mem_ms`."""
        timed = cost.timed if cost is not None else untimed
        io, step = None, self.staging.shape[0]
        for k in range(0, len(ids), step):
            chunk = ids[k:k + step]
            with timed("io_ms"):
                part = read(chunk, self.staging, np.arange(len(chunk)))
            io = part if io is None else io + part
            with timed("mem_ms"):
                self._scatter(self.staging[:len(chunk)], rows[k:k + step])
                mx.async_eval(self._row_arrays())  # scatter this chunk while the next one is read
        with timed("mem_ms"):
            self._set_biases(ids, rows)
        return io

    def _scatter(self, block: np.ndarray, rows: np.ndarray) -> None:
        """Host bundle rows `block` (uint8) into part rows `rows`; mx.array copies at once, so the
        host buffer is free again on return."""
        r, dt = mx.array(rows.astype(np.int32)), self.backend.dtype
        if self.quantized:  # codes, scales and mins as they are: no dequantization
            for p, a in self.parts.items():
                new = quant_rows(block, self.layout, p, dt)
                for dst, src in zip(a[:3], new[:3]):
                    dst[r] = src
            return
        if self.layout.quant:  # a scheme MLX has no kernel for: dequantized on insert (numpy)
            vals = mx.array(self.layout.dequantize(block))
        else:
            vals = mx.array(block[:, :self.layout.bundle_bytes].view(self._np_view))
            if self._mx_view is not None:
                vals = vals.view(self._mx_view)
        for p, a in self.parts.items():
            a[r] = vals[:, self.layout.part_slice(p)].astype(dt)

    def _set_biases(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if len(ids):
            r, i = mx.array(rows.astype(np.int32)), mx.array(ids.astype(np.int32))
            for key, b in self.bias.items():
                b[r] = self.full_bias[key][i]
        mx.eval(self._arrays())

    def place(self, block: np.ndarray, src: np.ndarray, ids: np.ndarray, rows: np.ndarray, cost=None) -> None:
        """Bundles already read into host rows block[src] become rows `rows` (neurons `ids`): the placing
        half of `fill` (for reads that were started earlier), timed as `mem_ms`."""
        if len(ids):
            with (cost.timed if cost is not None else untimed)("mem_ms"):
                self._scatter(block[src], rows)
                self._set_biases(ids, rows)

    def views(self, n: int) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """Per-part [n, d] weight views of rows :n, and per-row biases."""
        return {p: a.rows(slice(None, n)) if self.quantized else a[:n] for p, a in self.parts.items()}, \
            {k: b[:n] for k, b in self.bias.items()}
