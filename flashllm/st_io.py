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
import torch

from .errors import FlashLLMError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
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
                numel = int(np.prod(e["shape"], dtype=np.int64))
            except (KeyError, TypeError, ValueError):
                raise FlashLLMError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if dtype is None:
                raise FlashLLMError(f"{self.path}: tensor {name!r} has dtype {e['dtype']!r}, which flashllm cannot "
                                    f"read (supported: {', '.join(DTYPES)})")
            if end > data_len:
                raise FlashLLMError(f"{self.path}: truncated: tensor {name!r} ends at byte {end} "
                                    f"but the file holds {data_len} data bytes")
            if end - begin != numel * dtype.itemsize:
                raise FlashLLMError(f"{self.path}: tensor {name!r} has {end - begin} bytes, "
                                    f"shape {e['shape']} needs {numel * dtype.itemsize}")

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def info(self, name: str) -> tuple[torch.dtype, int]:
        """(dtype, element count) of tensor `name`, from the header."""
        return DTYPES[self.entries[name]["dtype"]], int(np.prod(self.entries[name]["shape"], dtype=np.int64))

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as a fresh CPU tensor of its stored dtype."""
        e = self.entries[name]
        begin, end = e["data_offsets"]
        buf = bytearray(end - begin)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], self.data_start + begin) if buf else 0
            if got != len(buf):
                raise FlashLLMError(f"{self.path}: short read of tensor {name!r}")
            if hasattr(os, "posix_fadvise"):  # do not let a big checkpoint pile up in page cache
                os.posix_fadvise(f.fileno(), self.data_start + begin, len(buf), os.POSIX_FADV_DONTNEED)
        dtype = DTYPES[e["dtype"]]
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(e["shape"])


def write_safetensors(path: str, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict | None = None) -> None:
    """Stream tensors into `path`: the header comes from `specs`, each tensor from `produce(name)`."""
    specs = list(specs)
    header, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
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
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise FlashLLMError(f"internal: tensor {name} is {t.dtype}{tuple(t.shape)}, "
                                    f"header says {dtype}{tuple(shape)}")
            f.write(tensor_bytes(t))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (bfloat16 included)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
