"""The expert file of a mixture-of-experts model: one contiguous, 4096-aligned bundle per expert.

An expert bundle holds the expert's gate rows, up rows and down columns as three [d_ffn, d_model]
matrices back to back, so one read brings a whole expert into one cache slot. Quantized models
store each of those d_ffn * 3 rows group-wise quantized along d_model (quant.py's part layout per
row: codes, scales, mins). See docs/format.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    parts: tuple[str, ...] = ("gate", "up", "down")  # each [d_ffn, d_model]; down is W_down transposed
    bundled: bool = True
    quant: QuantScheme | None = None

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row of d_model values (quantized: codes, scales and mins)."""
        return self.quant.part_bytes(self.d_model) if self.quant else self.d_model * self.itemsize

    @property
    def part_bytes(self) -> int:
        return self.d_ffn * self.row_bytes

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

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """A quantized expert bundle (uint8, >= bundle_bytes) -> float32 values [parts * d_ffn * d_model]
        (so `part_slice` indexes the result as it indexes an unquantized bundle's values)."""
        rows = raw[:self.bundle_bytes].reshape(len(self.parts) * self.d_ffn, self.row_bytes)
        return self.quant.dequantize(rows, self.d_model).reshape(-1)

    def segments(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(file base, file stride, bytes per expert, offset in the memory row): one read per expert."""
        return [(self.layer_offsets[layer], self.stride, self.stride, 0)]

    @classmethod
    def plan(cls, spec: ArchSpec, itemsize: int, quant: QuantScheme | None = None) -> "ExpertLayout":
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
            out.update(quantization=self.quant.to_dict(), row_bytes=self.row_bytes, part_bytes=self.part_bytes,
                       part_offsets={p: self.part_range(p).start for p in self.parts},
                       row_layout={k: list(v) for k, v in self.quant.part_layout(self.d_model).items()})
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
