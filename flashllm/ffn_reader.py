"""Neurons of the FFN file into memory rows (the bundle layout in memory), whatever the file layout."""

from __future__ import annotations

import numpy as np

from .flashio import FlashReader, IOStats
from .format import FFNLayout


class FFNReader:
    """One read per neuron (bundled layout) or per neuron and part (unbundled), coalesced by the engine."""

    def __init__(self, path, layout: FFNLayout, threads: int, aio_depth: int = 0):
        self.layout = layout
        self.io = FlashReader(path, threads=threads, aio_depth=aio_depth)

    def read(self, layer: int, ids: np.ndarray, dest: np.ndarray, dest_rows: np.ndarray) -> IOStats:
        """Neuron ids[k] of `layer` into row dest_rows[k] of `dest` (uint8, >= stride bytes per row)."""
        total = IOStats()
        for base, stride, nbytes, col in self.layout.segments(layer):
            total = total + self.io.read_rows(base, stride, nbytes, ids, dest[:, col:col + nbytes], dest_rows)
        return total

    def reader_for(self, layer: int):
        """read(ids, dest, dest_rows) bound to one layer: what a backend's row store fills from."""
        return lambda ids, dest, dest_rows: self.read(layer, ids, dest, dest_rows)

    def read_block(self, layer: int, lo: int, hi: int, dest: np.ndarray) -> IOStats:
        """Neurons lo..hi-1 into rows 0.. of dest (one large sequential read when bundled)."""
        return self.read(layer, np.arange(lo, hi), dest, np.arange(hi - lo))

    def close(self) -> None:
        self.io.close()
