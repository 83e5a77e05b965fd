"""The mode protocol (`Mode`, with a mode's defaults) and what the flash-reading modes share (`StreamingMode`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.modes.context import ModeContext


@dataclass
class LayerReads:
    """The reads started for one layer of a flash-reading mode: its FFN rows, and (naive) its other weights."""

    ffn: object | None  # a PendingNeurons
    resident: object | None = None  # a PendingRead of the layer's attention and norms (naive)

    def wait(self) -> None:
        for read in (self.resident, self.ffn):
            if read is not None:
                read.wait()


class Mode:
    """The mode protocol, with the defaults of a mode that loads nothing around a layer."""

    summary = ""  # one line for --help
    predictor = None  # the sparse modes' predictor

    def __init__(self, ctx: ModeContext):
        self.ctx, self.lay, self.backend = ctx, ctx.layout, ctx.backend

    def before_layer(self, layer: int, cost) -> None:
        """Called before the layer's attention."""

    def before_ffn(self, layer: int, residual, cost) -> None:
        """Called before `ffn` with the residual stream the FFN input is normed from."""

    def after_layer(self, layer: int) -> None:
        """Called once the layer's output is complete (its post-FFN norm applied)."""

    def ffn(self, layer: int, x, cost):
        raise NotImplementedError

    def reset(self) -> None:
        """A new sequence starts (position 0)."""

    def keep_verified(self, kept: int, policy: str) -> None:
        """After a speculative verification (a forward with `verify`): its first `kept` positions stay in the
        sequence, the rest were rejected drafts; `policy` (options.WINDOW_POLICIES) says whose neurons a window keeps."""

    def host_bytes(self) -> int:
        """Host memory held: read buffers (counted against the DRAM budget on a GPU)."""
        return 0

    def device_bytes(self) -> int:
        """Memory held beside the backend's resident weights and KV cache: FFN rows, caches, predictors."""
        return 0

    def describe(self) -> dict:
        """What this mode adds to `Model.stats`."""
        return {}


class StreamingMode(Mode):
    """Shared by the flash-reading modes: the FFN reader and a dense read of neuron ranges."""

    gap_filling = False  # scattered reads: read through small gaps (the disk profile's cost model)

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        self.reader = ctx.ffn_reader(gap_filling=self.gap_filling, layout=getattr(self, "read_layout", None),
                                     aio_depth=getattr(self, "aio_depth", None))
        # dense modes: read layer l+1 while layer l computes (two buffers), never across tokens
        self.buffers = 2 if ctx.options.read_ahead is not False and ctx.spec.n_layers > 1 else 1
        self._inflight: dict[int, LayerReads] = {}  # layer -> the reads started for it

    def wait_rows(self, pending, buf: np.ndarray, n: int, cost) -> dict:
        """The first `n` neuron rows of `buf` as backend rows, once the read `pending` has filled them."""
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        with cost.timed("mem_ms"):
            return self.ctx.bundle_rows(buf[:n], keep_quantized=True)

    def reset(self) -> None:
        for reads in self._inflight.values():
            reads.wait()
        self._inflight.clear()

