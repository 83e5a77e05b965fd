"""A neuron cache's rows on a torch device (`TorchBackend.row_store`): where flash reads land, how they are placed."""

from __future__ import annotations

import numpy as np
import torch

from flashllm.stats import untimed
from flashllm.backends.torch.staging import bundle_values
from flashllm.backends.torch.quant import QuantRows


class TorchRowStore:
    """A neuron cache's preallocated matrix of bundle rows (plus per-row FFN biases) on a torch device.

    When the device is the CPU and the compute dtype is the storage dtype, flash reads land in the
    matrix itself; otherwise they land in the backend's staging ring (pinned on CUDA) and are copied.
    """

    def __init__(self, backend, capacity: int, layout, biases: dict[str, torch.Tensor | None]):
        from flashllm.hugepages import aligned_empty

        storage_dtype = backend.storage_dtype
        self.layout, self.storage_dtype, self.backend = layout, storage_dtype, backend
        self.elems = len(layout.parts) * layout.d_model
        if backend.reads_in_place():
            self.raw = aligned_empty((capacity, layout.stride), np.uint8)
            # quantized bundles stay bytes (QuantRows views) for the native kernels
            self.matrix = None if layout.quant else torch.from_numpy(self.raw).view(storage_dtype)
            self.staging = None
        else:
            self.raw = None
            self.matrix = torch.empty(capacity, self.elems, dtype=backend.dtype, device=backend.device)
            self.staging = backend.staging(layout.stride)
        self.full_bias = {k: v for k, v in biases.items() if v is not None}
        self.bias = {k: torch.empty(capacity, dtype=backend.dtype, device=backend.device) for k in self.full_bias}
        self._views = None  # (n, part views, bias views) of the last `views(n)`

    def nbytes(self) -> int:
        """Bytes of the matrix and per-row biases (the shared staging buffer is counted once, elsewhere)."""
        held = self.raw.nbytes if self.matrix is None else self.backend.nbytes_of(self.matrix)
        return held + sum(map(self.backend.nbytes_of, self.bias.values()))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        d = torch.from_numpy(dst).to(self.backend.device)
        s = torch.from_numpy(src).to(self.backend.device)
        if self.matrix is None:
            self.raw[dst] = self.raw[src]
        else:
            self.matrix[d] = self.matrix[s]
        for b in self.bias.values():
            b[d] = b[s]

    def fill(self, read, ids: np.ndarray, rows: np.ndarray, cost=None):
        """Bundles of neurons `ids` into matrix rows `rows` via `read(ids, dest, dest_rows)`; returns the
        IOStats. Reading is timed as `io_ms`, placing (staging copy, cast, bias scatter) as `mem_ms`."""
        timed = cost.timed if cost is not None else untimed
        if self.staging is None:
            with timed("io_ms"):
                io = read(ids, self.raw, rows)
        else:
            io, ring = None, self.staging
            for k in range(0, len(ids), ring.rows):
                chunk = ids[k:k + ring.rows]
                with timed("io_ms"):
                    b = ring.acquire()
                    part = read(chunk, ring.buffers[b], np.arange(len(chunk)))
                io = part if io is None else io + part
                with timed("mem_ms"):
                    values = bundle_values(self.layout, ring.buffers[b][:len(chunk)], self.storage_dtype)
                    ring.copy_rows(b, values, self.matrix, rows[k:k + ring.rows])
        if len(ids):
            with timed("mem_ms"):
                self._set_biases(ids, rows)
        return io

    def place(self, block: np.ndarray, src: np.ndarray, ids: np.ndarray, rows: np.ndarray, cost=None) -> None:
        """Bundles already read into host rows block[src] (uint8) become matrix rows `rows` (neurons `ids`):
        the placing half of `fill` (for reads that were started earlier), timed as `mem_ms`."""
        if not len(ids):
            return
        with (cost.timed if cost is not None else untimed)("mem_ms"):
            if self.staging is None:
                width, r0 = self.raw.shape[1], int(rows[0])
                if int(rows[-1]) - r0 + 1 == len(rows):  # consecutive free rows: one gather pass into them
                    np.take(block[:, :width], src, axis=0, out=self.raw[r0:r0 + len(rows)], mode="clip")
                else:
                    self.raw[rows] = block[src, :width]
            else:
                values = bundle_values(self.layout, block[src], self.storage_dtype)
                idx = torch.from_numpy(rows).to(self.backend.device)
                self.matrix[idx] = values.to(device=self.backend.device, dtype=self.matrix.dtype)
            self._set_biases(ids, rows)

    def landing(self) -> np.ndarray | None:
        """The host rows flash reads land in directly (uint8, one bundle per row), or None: reads go
        through staging. A read started into them is made usable by `placed` once it has arrived."""
        return self.raw

    def placed(self, ids: np.ndarray, rows: np.ndarray, cost=None) -> None:
        """Bundles read straight into `landing()` rows `rows` (a read started earlier) are neurons `ids`."""
        if len(ids) and self.bias:
            with (cost.timed if cost is not None else untimed)("mem_ms"):
                self._set_biases(ids, rows)

    def _set_biases(self, ids: np.ndarray, rows: np.ndarray) -> None:
        r = torch.from_numpy(rows).to(self.backend.device)
        i = torch.from_numpy(ids).to(self.backend.device)
        for key, b in self.bias.items():
            b[r] = self.full_bias[key][i]

    def views(self, n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-part [n, d] weight views of rows :n, and per-row biases. The last n's are kept (views see the rows'
        new contents): a full cache asks for the same n every token, and each view made costs ~10 us on caches
        the weight streams have just flushed."""
        if self._views is None or self._views[0] != n:
            lay = self.layout
            if self.matrix is None:
                rows = {p: QuantRows(self.raw[:n], lay.part_range(p).start, lay.quant, lay.d_model) for p in lay.parts}
            else:
                rows = {p: self.matrix[:n, lay.part_slice(p)] for p in lay.parts}
            self._views = (n, rows, {k: b[:n] for k, b in self.bias.items()})
        return self._views[1], self._views[2]
