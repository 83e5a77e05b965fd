"""Neurons of the FFN file into memory rows (the bundle layout in memory), whatever the file layout."""

from __future__ import annotations

import hashlib

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.io.reader import FlashReader, IOStats
from flashllm.format.manifest import FFNLayout


class LayerChecksums:
    """Verifies each FFN layer's sha256 (manifest `layer_sha256`) the first time it is read in full.

    A layer counts as read in full when its neurons 0..d_ffn-1 arrive in order in contiguous ranges
    (dense load, naive and hybrid reads, a dense-stream prefill), possibly over several calls; the
    hash then costs one pass over bytes already in memory, once per layer. Scattered reads (sparse
    decode) are not verified. Only the bundled layout read whole is checked (the memory rows are the file's bytes).
    """

    def __init__(self, path, layout: FFNLayout, layer_sha256: list[str] | None):
        self.path, self.layout = path, layout
        usable = bool(layer_sha256) and layout.bundled and not getattr(layout, "file_parts", None) and \
            len(layer_sha256) == len(layout.layer_offsets)
        self.expected = list(layer_sha256) if usable else None
        self.verified: set[int] = set()
        self._partial: dict[int, tuple[int, object]] = {}  # layer -> (next neuron, running hash)

    def observe(self, layer: int, ids: np.ndarray, dest: np.ndarray, dest_rows: np.ndarray) -> None:
        """Feed a finished read: neurons `ids` of `layer` now in rows `dest_rows` of `dest`."""
        if self.expected is None or layer in self.verified or not len(ids):
            return
        n, lo, row = len(ids), int(ids[0]), int(dest_rows[0])
        if not (np.array_equal(ids, np.arange(lo, lo + n)) and np.array_equal(dest_rows, np.arange(row, row + n))):
            return
        nxt, h = self._partial.get(layer, (0, None))
        if lo == 0:
            nxt, h = 0, hashlib.sha256()
        if h is None or lo != nxt:
            return
        lay = self.layout
        h.update(np.ascontiguousarray(dest[row:row + n, :lay.stride]).data)
        nxt += n
        if nxt < lay.d_ffn:
            self._partial[layer] = (nxt, h)
            return
        self._partial.pop(layer, None)
        offsets = list(lay.layer_offsets) + [lay.file_size]
        h.update(bytes(offsets[layer + 1] - offsets[layer] - lay.d_ffn * lay.stride))  # alignment padding
        if h.hexdigest() != self.expected[layer]:
            raise FlashLLMError(f"{self.path}: FFN layer {layer} fails its checksum (the file is corrupt; "
                                f"convert the model again)")
        self.verified.add(layer)


class PendingNeurons:
    """A submitted neuron read: `wait()` returns its IOStats once every part has arrived (checksummed and
    reported to the hooks once); `done()` does not block."""

    def __init__(self, reader: "FFNReader", layer: int, ids, dest, dest_rows, calls):
        self.reader, self.layer, self.ids, self.dest, self.dest_rows, self.calls = \
            reader, layer, ids, dest, dest_rows, calls
        self.stats: IOStats | None = None

    def done(self) -> bool:
        return all(c.done() for c in self.calls)

    def wait(self) -> IOStats:
        if self.stats is None:
            parts = [c.wait() for c in self.calls]
            total = IOStats()
            for p in parts:
                total = total + p
            total.wall_s = max((p.wall_s for p in parts), default=0.0)
            r = self.reader
            if r.checksums is not None:
                r.checksums.observe(self.layer, self.ids, self.dest, self.dest_rows)
            if r.hooks is not None:
                r.hooks.emit("read", total)
            self.stats = total
        return self.stats


class FFNReader:
    """One read per neuron (bundled layout) or per neuron and part (unbundled), coalesced by the engine."""

    def __init__(self, path, layout: FFNLayout, threads: int, aio_depth: int = 0,
                 checksums: LayerChecksums | None = None, hooks=None, gap_bytes: int | None = 0):
        """`gap_bytes`: read through file gaps up to this size (None: the disk profile's cost model)."""
        self.layout, self.checksums, self.hooks = layout, checksums, hooks
        if gap_bytes is None:
            from flashllm.io import disk_profile

            gap_bytes = disk_profile.profile(path, quick=True).gap_bytes(threads)
        self.io = FlashReader(path, threads=threads, aio_depth=aio_depth, gap_bytes=gap_bytes)

    def read(self, layer: int, ids: np.ndarray, dest: np.ndarray, dest_rows: np.ndarray) -> IOStats:
        """Neuron ids[k] of `layer` into row dest_rows[k] of `dest` (uint8, >= stride bytes per row)."""
        return self.submit(layer, ids, dest, dest_rows).wait()

    def submit(self, layer: int, ids: np.ndarray, dest: np.ndarray, dest_rows: np.ndarray) -> "PendingNeurons":
        """Start `read` and return at once (all parts of an unbundled layout in flight together)."""
        calls = [self.io.submit_rows(base, stride, nbytes, ids, dest[:, col:col + nbytes], dest_rows)
                 for base, stride, nbytes, col in self.layout.segments(layer)]
        return PendingNeurons(self, layer, ids, dest, dest_rows, calls)

    def reader_for(self, layer: int):
        """read(ids, dest, dest_rows) bound to one layer: what a backend's row store fills from."""
        return lambda ids, dest, dest_rows: self.read(layer, ids, dest, dest_rows)

    def read_block(self, layer: int, lo: int, hi: int, dest: np.ndarray) -> IOStats:
        """Neurons lo..hi-1 into rows 0.. of dest (one large sequential read when bundled)."""
        return self.read(layer, np.arange(lo, hi), dest, np.arange(hi - lo))

    def close(self) -> None:
        self.io.close()
