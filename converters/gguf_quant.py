"""GGUF weight blocks -> flashllm's stored FFN parts: exactly where the block is one of flashllm's groups, else
dequantized (gguf's numpy dequantizers) and stored as float or quantized again, the rounding measured.

A Q4_0 block (float16 d, 32 four-bit codes, w = (c - 8) d) is a symmetric int4 group of 32 with scale d, a
Q4_1 block (d, m, w = c d + m) an asymmetric int4 group, a Q8_0 block (d, 32 int8 codes, w = c d) a
symmetric int8 group (flashllm/format/quant.py): only the nibble order is rearranged, no value changes.
Blocks run along a weight's input dimension, so they are flashllm's groups for up/gate rows and an expert's
down projection, but not for a dense FFN's down columns (GGUF's groups there span 32 neurons).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashllm.format.quant import QuantScheme
from flashllm.format.safetensors_io import storage_bytes

FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
GROUP = 32  # values per Q4_0 / Q4_1 / Q8_0 block
NATIVE = {"Q4_0": ("int4", "symmetric"), "Q4_1": ("int4", "asymmetric"), "Q8_0": ("int8", "symmetric")}


def native_scheme(qtype: str) -> QuantScheme | None:
    """The flashllm group scheme a GGUF block type is exactly, or None."""
    if qtype not in NATIVE:
        return None
    name, scheme = NATIVE[qtype]
    return QuantScheme.named(name, GROUP, scheme)


def maps_exactly(qtype: str, quant: QuantScheme | None) -> bool:
    """Whether `qtype` blocks are groups of `quant` as they are: its own scheme, or Q4_0 as int8 (codes -8..7)."""
    return quant is not None and (native_scheme(qtype) == quant or
                                  (qtype == "Q4_0" and quant == QuantScheme.named("int8", GROUP, "symmetric")))


class GGUFRows:
    """A stored (quantized) GGUF weight, lazily: [..., n, d] values whose blocks run along d; `.T` marks a
    transposed 2-D view (its blocks then run across rows). Indexing leading dimensions reads nothing."""

    def __init__(self, raw: np.ndarray, qtype: str, shape: tuple[int, ...], cost: "ConversionCost",
                 transposed: bool = False, release=None):
        self.raw, self.qtype, self._shape, self.cost, self.transposed = raw, qtype, tuple(shape), cost, transposed
        self.release = release or (lambda raw: None)  # lets the file's pages of `raw` go once encoded

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape[::-1] if self.transposed else self._shape

    @property
    def T(self) -> "GGUFRows":
        assert len(self._shape) == 2, "only a 2-D weight is transposed"
        return GGUFRows(self.raw, self.qtype, self._shape, self.cost, not self.transposed, self.release)

    def __getitem__(self, index: int | slice) -> "GGUFRows":
        """One entry (an expert) or a range of rows (Phi-3's fused gate and up) of the first dimension."""
        assert isinstance(index, (int, np.integer, slice)) and not self.transposed, "only the first dimension is indexed"
        if isinstance(index, slice):
            rows = len(range(*index.indices(self._shape[0])))
            return GGUFRows(self.raw[index], self.qtype, (rows, *self._shape[1:]), self.cost, release=self.release)
        return GGUFRows(self.raw[index], self.qtype, self._shape[1:], self.cost, release=self.release)

    def values(self) -> np.ndarray:
        """float32 values (gguf's own dequantizer), transposed when marked so."""
        import gguf

        w = np.asarray(gguf.quants.dequantize(np.asarray(self.raw), gguf.GGMLQuantizationType[self.qtype]),
                       dtype=np.float32).reshape(self._shape)
        return w.T if self.transposed else w

    def encode(self, quant: QuantScheme | None, dtype: str) -> np.ndarray:
        """The [n, part bytes] uint8 parts flashllm stores for these rows: quantized with `quant`, else `dtype`."""
        try:
            return self._encode(quant, dtype)
        finally:
            self.release(self.raw)

    def _encode(self, quant: QuantScheme | None, dtype: str) -> np.ndarray:
        if not self.transposed and maps_exactly(self.qtype, quant):
            self.cost.exact(self.qtype, int(np.prod(self._shape)))
            return blocks_to_parts(np.asarray(self.raw), self.qtype, self._shape[-1], quant.bits)
        w = self.values()
        if quant is not None:
            stored = quant.quantize(w)
            self.cost.rounded(self.qtype, f"int{quant.bits}", w, quant.dequantize(stored, w.shape[1]))
            return stored
        self.cost.rounded(self.qtype, dtype, w, lambda chunk: as_stored(chunk, dtype))
        return storage_bytes(w, dtype)


def blocks_to_parts(raw: np.ndarray, qtype: str, d: int, bits: int) -> np.ndarray:
    """[n, d / 32 blocks] GGUF Q4_0 / Q4_1 / Q8_0 rows -> [n, part bytes] flashllm parts of the same values
    (`bits` 8 for Q4_0: int8 codes c - 8)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, d // GROUP, -1)
    scales = np.ascontiguousarray(blocks[..., 0:2]).reshape(n, -1)
    if qtype == "Q8_0":
        return np.concatenate([np.ascontiguousarray(blocks[..., 2:]).reshape(n, d), scales], axis=1)
    first = 4 if qtype == "Q4_1" else 2
    qs = blocks[..., first:first + GROUP // 2]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, d)  # block value j, then j + 16
    if bits == 8:  # Q4_0 as int8: two's complement codes c - 8, the same scale
        return np.concatenate([(codes.astype(np.int8) - 8).view(np.uint8), scales], axis=1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # flashllm: value 2j low nibble, 2j + 1 high
    pieces = [packed, scales]
    if qtype == "Q4_1":
        pieces.append(np.ascontiguousarray(blocks[..., 2:4]).reshape(n, -1))
    return np.concatenate(pieces, axis=1)


def as_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` rounded to `dtype` as storage_bytes rounds them, back as float32."""
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    raw = storage_bytes(values, dtype)
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(values.shape)
    return raw.view(np.float16).astype(np.float32).reshape(values.shape)


@dataclass
class ConversionCost:
    """What converting changed: values kept exactly, and per (GGUF type -> stored as) the rounding error."""

    store_dtype: str = "float16"  # what resident tensors are stored as
    exact_values: dict[str, int] = field(default_factory=dict)
    errors: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # (what, from, to) -> [sum err^2,
    # sum w^2, count]; what: "ffn" (the streamed weights) or "resident"

    def exact(self, qtype: str, count: int) -> None:
        self.exact_values[qtype] = self.exact_values.get(qtype, 0) + count

    def rounded(self, qtype: str, stored_as: str, values: np.ndarray, stored, what: str = "ffn") -> None:
        """Account `values` (from `qtype`) stored as `stored_as`: `stored` is what they became (an array of the
        same shape, or a function of a chunk of values); summed in chunks, so no tensor-sized temporaries."""
        acc = self.errors.setdefault((what, qtype, stored_as), [0.0, 0.0, 0])
        flat = np.ascontiguousarray(values).reshape(-1)
        kept = None if callable(stored) else np.ascontiguousarray(stored).reshape(-1)
        for i in range(0, flat.size, 1 << 20):  # float32 dot products (BLAS): a few digits are all a cost needs
            v = np.asarray(flat[i:i + (1 << 20)], dtype=np.float32)
            err = np.asarray(stored(v) if kept is None else kept[i:i + (1 << 20)], dtype=np.float32) - v
            acc[0] += float(np.dot(err, err))
            acc[1] += float(np.dot(v, v))
        acc[2] += int(flat.size)

    def dequantized(self, qtype: str, values: np.ndarray) -> None:
        """A resident tensor dequantized from `qtype`, to be stored as `store_dtype`."""
        self.rounded(qtype, self.store_dtype, values, lambda chunk: as_stored(chunk, self.store_dtype), "resident")

    def to_dict(self) -> dict:
        return {"exact": dict(self.exact_values),
                "rounded": [{"tensors": what, "from": q, "to": to, "values": int(n), "relative_rms_error": _rel(e, w)}
                            for (what, q, to), (e, w, n) in sorted(self.errors.items())]}


def _rel(err: float, ref: float) -> float:
    return float(np.sqrt(err / ref)) if ref else 0.0
