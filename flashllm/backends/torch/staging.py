"""Host staging for flash reads bound for device memory or another dtype (torch backend).

Page-aligned buffers take turns. On CUDA there are two, pinned; each buffer's host->device copy runs
on a side stream, and the compute stream waits on that copy's event (no global synchronize), so
the read into the other buffer overlaps the copy in flight. On the CPU the copy is a dtype cast that
finishes before the next read starts, so one buffer does (a second would only take DRAM from the caches).
"""

from __future__ import annotations

import numpy as np
import torch

from flashllm.hugepages import aligned_empty

PAGE = 4096


def host_array(nbytes: int, pinned: bool) -> np.ndarray:
    """A page-aligned uint8 host array; pinned (page-locked, for async copies to a GPU) on request."""
    if not pinned:
        return aligned_empty(nbytes, np.uint8)
    a = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True).numpy()  # the view keeps it alive
    start = -a.ctypes.data % PAGE
    return a[start:start + nbytes]


def bundle_values(layout, block: np.ndarray, storage_dtype: torch.dtype) -> torch.Tensor:
    """uint8 bundle rows [n, >= bundle_bytes] as values [n, len(parts) * d] (dequantized to float32
    when the layout is quantized; otherwise a view in the storage dtype)."""
    if layout.quant:
        return torch.from_numpy(layout.dequantize(block))
    return torch.from_numpy(block).view(storage_dtype)[:, :len(layout.parts) * layout.d_model]


class StagingRing:
    def __init__(self, rows: int, stride: int, device: torch.device, count: int = 2):
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers = [host_array(rows * stride, self.cuda).reshape(rows, stride) for _ in range(count)]
        self.events: list = [None] * count
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.turn = 0

    @property
    def rows(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def acquire(self) -> int:
        """The next buffer to read into, once the copy that last used it has finished."""
        b, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if self.events[b] is not None:
            self.events[b].synchronize()
            self.events[b] = None
        return b

    def copy_rows(self, b: int, src: torch.Tensor, matrix: torch.Tensor, rows: np.ndarray) -> None:
        """matrix[rows] = src (host values decoded from buffer b), in matrix's dtype."""
        if not self.cuda:
            matrix[torch.from_numpy(rows)] = src.to(matrix.dtype)
            return
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)  # rows being overwritten may still be read by queued moves
            idx = torch.from_numpy(rows).to(self.device, non_blocking=True)
            matrix[idx] = src.to(self.device, non_blocking=True).to(matrix.dtype)
            event = torch.cuda.Event()
            event.record(self.stream)
        main.wait_event(event)
        self.events[b] = event
