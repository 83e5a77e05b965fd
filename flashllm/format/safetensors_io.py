"""Bounded-memory safetensors reading and streaming writing (no mmap growth, clear errors).

The format is an 8-byte little-endian header length, a JSON header, then raw tensor bytes.
Reading tensor by tensor with pread keeps RSS at one tensor; writing streams tensors in order.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import numpy as np

from flashllm.errors import FlashLLMError

# safetensors dtype -> (neutral name, bytes per element); array libraries map the names themselves
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
DTYPE_NAMES = {name: key for key, (name, _) in DTYPES.items()}


def dtype_name(dtype) -> str:
    """The neutral name of a dtype given by name, as a numpy dtype or as a torch dtype (torch.float16)."""
    name = dtype if isinstance(dtype, str) else str(dtype)
    name = name.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise FlashLLMError(f"dtype {dtype!r}: not storable in safetensors ({', '.join(DTYPE_NAMES)})")
    return name
_HEADER_LIMIT = 100 << 20


class SafetensorsFile:
    """Header of one safetensors file, validated against the file size; tensors read on demand."""

    def __init__(self, path: str):
        self.path = str(path)
        try:
            self.file_size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise FlashLLMError(f"{self.path}: truncated safetensors file (no header)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(_HEADER_LIMIT, self.file_size - 8):
                    raise FlashLLMError(f"{self.path}: truncated or corrupt safetensors header "
                                        f"(header length {header_len}, file size {self.file_size})")
                header = json.loads(f.read(header_len))
        except OSError as exc:
            raise FlashLLMError(f"{self.path}: cannot read ({exc.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise FlashLLMError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        self.data_start = 8 + header_len
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = header
        data_len = self.file_size - self.data_start
        for name, e in header.items():
            try:
                begin, end = e["data_offsets"]
                dtype = DTYPES.get(e["dtype"])
                itemsize = dtype[1] if dtype else 0
                numel = int(np.prod(e["shape"], dtype=np.int64))
            except (KeyError, TypeError, ValueError):
                raise FlashLLMError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if dtype is None:
                raise FlashLLMError(f"{self.path}: tensor {name!r} has dtype {e['dtype']!r}, which flashllm cannot "
                                    f"read (supported: {', '.join(DTYPES)})")
            if end > data_len:
                raise FlashLLMError(f"{self.path}: truncated: tensor {name!r} ends at byte {end} "
                                    f"but the file holds {data_len} data bytes")
            if end - begin != numel * itemsize:
                raise FlashLLMError(f"{self.path}: tensor {name!r} has {end - begin} bytes, "
                                    f"shape {e['shape']} needs {numel * itemsize}")

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The neutral dtype name of tensor `name` (float32, float16, bfloat16, ...)."""
        return DTYPES[self.entries[name]["dtype"]][0]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array of its values (bfloat16, which numpy lacks, widened exactly to float32)."""
        raw, dtype = self.read_bytes(name), self.dtype(name)
        if dtype == "bfloat16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(np.dtype(dtype))
        return values.reshape(self.shape(name))

    def read_bytes(self, name: str) -> np.ndarray:
        """The raw little-endian bytes of tensor `name` as a fresh uint8 array (see `dtype`, `shape`)."""
        e = self.entries[name]
        begin, end = e["data_offsets"]
        buf = np.empty(end - begin, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], self.data_start + begin) if len(buf) else 0
            if got != len(buf):
                raise FlashLLMError(f"{self.path}: short read of tensor {name!r}")
            if hasattr(os, "posix_fadvise"):  # do not let a big checkpoint pile up in page cache
                os.posix_fadvise(f.fileno(), self.data_start + begin, len(buf), os.POSIX_FADV_DONTNEED)
        return buf


def storage_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` stored as `dtype`: uint8 [..., n * itemsize], little-endian. Floats are rounded to the
    nearest even value, as torch casts; bfloat16 (which numpy lacks) is rounded from float32's bits
    (NaN stays a NaN: 0x7FC0)."""
    if dtype == "bfloat16":
        f32 = np.ascontiguousarray(values, dtype=np.float32)
        bits = f32.view(np.uint32)
        stored = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        stored[np.isnan(f32)] = 0x7FC0
    else:
        stored = np.ascontiguousarray(values, dtype=np.dtype(dtype))
    stored = stored.reshape(stored.shape or (1,))
    return stored.view(np.uint8).reshape(*stored.shape[:-1], stored.shape[-1] * stored.itemsize)


def write_safetensors(path: str, specs: Iterable[tuple[str, object, tuple[int, ...]]], produce: Callable[[str], object],
                      metadata: dict | None = None) -> None:
    """Stream tensors into `path`: the header comes from `specs` (name, dtype, shape), each tensor from
    `produce(name)`: a numpy array (or CPU tensor) of values, stored as the header's dtype (`storage_bytes`)."""
    specs = [(name, dtype_name(dtype), tuple(shape)) for name, dtype, shape in specs]
    header, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[DTYPE_NAMES[dtype]][1]
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, dtype, shape in specs:
            t = produce(name)
            if tuple(t.shape) != shape:
                raise FlashLLMError(f"internal: tensor {name} has shape {tuple(t.shape)}, header says {shape}")
            values = t if isinstance(t, np.ndarray) else t.detach().cpu().numpy()
            f.write(memoryview(storage_bytes(values, dtype).reshape(-1)))
