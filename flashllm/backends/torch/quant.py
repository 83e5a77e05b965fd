"""Quantized resident matrices and an int8 KV cache on torch (CPU), in the formats of torch's kernels.

Resident matrices ([out, in]: attention projections, embeddings, lm_head) use torch's weight-only
CPU kernels, chosen by measurement (docs/architecture.md, "Defaults"): they beat dequantizing per
call, and they are fastest with bfloat16 activations, so x is cast to bfloat16 for them.
- int8: per output row symmetric codes (`torch._weight_int8pack_mm`, as gpt-fast's int8);
- int4: groups of 64 (32 where 64 does not divide `in`) along `in`, min/max codes 0..15 with
  w = (q - 8) * scale + zero (`torch._weight_int4pack_mm_for_cpu`); rows padded to a multiple of 16.
The KV cache in int8 keeps, per token and kv head, groups of up to 64 values along the head dim
with their own float32 scale and minimum (FlexGen's grouping), dequantized when attention reads them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashllm.errors import FlashLLMError
from flashllm.format.experts import PACKING_BLOCKS, pack_nibbles, packing_name

KERNEL_DTYPE = torch.bfloat16  # activations and scales of the CPU kernels (float32/float16 paths are 3-6x slower)
INT4_GROUPS = (64, 32, 128, 256)  # group sizes the int4 kernel takes, in order of preference
KV_GROUP = 64


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 values >= x (float32): a scale rounded up, so that no code clips."""
    b = x.to(KERNEL_DTYPE)
    return torch.where(b.float() < x, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


def _minmax_codes(w: torch.Tensor, group: int, levels: int):
    """Asymmetric group codes of float [n, k] rows: (codes uint8 [n, k], scale [n, G], min [n, G]) float32."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(2), g.amax(2)
    scale = (hi - lo) / levels
    codes = torch.round((g - lo[..., None]) / torch.where(scale == 0, 1, scale)[..., None]).clamp_(0, levels)
    return codes.to(torch.uint8).reshape(n, k), scale, lo


CHUNK_VALUES = 1 << 20  # weights quantized at a time (4 MiB per float32 temporary)
DEQUANT_VALUES = 1 << 18  # weights dequantized at a time (1 MiB per float32 temporary)


def _int8_codes(w: torch.Tensor):
    """Per-row symmetric int8 codes of float rows [n, k] and their bfloat16 scales: |w - q s| <= s / 2."""
    wf = w.float()
    scales = _bf16_up(wf.abs().amax(1) / 127)
    s = scales.float()
    return torch.round(wf / torch.where(s == 0, 1, s)[:, None]).clamp_(-127, 127).to(torch.int8), scales


def _int4_codes(w: torch.Tensor, group: int):
    """int4 codes 0..15 (uint8 [n, k]) of float rows [n, k] and the kernel's bfloat16 (scale, zero)
    [G, n, 2], with w ≈ (q - 8) * scale + zero per group."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(2)
    scale = _bf16_up((g.amax(2) - lo) / 15).float()
    zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
    codes = torch.round((g - (zero - 8 * scale)[..., None]) / torch.where(scale == 0, 1, scale)[..., None])
    return codes.clamp_(0, 15).to(torch.uint8).reshape(n, k), torch.stack((scale, zero), 2).transpose(0, 1)


def dequantize_rows(raw: np.ndarray, scheme, d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Quantized parts (uint8 [n, >= part_bytes], flashllm/format/quant.py's layout) as a [n, d] tensor of `dtype` on `device`,
    dequantized DEQUANT_VALUES values at a time into the preallocated result: the float32 temporaries stay
    a few MiB whatever n is (dequantizing a whole layer at once took 2-4x the rows' size on top)."""
    out = torch.empty(len(raw), d, dtype=dtype, device=device)
    step = max(1, DEQUANT_VALUES // d)
    for a in range(0, len(raw), step):
        out[a:a + step].copy_(torch.from_numpy(scheme.dequantize(raw[a:a + step], d)))
    return out


class QuantRows:
    """Rows of one quantized FFN part kept as stored (flashllm/format/quant.py's layout), for the native kernels (which dequantize
    in registers): part r is `d` values at bytes offset.. of row r of `raw` (uint8 [n, row bytes], e.g. a neuron
    cache's rows read in place). `values` dequantizes rows for torch's path (several tokens, no kernels)."""

    def __init__(self, raw: np.ndarray, offset: int, scheme, d: int):
        self.raw, self.offset, self.scheme, self.d = raw, offset, scheme, d
        self.shape = (raw.shape[0], d)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> "QuantRows":
        return QuantRows(self.raw[rows], self.offset, self.scheme, self.d)

    def same_rows(self, other: "QuantRows") -> bool:
        """Whether both are parts of the same rows (one row stride, one scheme): what one kernel call takes."""
        a, b = self.raw, other.raw
        return a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.strides == b.strides \
            and self.scheme == other.scheme and self.d == other.d

    def ptr(self) -> int:
        return self.raw.ctypes.data + self.offset

    @property
    def nbytes(self) -> int:
        return len(self) * self.scheme.part_bytes(self.d)

    def values(self, dtype: torch.dtype, index: np.ndarray | None = None) -> torch.Tensor:
        """The rows (or rows `index`) dequantized, [n, d] of `dtype`."""
        raw = self.raw if index is None else self.raw[np.asarray(index, dtype=np.int64)]
        part = raw[:, self.offset:self.offset + self.scheme.part_bytes(self.d)]
        return dequantize_rows(part, self.scheme, self.d, dtype, torch.device("cpu"))


class QuantMatrix:
    """A resident [out, in] matrix held as int8 or int4 codes; `linear` multiplies, `rows` gathers.

    `w` may be in any float dtype (e.g. the stored float16 values as read): it is quantized in blocks
    of about CHUNK_VALUES values written into the preallocated codes, so the float32 temporaries
    stay small (and the same size, so the allocator reuses them) whatever the matrix's size."""

    def __init__(self, w: torch.Tensor, bits: int, out_dtype: torch.dtype, gather: bool = False):
        if w.device.type != "cpu":
            raise FlashLLMError("--quantize-resident runs on the CPU (torch's weight-only CPU kernels); "
                                "on CUDA use --quantize-resident none")
        self.bits, self.out_dtype, self.shape = bits, out_dtype, tuple(w.shape)
        n, k = w.shape
        self.row_codes = None
        # rows per block: a multiple of 64 (the int4 packing works in blocks of 32 rows)
        step = max(64, CHUNK_VALUES // max(k, 1) // 64 * 64)
        if bits == 8:
            self.codes, self.scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=KERNEL_DTYPE)
            for a in range(0, n, step):
                self.codes[a:a + step], self.scales[a:a + step] = _int8_codes(w[a:a + step])
            return
        group = next((g for g in INT4_GROUPS if k % g == 0), None)
        if group is None:
            raise FlashLLMError(f"--quantize-resident int4: a {n}x{k} matrix has no group size in {INT4_GROUPS} "
                                f"dividing {k}; use int8")
        self.group, rows = group, n + -n % 16  # the kernel takes rows in multiples of 16: zero rows pad
        self.codes = torch.empty(rows, k // 2, dtype=torch.uint8)
        self.scales = torch.zeros(k // group, rows, 2, dtype=KERNEL_DTYPE)  # [G, rows, (scale, zero)]
        if gather:  # the packed kernel layout cannot be gathered by row: keep the nibbles too
            self.row_codes = torch.empty(n, k // 2, dtype=torch.uint8)
        for a in range(0, rows, step):
            codes, sz = _int4_codes(w[a:a + step], group)
            m = len(codes)
            self.scales[:, a:a + m] = sz
            if gather:
                self.row_codes[a:a + m] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            codes = F.pad(codes, (0, 0, 0, min(step, rows - a) - m))  # the last block's padding rows
            self.codes[a:a + len(codes)] = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)

    @classmethod
    def int4_packed(cls, codes: torch.Tensor, scales: torch.Tensor, group: int, shape: tuple[int, int],
                    out_dtype: torch.dtype) -> "QuantMatrix":
        """An int4 [out, in] matrix whose codes and [G, out, 2] scales are already in the kernel's layout
        (e.g. views of an expert cache slot)."""
        m = cls.__new__(cls)
        m.bits, m.out_dtype, m.shape, m.row_codes = 4, out_dtype, tuple(shape), None
        m.codes, m.scales, m.group = codes, scales, group
        return m

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.row_codes) if t is not None)

    def host_pieces(self) -> tuple[dict, list[np.ndarray]]:
        """(what `from_host_pieces` needs beside the arrays, the codes and scales as numpy arrays): to
        keep the matrix on flash (flashllm/modes/quant_layers.py); bfloat16 scales travel as int16 bits."""
        meta = {"bits": self.bits, "out_dtype": self.out_dtype, "shape": self.shape, "group": getattr(self, "group", 0)}
        return meta, [self.codes.numpy(), self.scales.view(torch.int16).numpy()]

    @classmethod
    def from_host_pieces(cls, meta: dict, arrays: list[np.ndarray]) -> "QuantMatrix":
        """The matrix `host_pieces` gave, over `arrays` (e.g. views of a read buffer: not copied)."""
        codes, scales = torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]).view(KERNEL_DTYPE)
        if meta["bits"] == 4:
            return cls.int4_packed(codes, scales, meta["group"], meta["shape"], meta["out_dtype"])
        m = cls.__new__(cls)
        m.bits, m.out_dtype, m.shape, m.row_codes, m.codes, m.scales = 8, meta["out_dtype"], meta["shape"], None, \
            codes, scales
        return m

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, xk = x.shape[:-1], x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)
        if self.bits == 8:
            y = torch._weight_int8pack_mm(xk, self.codes, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xk, self.codes, self.group, self.scales)[:, :self.shape[0]]
        y = y.to(self.out_dtype).reshape(*lead, self.shape[0])
        return y + bias if bias is not None else y

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `idx` (embedding lookups)."""
        if self.bits == 8:
            return (self.codes[idx].float() * self.scales[idx].float()[:, None]).to(self.out_dtype)
        c = self.row_codes[idx]
        codes = torch.stack((c & 15, c >> 4), 2).reshape(len(idx), -1, self.group).float()
        sz = self.scales[:, idx].float()  # [G, len(idx), 2]
        s, z = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        return ((codes - 8) * s + z).reshape(len(idx), -1).to(self.out_dtype)


class KVCache:
    """The static K and V cache of every layer, in the compute dtype or int8 groups along the head dim.

    16-bit caches are head-major, K and V as [layers, kv heads, context, head dim]: a decode token's scores
    (q . keys) and output (weights . values) are then batched matrix-vector products over contiguous rows of each
    head, written in place (faster than torch's CPU SDPA for one query), and a short window's keys and values are
    a few cache lines per head (V as [head dim, context] would make them one line per value).
    """

    def __init__(self, spec, context: int, dtype: torch.dtype, device, bits: int = 16):
        self.bits, self.dtype, self.context = bits, dtype, context
        if bits == 16:
            self.k = torch.zeros((spec.n_layers, spec.n_kv_heads, context, spec.head_dim), dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
            # each layer's K and V addresses, for native calls that take them without indexing a view per call
            self.layer_ptrs = [(self.k[i].data_ptr(), self.v[i].data_ptr()) for i in range(spec.n_layers)]
            return
        shape = (spec.n_layers, context, spec.n_kv_heads, spec.head_dim)
        hd = spec.head_dim
        self.group = KV_GROUP if hd % KV_GROUP == 0 else hd
        self.k, self.v = (torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2))
        gshape = (*shape[:3], hd // self.group, 2)  # (scale, min) per group
        self.k_sm, self.v_sm = (torch.zeros(gshape, dtype=torch.float32, device=device) for _ in range(2))

    def nbytes(self) -> int:
        held = [self.k, self.v] + ([self.k_sm, self.v_sm] if self.bits == 8 else [])
        return sum(t.numel() * t.element_size() for t in held)

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, lo: int):
        """Store k, v ([T, kv heads, head dim]) at pos..; return the keys and values [kv heads, S, head dim] of
        positions lo..pos+T (S of them)."""
        end = pos + k.shape[0]
        if self.bits == 16:
            self.k[layer, :, pos:end], self.v[layer, :, pos:end] = k.transpose(0, 1), v.transpose(0, 1)
            return self.k[layer, :, lo:end], self.v[layer, :, lo:end]
        for new, codes, sm in ((k, self.k, self.k_sm), (v, self.v, self.v_sm)):
            T, h, d = new.shape
            c, s, m = _minmax_codes(new.reshape(T * h, d), self.group, 255)
            codes[layer, pos:end] = c.reshape(T, h, d)
            sm[layer, pos:end] = torch.stack((s, m), 2).reshape(T, h, -1, 2)
        keys, vals = (self._values(c, sm, layer, lo, end) for c, sm in ((self.k, self.k_sm), (self.v, self.v_sm)))
        return keys.transpose(0, 1), vals.transpose(0, 1)

    def _values(self, codes, sm, layer: int, lo: int, end: int) -> torch.Tensor:
        c, s = codes[layer, lo:end], sm[layer, lo:end]
        g = c.reshape(*c.shape[:2], -1, self.group).float() * s[..., :1] + s[..., 1:]
        return g.reshape(c.shape).to(self.dtype)


_PACK_BLOCK: list = []  # the int4 kernel's block of output rows on this CPU (0: pack with torch's converter)


def _pack_block() -> int:
    """The block of N that torch's CPU int4 layout interleaves on this CPU (expert_format.pack_nibbles),
    found by comparing with torch's own converter on random codes; 0 when no block matches (then the
    converter packs)."""
    if not _PACK_BLOCK:
        codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        want = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).numpy()
        found = 0
        for block in PACKING_BLOCKS:
            got = np.zeros((128, 32), dtype=np.uint8)
            pack_nibbles(stored, got, block)
            if torch.equal(torch.from_numpy(got), want):
                found = block
                break
        _PACK_BLOCK.append(found)
    return _PACK_BLOCK[0]


def int4_packing() -> str | None:
    """The name of this torch build's CPU int4 kernel layout on this CPU (expert_format's packing), or None
    when it is not one flashllm knows."""
    return packing_name(_pack_block()) if _pack_block() else None


def pack_int4(stored: list[np.ndarray], out: torch.Tensor) -> None:
    """int4 codes packed along K as stored (uint8 [n_i, K / 2] blocks of rows, stacked along N) into
    `out` (a contiguous uint8 [N, K / 2] tensor) in torch's CPU int4 kernel layout: a permutation of
    nibbles where that layout is known (`_pack_block`) and each block of rows is whole blocks of it,
    else through torch's converter."""
    block = _pack_block()
    if block and all(len(rows) % block == 0 for rows in stored):
        dst, start = out.numpy(), 0
        for rows in stored:
            pack_nibbles(rows, dst[start:start + len(rows)], block)
            start += len(rows)
        return
    codes = np.concatenate([np.stack((rows & 15, rows >> 4), 2).reshape(len(rows), -1) for rows in stored])
    out.copy_(torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes).to(torch.int32), 1))


class Int4ExpertSlots:
    """Preallocated expert cache slots that keep int4 experts quantized, in the layout of torch's CPU
    weight-only int4 kernel: one page-aligned uint8 buffer [capacity, slot_bytes], each slot an expert
    bundle packed as `ExpertLayout.packed_pieces` says (up and gate rows as one [2 d_ffn, d_model]
    matrix, W_down [d_model, d_ffn]; codes plus bfloat16 (scale, zero) [groups, rows, 2]). Experts
    stored packed for this CPU's layout (`convert --expert-layout torch-cpu`) are read straight into
    their slots (`reads_in_place`: no insert at all); any other stored bundle is repacked when it is
    inserted (a nibble permutation; scales to bfloat16, zero = min + 8 * scale). Each use is two kernel
    calls with bfloat16 activations (`QuantMatrix.linear`), instead of dequantizing 3 * d_ffn * d_model
    values. The bfloat16 rounding of scales, zeros and activations is a quality cost (docs/quantization.md;
    the "plain" kernels dequantize instead)."""

    @staticmethod
    def fits(layout) -> bool:
        q = layout.quant
        return q is not None and q.bits == 4 and q.group_size in INT4_GROUPS and layout.d_model % 16 == 0 \
            and layout.d_ffn % 16 == 0  # the kernel's rows come in blocks of 16

    @classmethod
    def slot_bytes(cls, layout) -> int:
        """A packed bundle; a whole stride where reads land in the slots. Symmetric groups (a GGUF Q4_0 file's)
        store no mins, so their packed (scale, zero) pairs take more than the stored bundle."""
        if cls.reads_in_place(layout):
            return layout.stride
        at, shape = layout.packed_pieces()["down_sz"]
        return max(layout.bundle_bytes, at + 2 * int(np.prod(shape)))

    @staticmethod
    def reads_in_place(layout) -> bool:
        """Whether the stored bundles are packed in this CPU's layout (reads need no insert)."""
        return layout.packing is not None and layout.packing == int4_packing()

    def __init__(self, capacity: int, layout, out_dtype: torch.dtype, buffer: np.ndarray):
        self.layout, self.out_dtype, self.buffer = layout, out_dtype, buffer  # uint8 [capacity, slot_bytes]
        self.block = _pack_block()
        self.KIND = f"int4 kernel layout ({'read in place' if self.reads_in_place(layout) else 'repacked on insert'})"
        d, f, g = layout.d_model, layout.d_ffn, layout.quant.group_size
        self.views = []
        for row in buffer:
            piece = {k: self._piece(row, k) for k in layout.packed_pieces()}
            self.views.append({"up_gate": QuantMatrix.int4_packed(piece["up_gate"], piece["up_gate_sz"], g, (2 * f, d), out_dtype),
                               "down_t": QuantMatrix.int4_packed(piece["down"], piece["down_sz"], g, (d, f), out_dtype)})

    def _piece(self, row: np.ndarray, name: str) -> torch.Tensor:
        piece = torch.from_numpy(self.layout.packed(row, name))
        return piece.view(KERNEL_DTYPE) if name.endswith("_sz") else piece

    def nbytes(self) -> int:
        return self.buffer.nbytes

    def rows(self, slot: int) -> dict:
        """The slot's matrices as the packed FFN rows `TorchBackend.ffn` takes."""
        return self.views[slot]

    def insert(self, slot: int, raw: np.ndarray) -> None:
        """One stored expert bundle (uint8, >= bundle_bytes) into `slot`, repacked for this CPU."""
        lay, row = self.layout, self.buffer[slot]
        if self.block and lay.d_model % self.block == 0 and 2 * lay.d_ffn % self.block == 0:
            lay.pack(raw, row, self.block)
            return
        lay.pack(raw, row, 16)  # the scales and zeros; the codes again through torch's converter (fits: rows % 16 == 0)
        for name in ("up_gate", "down"):
            c = lay.stored_codes(raw, name)
            codes = torch.from_numpy(np.stack((c & 15, c >> 4), 2).reshape(len(c), -1)).to(torch.int32)
            self._piece(row, name).copy_(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
