"""How layer weights are obtained per token: dense, naive, hybrid or sparse (the only difference).

Each mode is built from a `ModeContext` (layout, backend, FFN reader, budget, options), answers
`ffn(layer, x, cost)`, may load weights around a layer (`before_layer`, `after_layer`) and reports
its own memory (`host_bytes`, `device_bytes`) and stats (`describe`); the model's per-token path is
the same for all of them. The protocol and the streaming modes' base are in flashllm/modes/base.py, the sparse
mode in flashllm/modes/sparse/mode.py (its read-ahead in flashllm/modes/sparse/read_ahead.py).
"""

from __future__ import annotations

import numpy as np

from flashllm import budget as budget_mod
from flashllm.io.reader import FlashReader
from flashllm.modes.base import LayerReads, Mode, StreamingMode
from flashllm.modes.sparse.mode import SparseMode
from flashllm.modes.context import ModeContext
from flashllm.modes.quant_layers import QuantizedLayers
from flashllm.format.safetensors_io import SafetensorsFile


class DenseMode(Mode):
    """Every FFN weight resident: the correctness reference."""

    summary = "all weights resident (the reference)"

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        pack = ctx.backend.pack_ffn
        self.rows = [pack(ctx.bundle_rows(ctx.read_layer_block(i), keep_quantized=True)) for i in range(ctx.spec.n_layers)]
        ctx.check_fits(ctx.charged(0, self.backend.nbytes() + self.device_bytes()), "all weights and the KV cache")

    def ffn(self, layer: int, x, cost):
        b = self.ctx.biases(layer)
        return self.backend.ffn(x, self.rows[layer], b["up"], b["gate"], b["down"])

    def describe(self) -> dict:
        """`ffn_rows`: the FFN matrices each layer holds, as the backend packed them at load."""
        return {"ffn_rows": sorted(self.rows[0])}

    def device_bytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for rows in self.rows for t in rows.values())


class NaiveMode(StreamingMode):
    """No layer weights resident: every token reads each layer's attention and FFN from flash."""

    summary = "every layer read from flash per token"

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        st = SafetensorsFile(ctx.manifest.path("resident"))
        names = [[n for n in st.entries if n.startswith(f"layers.{i}.")] for i in range(ctx.spec.n_layers)]
        opts, self.quantized = ctx.options, None
        if opts.quantize_resident != "none":  # quantized once here, read per token (flashllm/modes/quant_layers.py)
            self.quantized = QuantizedLayers(st, names, self.backend, opts.quantize_resident, opts.threads,
                                             opts.aio_depth or 0)
            self.spans, self.attn_reader = self.quantized.spans, self.quantized.reader
        else:
            self.spans = []
            for layer in names:
                begin = min(st.entries[n]["data_offsets"][0] for n in layer)
                end = max(st.entries[n]["data_offsets"][1] for n in layer)
                self.spans.append((st.data_start + begin, end - begin, layer))
            self.attn_reader = FlashReader(st.path, threads=opts.threads, aio_depth=opts.aio_depth or 0)
        self.st = st
        attn_bytes = max(n for _, n, _ in self.spans)
        one_layer = attn_bytes + self.lay.d_ffn * self.lay.stride
        if self.buffers > 1 and ctx.budget is not None and ctx.charged(2 * one_layer, self.backend.nbytes() +
                                                                       self.device_bytes()) > ctx.budget:
            self.buffers = 1  # no room to read a layer ahead: one buffer, as without read-ahead
        self.attn_bufs = [self.backend.host_buffer((attn_bytes,)) for _ in range(self.buffers)]
        self.ffn_bufs = [self.backend.host_buffer((self.lay.d_ffn, self.lay.stride)) for _ in range(self.buffers)]
        what = "embeddings, KV cache and " + ("two layers' weights (one read ahead)" if self.buffers > 1 else
                                              "one layer's weights")
        ctx.check_fits(ctx.charged(self.host_bytes(), self.backend.nbytes() + self.device_bytes()), what)

    def _start(self, layer: int) -> None:
        """Start reading `layer`'s resident tensors and FFN into its buffers (once)."""
        if layer in self._inflight or layer >= len(self.spans):
            return
        offset, nbytes, _ = self.spans[layer]
        i, n = layer % self.buffers, self.lay.d_ffn
        resident = self.attn_reader.submit_range(offset, nbytes, self.attn_bufs[i])
        self._inflight[layer] = LayerReads(self.reader.submit(layer, np.arange(n), self.ffn_bufs[i], np.arange(n)),
                                           resident)

    def before_layer(self, layer: int, cost) -> None:
        """Make this layer's resident tensors (attention, norms, biases) live; start reading the next layer."""
        self._start(layer)
        offset, nbytes, names = self.spans[layer]
        with cost.timed("io_ms"):
            io = self._inflight[layer].resident.wait()
            cost.add_io(io)
            self.ctx.hooks.emit("read", io)
        if self.buffers > 1:
            self._start(layer + 1)
        buf = self.attn_bufs[layer % self.buffers]
        with cost.timed("mem_ms"):
            if self.quantized is not None:
                self.quantized.place(layer, buf)
                return
            base = offset - self.st.data_start
            for name in names:
                e = self.st.entries[name]
                b, en = e["data_offsets"]
                self.backend.put_bytes(name, buf[b - base:en - base], self.st.dtype(name), e["shape"])

    def ffn(self, layer: int, x, cost):
        self._start(layer)
        ffn_read = self._inflight.pop(layer).ffn
        rows = self.wait_rows(ffn_read, self.ffn_bufs[layer % self.buffers], self.lay.d_ffn, cost)
        b = self.ctx.biases(layer)
        return self.backend.ffn(x, rows, b["up"], b["gate"], b["down"])

    def after_layer(self, layer: int) -> None:
        for name in self.spans[layer][2]:  # the layer's weights do not stay resident
            self.backend.w.pop(name, None)

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.attn_bufs + self.ffn_bufs)

    def device_bytes(self) -> int:
        """The one layer whose weights are live at a time."""
        return self.ctx.max_layer_bytes()


class HybridMode(StreamingMode):
    """The first `resident_rows` neurons of each FFN stay resident; the rest is re-read densely per token."""

    summary = "part of each FFN resident, the rest read densely per token"

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        lay, L, budget = self.lay, ctx.spec.n_layers, ctx.budget
        row = ctx.row_bytes()
        base = ctx.charged(lay.d_ffn * lay.stride, self.backend.nbytes())  # + one layer's read buffer
        # L*resident_rows resident rows + the streamed rows of one layer, live while it computes
        avail = None if budget is None else budget - base - lay.d_ffn * row
        if avail is not None and avail < 0 and ctx.options.hybrid_fraction is None:
            raise ctx.too_small(base + lay.d_ffn * row, "resident weights, KV cache and one layer's streamed FFN")
        ahead = ctx.charged(lay.d_ffn * lay.stride, 0)  # a second read buffer, to read a layer ahead
        if self.buffers > 1 and avail is not None and avail - ahead < 0:
            self.buffers = 1
        elif self.buffers > 1 and avail is not None:
            avail -= ahead
        self.resident_rows = budget_mod.hybrid_resident_rows(avail, row, L, lay.d_ffn, ctx.options.hybrid_fraction)
        h = self.resident_rows
        pack = ctx.backend.pack_ffn
        self.resident = [pack(ctx.bundle_rows(ctx.read_layer_block(i, h), keep_quantized=True)) for i in range(L)] if h else []
        self.bufs = [self.backend.host_buffer((lay.d_ffn - h, lay.stride)) for _ in range(self.buffers)] \
            if h < lay.d_ffn else []

    def _start(self, layer: int) -> None:
        """Start reading `layer`'s streamed neurons into its buffer (once)."""
        h, n = self.resident_rows, self.lay.d_ffn
        if self.bufs and layer not in self._inflight and layer < len(self.lay.layer_offsets):
            buf = self.bufs[layer % self.buffers]
            self._inflight[layer] = LayerReads(self.reader.submit(layer, np.arange(h, n), buf, np.arange(n - h)))

    def ffn(self, layer: int, x, cost):
        B = self.backend
        b = self.ctx.biases(layer)
        up_b, gate_b, down_b = b["up"], b["gate"], b["down"]
        h, n = self.resident_rows, self.lay.d_ffn

        def part(b, lo, hi):
            return None if b is None else b[lo:hi]

        y = B.ffn(x, self.resident[layer], part(up_b, 0, h), part(gate_b, 0, h), down_b) if h else None
        if h < n:
            self._start(layer)
            pending = self._inflight.pop(layer).ffn
            if self.buffers > 1:
                self._start(layer + 1)
            rows = self.wait_rows(pending, self.bufs[layer % self.buffers], n - h, cost)
            rest = B.ffn(x, rows, part(up_b, h, n), part(gate_b, h, n), None if y is not None else down_b)
            y = rest if y is None else y + rest
        return y

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)

    def describe(self) -> dict:
        return {"resident_neurons": self.resident_rows}

    def device_bytes(self) -> int:
        """Resident rows plus the streamed rows of the layer being computed."""
        B = self.backend
        return sum(B.nbytes_of(t) for rows in self.resident for t in rows.values()) + \
            (self.lay.d_ffn - self.resident_rows) * self.ctx.row_bytes()


# Every mode, by the name the API and the CLI use; each mode's docstring line is its description.
MODES = {"dense": DenseMode, "naive": NaiveMode, "hybrid": HybridMode, "sparse": SparseMode}
