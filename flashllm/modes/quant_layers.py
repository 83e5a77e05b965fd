"""Naive mode with --quantize-resident: each layer's resident tensors quantized once, at load.

Naive mode holds no layer weights: every token reads each layer's attention (and norms, biases) from
flash. Quantizing the stored float matrices as they are read cost most of a token (7B shape, int4:
65.9 of 68.7 s per token), a baseline no one would run. So at load every layer's tensors are
quantized once (the same `backend.quantized` as the other modes: naive equals dense) and written,
in the backend's own kernel layout, to a scratch file on the model's disk, one 4 KiB-aligned block
per layer; a token reads a layer's block like any other flash read and wraps it without copying.
The scratch file is unlinked as soon as it is open: nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from flashllm.backends.base import QUANTIZED_RESIDENT, RESIDENT_QUANT_BITS
from flashllm.errors import FlashLLMError
from flashllm.io.reader import FlashReader

ALIGN = 64  # each piece starts on a multiple of this (any dtype view of it is aligned)
BLOCK_ALIGN = 4096  # each layer's block starts on a page (direct I/O reads it in place)


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


class QuantizedLayers:
    """Per layer, a block of the scratch file: `spans[i]` = (offset, bytes, names) as NaiveMode reads
    them, `place(i, buf)` makes the layer's tensors live from a buffer holding that block."""

    def __init__(self, st, layer_names: list[list[str]], backend, quantize: str, threads: int,
                 aio_depth=None, directory=None, progress=None):
        bits = RESIDENT_QUANT_BITS[quantize]
        self.backend = backend
        self.tensors: list[dict] = []  # per layer: name -> ("raw", dtype, shape, off, n) or ("quant", cls, meta, pieces)
        self.spans = []
        fd, self.path = _scratch(directory or os.path.dirname(st.path))
        try:
            with os.fdopen(fd, "wb") as f:
                pos = 0
                for names in layer_names:
                    start, layer = pos, {}
                    for name in names:
                        raw = st.read_bytes(name)
                        if QUANTIZED_RESIDENT.fullmatch(name):
                            q = backend.quantized(backend.storage_view(raw, st.dtype(name)).reshape(st.shape(name)),
                                                  bits, gather=False)
                            meta, arrays = q.host_pieces()
                            pieces = []
                            for a in arrays:
                                a = np.ascontiguousarray(a)
                                pos = _write(f, pos, a.view(np.uint8).reshape(-1))
                                pieces.append((pos - a.nbytes - start, a.dtype.str, a.shape))
                            layer[name] = ("quant", type(q), meta, pieces)
                        else:
                            pos = _write(f, pos, raw)
                            layer[name] = ("raw", st.dtype(name), st.shape(name), pos - len(raw) - start, len(raw))
                    f.write(b"\0" * (_up(pos, BLOCK_ALIGN) - pos))
                    pos = _up(pos, BLOCK_ALIGN)
                    self.spans.append((start, pos - start, names))
                    self.tensors.append(layer)
                    if progress:
                        progress()
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):  # its pages leave the page cache: tokens read the disk
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            self.reader = FlashReader(self.path, threads=threads, aio_depth=aio_depth)
        except OSError as exc:
            raise FlashLLMError(f"{self.path}: cannot write the quantized layers of naive mode ({exc.strerror})") \
                from None
        finally:
            os.unlink(self.path)

    @property
    def block_bytes(self) -> int:
        return max(n for _, n, _ in self.spans)

    def place(self, layer: int, buf: np.ndarray) -> None:
        """Layer `layer`'s tensors as backend weights, from `buf` (uint8) holding its block: quantized
        matrices as views of `buf` (valid until the buffer is read into again), the rest cast as stored."""
        B = self.backend
        for name, t in self.tensors[layer].items():
            if t[0] == "raw":
                _, dtype, shape, off, n = t
                B.put_bytes(name, buf[off:off + n], dtype, shape)
            else:
                _, cls, meta, pieces = t
                arrays = [buf[off:off + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
                          for off, dt, shape in pieces]
                B.w[name] = cls.from_host_pieces(meta, arrays)

    def close(self) -> None:
        self.reader.close()


def _write(f, pos: int, data: np.ndarray) -> int:
    """Write `data` at the next ALIGN boundary after `pos`; return the end."""
    start = _up(pos, ALIGN)
    if start > pos:
        f.write(b"\0" * (start - pos))
    f.write(memoryview(np.ascontiguousarray(data)))
    return start + data.nbytes


def _scratch(directory: str) -> tuple[int, str]:
    """(fd, path) of a new scratch file: beside the model (its disk) where writable, else in the temp dir."""
    for d in (directory, tempfile.gettempdir()):
        try:
            return tempfile.mkstemp(prefix=".flashllm-naive-quantized-", dir=d)
        except OSError:
            continue
    raise FlashLLMError(f"naive mode with --quantize-resident needs a scratch file: cannot write in {directory} "
                        f"or {tempfile.gettempdir()}")
