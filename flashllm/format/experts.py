"""The expert file of a mixture-of-experts model: one contiguous, 4096-aligned bundle per expert.

An expert bundle holds the expert's three matrices back to back, so one read brings a whole expert
into one cache slot: gate and up rows [d_ffn, d_model], and the down projection, transposed
([d_ffn, d_model]) in a float model or as it is ([d_model, d_ffn]) in a quantized one. Quantized
parts are group-wise quantized along each row (flashllm/format/quant.py's part layout per row: codes, scales, mins),
so every part has its groups along its matmul's input dimension, the layout of weight-only int4
kernels (torch's, MLX's quantized_matmul). int4 experts may instead be stored *packed* in torch's
CPU int4 kernel layout (`packing`, named in the manifest), so that reads land in cache slots with no
repack; readers with another layout unpack them (`unpack_nibbles`). See docs/format.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashllm.errors import FlashLLMError, OptionsError
from flashllm.format.quant import QuantScheme, divisor_near
from flashllm.format.spec import ArchSpec

EXPERTS_FILE = "experts.bin"
EXPERT_ALIGN = 4096
PACKING_PREFIX = "torch_cpu_int4_n"  # + the block of rows torch's CPU int4 layout interleaves
PACKING_BLOCKS = (64, 32)  # torch's weight_to_int4pack_kernel: 64 with AVX-512, 32 with AVX2


def packing_name(block: int) -> str:
    """The manifest's name of torch's CPU int4 kernel layout for a block of `block` output rows."""
    return f"{PACKING_PREFIX}{block}"


def packing_block(name: str) -> int:
    """The block of a packing name; a clear error for a name this reader does not know."""
    if isinstance(name, str) and name.startswith(PACKING_PREFIX) and name[len(PACKING_PREFIX):].isdigit() \
            and int(name[len(PACKING_PREFIX):]) in PACKING_BLOCKS:
        return int(name[len(PACKING_PREFIX):])
    raise FlashLLMError(f"expert packing {name!r} is not known to this flashllm (it reads "
                        f"{', '.join(packing_name(b) for b in PACKING_BLOCKS)})")


def pack_nibbles(stored: np.ndarray, out: np.ndarray, block: int) -> None:
    """int4 codes packed along K as flashllm/format/quant.py stores them (value 2j in the low nibble, 2j+1 in the high;
    uint8 [N, K / 2], rows may be strided) -> `out` (uint8 [N, K / 2]) in torch's CPU int4 layout for
    `block`: [N / block, K, block / 2] nibbles, rows n and n + block/2 of a block in one byte's low and
    high nibble."""
    N, half = stored.shape
    b = stored.reshape(N // block, 2, block // 2, half)
    first, second = b[:, 0], b[:, 1]  # rows n and n + block/2 of each block: [blocks, block/2, K/2]
    o = out.reshape(N // block, half, 2, block // 2)  # [blocks, K/2, even/odd k, block/2]
    np.bitwise_or(first & 15, second << 4, out=o[:, :, 0, :].transpose(0, 2, 1))
    np.bitwise_or(first >> 4, second & 0xF0, out=o[:, :, 1, :].transpose(0, 2, 1))


def unpack_nibbles(packed: np.ndarray, block: int) -> np.ndarray:
    """The inverse of `pack_nibbles`: torch's CPU int4 layout (uint8 [N, K / 2]) -> codes as stored."""
    N, half = packed.shape
    o = packed.reshape(N // block, half, 2, block // 2)
    even, odd = o[:, :, 0, :].transpose(0, 2, 1), o[:, :, 1, :].transpose(0, 2, 1)  # [blocks, block/2, K/2]
    out = np.empty((N // block, 2, block // 2, half), dtype=np.uint8)
    np.bitwise_or(even & 15, (odd & 15) << 4, out=out[:, 0])
    np.bitwise_or(even >> 4, odd & 0xF0, out=out[:, 1])
    return out.reshape(N, half)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even, as torch casts finite values) as uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


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
    packing: str | None = None  # int4 only: stored in torch's CPU int4 kernel layout (`packed_pieces`)

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
        """One stored part of a bundle (uint8, >= bundle_bytes) as [rows, row_bytes] (not packed)."""
        if self.packing:
            raise FlashLLMError(f"experts stored packed ({self.packing}) have no per-row parts")
        return raw[self.part_range(part)].reshape(self.part_shape(part)[0], self.row_bytes(part))

    def packed_pieces(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Piece -> (byte offset, shape) in a bundle stored packed (and in torch's int4 expert slots):
        `up_gate` codes (up rows, then gate rows) uint8 [2 d_ffn, d_model / 2] and `down` (W_down) codes
        [d_model, d_ffn / 2], in torch's CPU int4 layout; `up_gate_sz`, `down_sz` the kernel's bfloat16
        (scale, zero) [groups, rows, 2] with w = (q - 8) * scale + zero. As many bytes as the rows layout."""
        d, f, g = self.d_model, self.d_ffn, self.quant.group_size
        shapes = {"up_gate": (2 * f, d // 2), "up_gate_sz": (d // g, 2 * f, 2),
                  "down": (d, f // 2), "down_sz": (f // g, d, 2)}
        out, at = {}, 0
        for name, shape in shapes.items():
            out[name] = (at, shape)
            at += int(np.prod(shape)) * (2 if name.endswith("_sz") else 1)
        return out

    def packed(self, raw: np.ndarray, name: str) -> np.ndarray:
        """One piece of a packed bundle: codes uint8, (scale, zero) as uint16 bfloat16 bits."""
        at, shape = self.packed_pieces()[name]
        size = int(np.prod(shape)) * (2 if name.endswith("_sz") else 1)
        piece = raw[at:at + size]
        return (piece.view(np.uint16) if name.endswith("_sz") else piece).reshape(shape)

    def stored_codes(self, raw: np.ndarray, name: str) -> np.ndarray:
        """The int4 codes of packed piece `name` (`up_gate` or `down`) of a bundle as stored (rows or
        packed) in flashllm/format/quant.py's nibble order: uint8 [rows, K / 2], value 2j in the low nibble."""
        if self.packing:
            return unpack_nibbles(self.packed(raw, name), packing_block(self.packing))
        parts = ("up", "gate") if name == "up_gate" else ("down",)
        co, cn = self.quant.part_layout(self.part_shape(parts[0])[1])["codes"]
        return np.concatenate([self.part_raw(raw, p)[:, co:co + cn] for p in parts])

    def pack(self, raw: np.ndarray, out: np.ndarray, block: int) -> None:
        """A bundle as stored (rows or packed) -> `out` (uint8, >= bundle_bytes) packed for `block`,
        holding what torch's int4 kernel takes: bfloat16 scale; zero = min + 8 * scale in float32, then
        bfloat16 (0 for symmetric codes, stored as q + 8)."""
        for name, parts in (("up_gate", ("up", "gate")), ("down", ("down",))):
            at, shape = self.packed_pieces()[name]
            dst = out[at:at + shape[0] * shape[1]].reshape(shape)
            if self.packing:
                if packing_block(self.packing) == block:
                    np.copyto(dst, self.packed(raw, name))
                else:
                    pack_nibbles(self.stored_codes(raw, name), dst, block)
                np.copyto(self.packed(out, name + "_sz"), self.packed(raw, name + "_sz"))
                continue
            stored = [self.part_raw(raw, p) for p in parts]
            pieces = self.quant.part_layout(self.part_shape(parts[0])[1])
            (co, cn), (so, sn) = pieces["codes"], pieces["scales"]
            if all(len(rows) % block == 0 for rows in stored):  # each part whole blocks: no concatenation
                for k, rows in enumerate(stored):
                    pack_nibbles(rows[:, co:co + cn], dst[k * len(rows):(k + 1) * len(rows)], block)
            else:
                pack_nibbles(self.stored_codes(raw, name), dst, block)
            start, sz = 0, self.packed(out, name + "_sz")
            for rows in stored:
                scale = np.ascontiguousarray(rows[:, so:so + sn]).view(np.float16).astype(np.float32)
                if "mins" in pieces:  # w = q * s + m = (q - 8) * s + (m + 8 s)
                    mo, mn = pieces["mins"]
                    zero = np.ascontiguousarray(rows[:, mo:mo + mn]).view(np.float16).astype(np.float32) + 8 * scale
                else:
                    zero = np.zeros_like(scale)
                sz[:, start:start + len(rows), 0], sz[:, start:start + len(rows), 1] = bf16_bits(scale).T, bf16_bits(zero).T
                start += len(rows)

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """A quantized expert bundle (uint8, >= bundle_bytes) -> float32 values [parts * d_ffn * d_model],
        every part [d_ffn, d_model] (down transposed back), so `part_slice` indexes the result as it
        indexes an unquantized bundle's values."""
        out = np.empty((len(self.parts), self.d_ffn, self.d_model), dtype=np.float32)
        if self.packing:
            g, f = self.quant.group_size, self.d_ffn
            for name in ("up_gate", "down"):
                stored = self.stored_codes(raw, name)
                q = np.stack((stored & 15, stored >> 4), 2).reshape(len(stored), -1).astype(np.float32)
                sz = bf16_values(self.packed(raw, name + "_sz"))  # [G, rows, 2]
                w = ((q.reshape(len(q), -1, g) - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]).reshape(q.shape)
                if name == "down":
                    out[self.parts.index("down")] = w.T
                else:
                    out[self.parts.index("up")], out[self.parts.index("gate")] = w[:f], w[f:]
            return out.reshape(-1)
        for k, part in enumerate(self.parts):
            values = self.quant.dequantize(self.part_raw(raw, part), self.part_shape(part)[1])
            out[k] = values.T if part == "down" else values
        return out.reshape(-1)

    def segments(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(file base, file stride, bytes per expert, offset in the memory row): one read per expert."""
        return [(self.layer_offsets[layer], self.stride, self.stride, 0)]

    @classmethod
    def plan(cls, spec: ArchSpec, itemsize: int, quant: QuantScheme | None = None,
             packing: str | None = None) -> "ExpertLayout":
        if quant and spec.d_ffn % quant.group_size:
            both = math.gcd(spec.d_model, spec.d_ffn)
            raise OptionsError(f"group size {quant.group_size}: does not divide the experts' d_ffn {spec.d_ffn} "
                               f"(quantized down projections are grouped along d_ffn, the other parts along d_model "
                               f"{spec.d_model}; pick a divisor of both: "
                               f"{{group_size={divisor_near(both, quant.group_size)}}})")
        if packing is not None:
            block = packing_block(packing)
            if not quant or quant.bits != 4 or spec.d_model % block or (2 * spec.d_ffn) % block:
                raise FlashLLMError(f"expert packing {packing}: needs int4 experts whose d_model and 2 * d_ffn are "
                                    f"multiples of {block} (got {quant.name if quant else 'no quantization'}, "
                                    f"d_model {spec.d_model}, d_ffn {spec.d_ffn})")
        probe = cls(spec.d_model, spec.d_ffn, spec.n_experts, itemsize, 0, (), quant=quant)
        stride = _round_up(probe.bundle_bytes, EXPERT_ALIGN)
        return cls(spec.d_model, spec.d_ffn, spec.n_experts, itemsize, stride,
                   tuple(i * spec.n_experts * stride for i in range(spec.n_layers)), quant=quant, packing=packing)

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
        if self.packing:
            out.update(expert_packing=self.packing,
                       packed_pieces={k: [at, list(shape)] for k, (at, shape) in self.packed_pieces().items()})
            del out["row_layout"], out["row_bytes"]
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
