"""The expert file of a mixture-of-experts model: one contiguous, 4096-aligned bundle per expert.

An expert bundle holds the expert's three matrices back to back, so one read brings a whole expert
into one cache slot: gate and up rows [d_ffn, d_model], and the down projection, transposed
([d_ffn, d_model]) in a float model or as it is ([d_model, d_ffn]) in a quantized one. Quantized
parts are group-wise quantized along each row (quant.py's part layout per row: codes, scales, mins),
so every part has its groups along its matmul's input dimension, the layout of weight-only int4
kernels (torch's, MLX's quantized_matmul). See docs/format.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FlashLLMError
from .quant import QuantScheme
from .spec import ArchSpec

EXPERTS_FILE = "experts.bin"
EXPERT_ALIGN = 4096


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class ExpertLayout:
    """Where expert e of layer l lives in the expert file: layer_offsets[l] + e * stride."""

    d_model: int
    d_ffn: int  # neurons per expert
    n_experts: int
    itemsize: int
    stride: int  # bytes from one expert bundle to the next (a multiple of 4096)
    layer_offsets: tuple[int, ...]
    parts: tuple[str, ...] = ("gate", "up", "down")  # see part_shape
    bundled: bool = True
    quant: QuantScheme | None = None
    file_parts: tuple[str, ...] | None = None  # as FFNLayout's: an expert is always read whole

    def part_shape(self, part: str) -> tuple[int, int]:
        """(rows, values per row) of one stored part: [d_ffn, d_model], except a quantized down
        projection, stored as W_down [d_model, d_ffn] (groups along d_ffn, its input dimension)."""
        return (self.d_model, self.d_ffn) if part == "down" and self.quant else (self.d_ffn, self.d_model)

    def row_bytes(self, part: str) -> int:
        """Bytes of one stored row of a part (quantized: codes, scales and mins)."""
        n = self.part_shape(part)[1]
        return self.quant.part_bytes(n) if self.quant else n * self.itemsize

    @property
    def part_bytes(self) -> int:
        """Bytes of one part; the same for every part (a quantized layout's group divides both dims)."""
        rows, _ = self.part_shape(self.parts[0])
        return rows * self.row_bytes(self.parts[0])

    @property
    def bundle_bytes(self) -> int:
        return len(self.parts) * self.part_bytes

    @property
    def layer_bytes(self) -> int:
        return self.n_experts * self.stride

    @property
    def file_size(self) -> int:
        return self.layer_offsets[-1] + self.layer_bytes if self.layer_offsets else 0

    def part_slice(self, part: str) -> slice:
        """Element range of one part ([d_ffn, d_model] row-major) inside an expert bundle's values."""
        k, n = self.parts.index(part), self.d_ffn * self.d_model
        return slice(k * n, (k + 1) * n)

    def part_range(self, part: str) -> slice:
        """Byte range of one part inside a stored expert bundle."""
        k = self.parts.index(part)
        return slice(k * self.part_bytes, (k + 1) * self.part_bytes)

    def part_raw(self, raw: np.ndarray, part: str) -> np.ndarray:
        """One stored part of a bundle (uint8, >= bundle_bytes) as [rows, row_bytes]."""
        return raw[self.part_range(part)].reshape(self.part_shape(part)[0], self.row_bytes(part))

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """A quantized expert bundle (uint8, >= bundle_bytes) -> float32 values [parts * d_ffn * d_model],
        every part [d_ffn, d_model] (down transposed back), so `part_slice` indexes the result as it
        indexes an unquantized bundle's values."""
        out = np.empty((len(self.parts), self.d_ffn, self.d_model), dtype=np.float32)
        for k, part in enumerate(self.parts):
            values = self.quant.dequantize(self.part_raw(raw, part), self.part_shape(part)[1])
            out[k] = values.T if part == "down" else values
        return out.reshape(-1)

    def segments(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(file base, file stride, bytes per expert, offset in the memory row): one read per expert."""
        return [(self.layer_offsets[layer], self.stride, self.stride, 0)]

    @classmethod
    def plan(cls, spec: ArchSpec, itemsize: int, quant: QuantScheme | None = None) -> "ExpertLayout":
        if quant and spec.d_ffn % quant.group_size:
            raise FlashLLMError(f"group size {quant.group_size}: does not divide the experts' d_ffn {spec.d_ffn} "
                                "(quantized down projections are grouped along d_ffn)")
        probe = cls(spec.d_model, spec.d_ffn, spec.n_experts, itemsize, 0, (), quant=quant)
        stride = _round_up(probe.bundle_bytes, EXPERT_ALIGN)
        return cls(spec.d_model, spec.d_ffn, spec.n_experts, itemsize, stride,
                   tuple(i * spec.n_experts * stride for i in range(spec.n_layers)), quant=quant)

    def to_dict(self) -> dict:
        out = {"unit": "expert", "parts": list(self.parts), "n_experts": self.n_experts,
               "expert_neurons": self.d_ffn, "bundle_bytes": self.bundle_bytes, "bundle_stride": self.stride,
               "layer_offsets": list(self.layer_offsets), "layer_bytes": self.layer_bytes,
               "layer_alignment": EXPERT_ALIGN, "bundled": True}
        if self.quant:
            out.update(quantization=self.quant.to_dict(), part_bytes=self.part_bytes,
                       part_shapes={p: list(self.part_shape(p)) for p in self.parts},
                       row_bytes={p: self.row_bytes(p) for p in self.parts},
                       part_offsets={p: self.part_range(p).start for p in self.parts},
                       row_layout={p: {k: list(v) for k, v in self.quant.part_layout(self.part_shape(p)[1]).items()}
                                   for p in self.parts})
        return out


def expert_resident_shapes(spec: ArchSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """The resident tensors of one MoE layer: the router and the shared expert (if any)."""
    p, d, ds = f"layers.{layer}.", spec.d_model, spec.d_shared_expert
    shapes = {p + "router.weight": (spec.n_experts, d)}
    if ds:
        shapes.update({p + "shared_gate.weight": (ds, d), p + "shared_up.weight": (ds, d),
                       p + "shared_down.weight": (d, ds)})
    if spec.shared_expert_gate:
        shapes[p + "shared_expert_gate.weight"] = (1, d)
    return shapes
