"""Group-wise int8/int4 quantization of FFN bundle parts (numpy only; see docs/format.md).

Each part of a bundle (an up or gate row, a down column: `d_model` values) is cut into groups of
`group_size` consecutive values; each group stores its codes and its own float16 scale (and, for
the asymmetric scheme, its float16 minimum) inside the part, so a neuron's bundle stays
self-contained. Part layout in bytes: codes, then scales, then mins (asymmetric only).

- symmetric (GGUF Q8_0/Q4_0-like): q = round(w / s) in [-(2^(b-1)-1), 2^(b-1)-1], w ≈ q·s.
  int8 codes are two's complement bytes; int4 codes are stored as q + 8 (1..15).
- asymmetric (FlexGen min/max): q = round((w - m) / s) in [0, 2^b - 1], w ≈ q·s + m.
int4 packs two codes per byte: value 2j in the low nibble, value 2j+1 in the high nibble.
Scales are rounded *up* to float16 (and mins *down*), so no code clips: |w - ŵ| <= s/2 per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.errors import FlashLLMError, OptionsError

BITS = {"int8": 8, "int4": 4}  # --quantize name -> bits per code
SCHEMES = ("symmetric", "asymmetric")
SCALE_DTYPE = "float16"
DEFAULT_GROUP = 64
DEFAULT_SCHEME = "asymmetric"  # the lower reconstruction error of the two (docs/quantization.md)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """float16 values >= x (x float32, finite, >= 0 expected)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _f16_down(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float16)
    high = h.astype(np.float32) > x
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


@dataclass(frozen=True)
class QuantScheme:
    """How one part of d_model values is quantized and where its pieces lie inside the part."""

    bits: int
    group_size: int = DEFAULT_GROUP
    scheme: str = DEFAULT_SCHEME

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def symmetric(self) -> bool:
        return self.scheme == "symmetric"

    @classmethod
    def named(cls, name: str, group_size: int = DEFAULT_GROUP, scheme: str = DEFAULT_SCHEME) -> "QuantScheme":
        """The scheme for a `--quantize` name (int8, int4), validated."""
        if name not in BITS:
            raise FlashLLMError(f"quantization {name!r}: expected none or one of {', '.join(BITS)}")
        if scheme not in SCHEMES:
            raise FlashLLMError(f"quantization scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
        if not isinstance(group_size, int) or group_size < 2:
            raise FlashLLMError(f"group size {group_size!r}: must be an integer of at least 2")
        if BITS[name] == 4 and group_size % 2:
            raise FlashLLMError(f"group size {group_size}: int4 packs two values per byte, so it must be even")
        return cls(BITS[name], group_size, scheme)

    def check(self, d_model: int) -> None:
        """Groups run along d_model (the rows of every FFN part but a quantized expert's down projection)."""
        if d_model % self.group_size:
            raise OptionsError(f"group size {self.group_size}: does not divide d_model {d_model} (pick a divisor "
                               f"of {d_model}: {{group_size={divisor_near(d_model, self.group_size)}}})")

    # -- byte layout of one part ---------------------------------------------------------------
    def groups(self, d: int) -> int:
        return d // self.group_size

    def part_layout(self, d: int) -> dict[str, tuple[int, int]]:
        """Piece -> (byte offset, byte length) inside one part of d values."""
        codes, g2 = d * self.bits // 8, self.groups(d) * 2
        out = {"codes": (0, codes), "scales": (codes, g2)}
        if not self.symmetric:
            out["mins"] = (codes + g2, g2)
        return out

    def part_bytes(self, d: int) -> int:
        return sum(n for _, n in self.part_layout(d).values())

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "bits": self.bits, "group_size": self.group_size, "scale_dtype": SCALE_DTYPE}

    @classmethod
    def from_dict(cls, name: str, data, d_model: int, where: str) -> "QuantScheme":
        """Validate the manifest's description of quantization `name`; refuse what this reader cannot read."""
        if name not in BITS:
            raise FlashLLMError(f"{where}: quantization {name!r} is not supported (this flashllm reads "
                                f"none, {', '.join(BITS)})")
        if not isinstance(data, dict) or data.get("scale_dtype") != SCALE_DTYPE or data.get("bits") != BITS[name] \
                or data.get("scheme") not in SCHEMES or not isinstance(data.get("group_size"), int):
            raise FlashLLMError(f"{where}: quantization parameters {data!r} are not supported "
                                f"(expected scheme in {SCHEMES}, bits {BITS[name]}, scale_dtype {SCALE_DTYPE})")
        try:
            q = cls.named(name, data["group_size"], data["scheme"])
            q.check(d_model)
        except FlashLLMError as exc:
            raise FlashLLMError(f"{where}: {exc}") from None
        return q

    # -- quantize / dequantize -----------------------------------------------------------------
    def quantize(self, w: np.ndarray) -> np.ndarray:
        """[n, d] float rows -> [n, part_bytes] uint8 parts."""
        w = np.asarray(w, dtype=np.float32)
        n, d = w.shape
        self.check(d)
        g = w.reshape(n, self.groups(d), self.group_size)
        if not np.isfinite(g).all():
            raise FlashLLMError("cannot quantize weights that are not finite (inf or nan)")
        if self.symmetric:
            qmax = (1 << (self.bits - 1)) - 1
            s = _f16_up(np.abs(g).max(axis=2) / qmax)
            m = None
            q = np.rint(g / np.where(s == 0, 1, s).astype(np.float32)[..., None])
            q = np.clip(q, -qmax, qmax).astype(np.int16)
            codes = (q + 8).astype(np.uint8) if self.bits == 4 else q.astype(np.int8).view(np.uint8)
        else:
            m = _f16_down(g.min(axis=2))
            s = _f16_up((g.max(axis=2) - m.astype(np.float32)) / ((1 << self.bits) - 1))
            q = np.rint((g - m.astype(np.float32)[..., None]) / np.where(s == 0, 1, s).astype(np.float32)[..., None])
            codes = np.clip(q, 0, (1 << self.bits) - 1).astype(np.uint8)
        if not np.isfinite(s).all() or (m is not None and not np.isfinite(m).all()):
            raise FlashLLMError("weights too large for float16 group scales (|w| up to ~65504 * levels)")
        codes = codes.reshape(n, d)
        if self.bits == 4:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        pieces = [codes, np.ascontiguousarray(s).view(np.uint8).reshape(n, -1)]
        if m is not None:
            pieces.append(np.ascontiguousarray(m).view(np.uint8).reshape(n, -1))
        return np.concatenate(pieces, axis=1)

    def unpack(self, raw: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """uint8 parts [n, >= part_bytes] -> (signed or unsigned codes [n, d] int8/uint8, scales [n, G]
        float16, mins [n, G] float16 or None), the pieces a backend's own kernels take."""
        lay, n = self.part_layout(d), raw.shape[0]

        def piece(key):
            off, size = lay[key]
            return np.ascontiguousarray(raw[:, off:off + size])

        codes = piece("codes")
        if self.bits == 4:
            codes = np.stack((codes & 0x0F, codes >> 4), axis=2).reshape(n, d)
            if self.symmetric:
                codes = (codes.astype(np.int8) - 8)
        elif self.symmetric:
            codes = codes.view(np.int8)
        mins = piece("mins").view(np.float16) if "mins" in lay else None
        return codes, piece("scales").view(np.float16), mins

    def dequantize(self, raw: np.ndarray, d: int) -> np.ndarray:
        """uint8 parts [n, >= part_bytes] -> float32 [n, d]."""
        codes, s, m = self.unpack(raw, d)
        n, G = s.shape
        w = codes.reshape(n, G, -1).astype(np.float32)
        w *= s.astype(np.float32)[..., None]  # in place: one float32 temporary the size of the result
        if m is not None:
            w += m.astype(np.float32)[..., None]
        return w.reshape(n, d)


def divisor_near(d: int, g: int) -> int:
    """The even divisor of `d` nearest to the group size `g` (the smaller one on a tie), else `d` itself."""
    divisors = [k for k in range(2, d + 1) if d % k == 0 and k % 2 == 0] or [d]
    return min(divisors, key=lambda k: (abs(k - g), k))
