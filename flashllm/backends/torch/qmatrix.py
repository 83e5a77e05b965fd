"""Quantized weights for the native int8-activation kernels (backends/native/kernels_qdot.c): resident matrices
(attention projections, embeddings, the head) and MoE expert slots, both held as flashllm/format/quant.py's rows
(codes, float16 scales and mins per group), which those kernels read as they are. Chosen at load where the
kernels build and the rows fit them (TorchBackend.quantized, expert_slot_bytes); torch's int4/int8 kernels
(quant.py) otherwise."""

from __future__ import annotations

import numpy as np
import torch

from flashllm import hugepages
from flashllm.backends.torch.quant import CHUNK_VALUES, QuantMatrix, dequantize_rows
from flashllm.format.quant import QuantScheme

# resident matrices: int4 min/max groups of 64 (as torch's int4 layout; float16 scale and min), int8 symmetric groups
# of 64 (torch's int8 is one scale per row); groups of 64 are the AVX2 kernels' fast path (kernels_qdot.c)
RESIDENT_SCHEMES = {4: QuantScheme(4, 64, "asymmetric"), 8: QuantScheme(8, 64, "symmetric")}


def fits(scheme: QuantScheme, *dims: int) -> bool:
    """Whether the int8-activation kernels take rows of these lengths in `scheme`'s groups at their full speed."""
    return scheme.bits in (4, 8) and scheme.group_size % 64 == 0 and all(d % scheme.group_size == 0 for d in dims)


class NativeQuantMatrix(QuantMatrix):
    """A resident [out, in] matrix as quantized rows (`raw` uint8 [out, part_bytes]); `linear` is one native call
    for any number of tokens, `rows` dequantizes (embedding lookups)."""

    def __init__(self, w: torch.Tensor | None, bits: int, out_dtype: torch.dtype, kernels, raw: np.ndarray | None = None):
        self.bits, self.out_dtype, self.kernels, self.row_codes = bits, out_dtype, kernels, None
        self.scheme = RESIDENT_SCHEMES[bits]
        if raw is None:
            n, k = w.shape
            raw = _empty(n, self.scheme.part_bytes(k))
            step = max(1, CHUNK_VALUES // max(k, 1))
            for a in range(0, n, step):
                raw[a:a + step] = self.scheme.quantize(w[a:a + step].float().numpy())
            self.shape = (n, k)
        else:
            self.shape = (raw.shape[0], _values(self.scheme, raw.shape[1]))
        self.raw = raw

    @staticmethod
    def takes(w: torch.Tensor, bits: int) -> bool:
        return bits in RESIDENT_SCHEMES and w.dim() == 2 and fits(RESIDENT_SCHEMES[bits], w.shape[1])

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def host_pieces(self) -> tuple[dict, list[np.ndarray]]:
        return {"bits": self.bits, "out_dtype": self.out_dtype, "kernels": self.kernels}, [self.raw]

    @classmethod
    def from_host_pieces(cls, meta: dict, arrays: list[np.ndarray]) -> "NativeQuantMatrix":
        return cls(None, meta["bits"], meta["out_dtype"], meta["kernels"], raw=arrays[0])

    @classmethod
    def concat(cls, parts: list["NativeQuantMatrix"]) -> "NativeQuantMatrix":
        """One matrix of these matrices' rows (fused projections: one call)."""
        raw = _empty(sum(len(p.raw) for p in parts), parts[0].raw.shape[1])
        np.concatenate([p.raw for p in parts], out=raw)
        return cls(None, parts[0].bits, parts[0].out_dtype, parts[0].kernels, raw=raw)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernels.qmatmul(x, self.raw, self.scheme, bias)
        if y is not None:
            return y
        return torch.nn.functional.linear(x, self.rows(torch.arange(self.shape[0])).to(x.dtype), bias)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        raw = self.raw[np.asarray(idx.cpu(), dtype=np.int64)]
        return dequantize_rows(raw, self.scheme, self.shape[1], self.out_dtype, torch.device("cpu"))


def _values(scheme: QuantScheme, part_bytes: int) -> int:
    """The values per row of a part of `part_bytes` bytes."""
    per_group = scheme.part_bytes(scheme.group_size)
    return part_bytes // per_group * scheme.group_size


def _empty(n: int, row_bytes: int) -> np.ndarray:
    """uint8 [n, row_bytes] on huge pages where they are enabled (as resident float weights)."""
    if hugepages.enabled():
        return hugepages.empty(n * row_bytes).reshape(n, row_bytes)
    return np.empty((n, row_bytes), dtype=np.uint8)


class NativeExpert:
    """One expert slot of `NativeExpertSlots` as the FFN rows `TorchBackend.moe_experts` takes."""

    __slots__ = ("slots", "slot")

    def __init__(self, slots: "NativeExpertSlots", slot: int):
        self.slots, self.slot = slots, slot


class NativeExpertSlots:
    """Expert cache slots holding the stored bundles as they are (reads land in them: no insert) for the native
    expert kernel (`NativeKernels.experts`): gate, up rows [d_ffn, d_model] and W_down [d_model, d_ffn], each row
    quantized along its input dimension (flashllm/format/experts.py). Several experts are one kernel call."""

    KIND = "quantized as stored (native int8-activation kernel)"

    @staticmethod
    def fits(layout) -> bool:
        q = layout.quant
        return q is not None and layout.packing is None and fits(q, layout.d_model, layout.d_ffn) \
            and set(layout.parts) <= {"gate", "up", "down"} and "down" in layout.parts and "up" in layout.parts

    def __init__(self, capacity: int, layout, buffer: np.ndarray):
        self.layout, self.buffer = layout, buffer  # uint8 [capacity, stride]
        self.base, self.stride = buffer.ctypes.data, buffer.strides[0]
        # gate (0: none), up, down: byte offsets inside a bundle
        self.offsets = np.array([layout.part_range(p).start if p in layout.parts else -1 for p in ("gate", "up", "down")],
                                dtype=np.int64)
        self.gated = "gate" in layout.parts
        self.ld_in, self.ld_down = layout.row_bytes("up"), layout.row_bytes("down")
        self.views = [NativeExpert(self, s) for s in range(capacity)]

    def nbytes(self) -> int:
        return self.buffer.nbytes

    def rows(self, slot: int) -> NativeExpert:
        return self.views[slot]

    def addresses(self, slots: np.ndarray) -> np.ndarray:
        """[n, 3] int64: gate (0 when not gated), up and down addresses of the experts in `slots`."""
        out = self.base + slots[:, None] * self.stride + self.offsets[None, :]
        if not self.gated:
            out[:, 0] = 0
        return out

    def dequantized(self, slot: int, dtype: torch.dtype) -> dict:
        """The slot's expert as rows of `dtype` (for the torch path: several experts of other slots)."""
        lay = self.layout
        values = lay.dequantize(self.buffer[slot]).reshape(len(lay.parts), lay.d_ffn, lay.d_model)
        return {p: torch.from_numpy(values[k]).to(dtype) for k, p in enumerate(lay.parts)}

