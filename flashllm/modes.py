"""How layer weights are obtained per token: dense, naive, hybrid or sparse (the only difference).

Each plan is built from a `PlanContext` (layout, backend, FFN reader, budget, options), answers
`ffn(layer, x, cost)`, may load weights around a layer (`before_layer`, `after_layer`) and reports
its own memory (`host_bytes`, `device_bytes`) and stats (`describe`); the model's per-token path is
the same for all of them.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from . import budget as budget_mod
from .budget import split_rows  # noqa: F401  (re-exported: cache sizing lives in budget)
from .flashio import FlashReader
from .neuron_cache import NeuronCache, pinned_rows
from .errors import FlashLLMError
from .plan_context import PlanContext
from .predictor import PREDICTOR_FILE, make_predictor, predict_scored
from .quant_layers import QuantizedLayers
from .st_io import SafetensorsFile


class Plan:
    """The plan protocol, with the defaults of a plan that loads nothing around a layer."""

    summary = ""  # one line for --help
    predictor = None  # the sparse plans' predictor

    def __init__(self, ctx: PlanContext):
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

    def host_bytes(self) -> int:
        """Host memory held: read buffers (counted against the DRAM budget on a GPU)."""
        return 0

    def device_bytes(self) -> int:
        """Memory held beside the backend's resident weights and KV cache: FFN rows, caches, predictors."""
        return 0

    def describe(self) -> dict:
        """What this plan adds to `Model.stats`."""
        return {}


class DensePlan(Plan):
    """Every FFN weight resident: the correctness reference."""

    summary = "all weights resident (the reference)"

    def __init__(self, ctx: PlanContext):
        super().__init__(ctx)
        pack = ctx.backend.pack_ffn
        self.rows = [pack(ctx.bundle_rows(ctx.read_layer_block(i), keep_quantized=True)) for i in range(ctx.spec.n_layers)]
        ctx.check_fits(ctx.charged(0, self.backend.nbytes() + self.device_bytes()), "all weights and the KV cache")

    def ffn(self, layer: int, x, cost):
        b = self.ctx.biases(layer)
        return self.backend.ffn(x, self.rows[layer], b["up"], b["gate"], b["down"])

    def device_bytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for rows in self.rows for t in rows.values())


class StreamingPlan(Plan):
    """Shared by the flash-reading plans: the FFN reader and a dense read of neuron ranges."""

    gap_filling = False  # scattered reads: read through small gaps (the disk profile's cost model)

    def __init__(self, ctx: PlanContext):
        super().__init__(ctx)
        self.reader = ctx.ffn_reader(gap_filling=self.gap_filling, layout=getattr(self, "read_layout", None),
                                     aio_depth=getattr(self, "aio_depth", None))
        # dense plans: read layer l+1 while layer l computes (two buffers), never across tokens
        self.buffers = 2 if ctx.options.prefetch is not False and ctx.spec.n_layers > 1 else 1
        self._inflight: dict = {}  # layer -> reads started for it

    def wait_rows(self, pending, buf: np.ndarray, n: int, cost) -> dict:
        """The first `n` neuron rows of `buf` as backend rows, once the read `pending` has filled them."""
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        with cost.timed("mem_ms"):
            return self.ctx.bundle_rows(buf[:n], keep_quantized=True)

    def reset(self) -> None:
        for reads in self._inflight.values():
            for r in reads:
                r.wait()
        self._inflight.clear()


class NaivePlan(StreamingPlan):
    """No layer weights resident: every token reads each layer's attention and FFN from flash."""

    summary = "every layer read from flash per token"

    def __init__(self, ctx: PlanContext):
        super().__init__(ctx)
        st = SafetensorsFile(ctx.manifest.path("resident"))
        names = [[n for n in st.entries if n.startswith(f"layers.{i}.")] for i in range(ctx.spec.n_layers)]
        opts, self.quantized = ctx.options, None
        if opts.quantize_resident != "none":  # quantized once here, read per token (quant_layers.py)
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
        self._inflight[layer] = (self.attn_reader.submit_range(offset, nbytes, self.attn_bufs[i]),
                                 self.reader.submit(layer, np.arange(n), self.ffn_bufs[i], np.arange(n)))

    def before_layer(self, layer: int, cost) -> None:
        """Make this layer's resident tensors (attention, norms, biases) live; start reading the next layer."""
        self._start(layer)
        offset, nbytes, names = self.spans[layer]
        with cost.timed("io_ms"):
            io = self._inflight[layer][0].wait()
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
        _, ffn_read = self._inflight.pop(layer)
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


class HybridPlan(StreamingPlan):
    """The first `resident_rows` neurons of each FFN stay resident; the rest is re-read densely per token."""

    summary = "part of each FFN resident, the rest read densely per token"

    def __init__(self, ctx: PlanContext):
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
            self._inflight[layer] = (self.reader.submit(layer, np.arange(h, n), self.bufs[layer % self.buffers],
                                                        np.arange(n - h)),)

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
            pending, = self._inflight.pop(layer)
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


class SparsePlan(StreamingPlan):
    """Predicted neurons streamed into per-layer sliding-window caches (paper §3.1-3.3)."""

    summary = "predicted neurons streamed into sliding-window caches"
    gap_filling = True

    RANDOM_READ_PENALTY = 1.5  # a bundle read costs about this much more per byte than a sequential one
    AIO_DEPTH = 2048  # native AIO reads in flight by default (a 7B layer's ~800 at once)
    # a layer reads ahead only the part of its lookahead set that is likely right: the neurons scored above
    # the lowest of AHEAD_CUTS (score above the predictor's threshold, logits for the low-rank predictors)
    # whose running precision against the layer's own set is at least AHEAD_PRECISION; the rest is read when
    # the layer knows its set. Reading the whole set of a lookahead of recall 0.67 / precision 0.53 made 7B
    # tokens 1.65x as long (wrong guesses cost reads and evicted needed rows): bench/results/io_runtime_7b.md
    AHEAD_PRECISION = 0.9
    AHEAD_CUTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    # the read-ahead's eviction keeps cached neurons the lookahead scores above this (likely needed: margin 1
    # names 0.89 of the layer's set on the embedded model, bench/results/io_lookahead.md)
    AHEAD_KEEP = -1.0
    AHEAD_EMA = 0.3  # weight of the newest token in those running shares

    def __init__(self, ctx: PlanContext):
        self.predictor = make_predictor(ctx.options.predictor, ctx)
        # a predictor holding the gate rows resident: read and cache only the other parts of each bundle
        self.resident_part = getattr(self.predictor, "resident_part", None)
        self.read_layout = ctx.layout if self.resident_part is None else \
            ctx.layout.only(tuple(p for p in ctx.layout.parts if p != self.resident_part))
        options, in_place = ctx.options, ctx.backend.reads_in_place()
        if options.aio_depth is None:  # native AIO: faster here than reader threads for sparse reads (with or
            self.aio_depth = self.AIO_DEPTH  # without read-ahead: bench/results/io_runtime_7b.md, io_pipeline.md)
        super().__init__(ctx)
        # read-ahead (layer l+1's lookahead set read while layer l computes): straight into the rows its cache
        # frees for them where reads land in cache rows (no budget, no copy), else into a buffer of its own; by
        # default only into cache rows through native AIO, where it measured faster (reader threads and the
        # buffer's copy take the cores the compute needs: bench/results/io_runtime_7b.md)
        self.read_ahead = ctx.spec.n_layers > 1 and (options.prefetch is True or options.prefetch is None and
                                                     in_place and self.reader.io.engine == "aio")
        self.ahead_in_place = self.read_ahead and in_place
        self.lay = self.read_layout
        budget = ctx.budget
        self.window, self.on_overflow = options.window, options.on_overflow
        lay, L, B = self.lay, ctx.spec.n_layers, self.backend
        need = getattr(self.predictor, "expected_fraction", lambda: None)()
        base = ctx.charged(B.staging_bytes(lay.stride), B.nbytes() + self.predictor.nbytes())
        row = ctx.row_bytes(lay)
        avail = None if budget is None else budget - base
        if avail is not None and avail < L * row:
            raise ctx.too_small(base + L * row,
                                "resident weights, KV cache, staging, predictors and one cached neuron per layer")
        self.prefetch_rows = self._prefetch_rows(avail, row, need) if self.read_ahead and not self.ahead_in_place \
            else 0
        if avail is not None:
            avail -= ctx.charged(self.prefetch_rows * lay.stride, 0)
        self.capacities = budget_mod.sparse_capacities(avail, row, L, lay.d_ffn, need) if options.cache_rows is None \
            else budget_mod.given_capacities(options.cache_rows, avail, row, L, lay.d_ffn)
        self.prefetch_buf = B.host_buffer((self.prefetch_rows, lay.stride)) if self.prefetch_rows else None
        self.read_ahead = self.read_ahead and (self.ahead_in_place or self.prefetch_buf is not None)
        self._residual = None  # the residual stream the current layer's FFN input came from (decode)
        # overlap inside a layer: a decode layer's FFN over its held rows while its missing rows are read into
        # the others (where reads land in cache rows and the backend computes row subsets without copying them)
        self.split = options.prefetch is not False and in_place and B.ffn_index_in_place()
        self._landing = None  # (neuron ids, cache rows, read in flight) of the layer being computed
        # (layer, neuron ids read ahead, lookahead set, read in flight or None, cache rows it lands in or None:
        # prefetch_buf, the lookahead's sets above each cut)
        self._pending = None
        # per layer and cut: running neurons the lookahead named above the cut, and of those the layer needed
        # (a prior of precision 1: a layer reads ahead until measured otherwise)
        self.ahead_named = np.ones((L, len(self.AHEAD_CUTS)))
        self.ahead_right = np.ones((L, len(self.AHEAD_CUTS)))
        self._cuts = np.asarray(self.AHEAD_CUTS, dtype=np.float32)[:, None]  # (exact: compared with float32 scores)
        par = ctx.spec.parallel_attn and not ctx.spec.ffn_norm
        self._norm = "attn_norm" if par else "ffn_norm"  # the norm that makes a layer's FFN input
        if not getattr(self.predictor, "selective", True) and min(self.capacities) < lay.d_ffn:
            raise FlashLLMError(
                f"predictor {self.predictor.kind!r} marks every neuron of this {ctx.spec.activation} FFN active "
                f"(a dense activation), but at this budget a layer's cache holds {min(self.capacities)} of "
                f"{lay.d_ffn} neurons: sparse mode would silently drop most of the FFN. Use --mode hybrid or "
                f"naive, an unlimited --dram-budget, or make the FFN sparse by calibrated thresholds whose cost is "
                f"measured and stated (`flashllm predictors train MODEL --data TEXT --sparsity 0.4`)")
        if avail is not None and need:
            self._warn_if_short(base, row, need)
        # calibrated thresholds (SiLU/GELU): cached neurons below their layer's threshold contribute zero
        self.ffn_thresholds = ctx.sparsity.thresholds if ctx.sparsity else [None] * L
        if ctx.sparsity:  # a principled drop, but a change of the result all the same: say so
            warnings.warn(ctx.sparsity.describe(ctx.spec.activation), RuntimeWarning, stacklevel=4)
        self.caches = []
        for i, capacity in enumerate(self.capacities):
            b = ctx.biases(i)
            store = B.row_store(capacity, lay, {p: b[p] for p in ("up", "gate") if p in lay.parts})
            self.caches.append(NeuronCache(capacity, lay.d_ffn, store, compact=not B.ffn_index_in_place()))
        self._pin_hot()

    def _pin_hot(self) -> None:
        """PowerInfer's hot neurons: with `pin_hot` and the activation frequencies `predictors train` saved,
        each cache holds its layer's most frequent neurons for good, as many as leave the window room
        for its expected need (neuron_cache.pinned_rows); the window caches the rest."""
        freqs = activation_frequencies(self.ctx) if self.ctx.options.pin_hot else None
        if freqs is None:
            return
        for i, (cache, f) in enumerate(zip(self.caches, freqs)):
            h = pinned_rows(f, cache.capacity, self.window)
            if h:
                cache.pin(np.argsort(-f, kind="stable")[:h], self.reader.reader_for(i))  # most frequent first

    def _prefetch_rows(self, avail: int | None, row: int, need: list[float] | None) -> int:
        """Rows of the lookahead's read buffer: the largest per-layer predicted set when the predictor
        knows it, from what is left once every cache holds its layer's predicted set (the caches come
        first: a smaller cache drops neurons); else one layer's share of the cache budget."""
        lay, L = self.lay, len(self.ctx.layout.layer_offsets)
        if need:
            want = [min(lay.d_ffn, math.ceil(f * lay.d_ffn)) for f in need]
            return max(want) if avail is None else min(max(want), max(0, avail - sum(want) * row) // lay.stride)
        if avail is None:
            return lay.d_ffn
        return min(budget_mod.sparse_capacities(avail, row, L + 1, lay.d_ffn, None)) * row // lay.stride

    def _warn_if_short(self, base: int, row: int, need: list[float]) -> None:
        """At load: caches smaller than their layer's mean predicted set per token drop predicted
        neurons on most tokens, which costs quality; say so with the numbers and the budget that avoids it."""
        want = [math.ceil(f * self.lay.d_ffn) for f in need]
        short = [(i, c, w) for i, (c, w) in enumerate(zip(self.capacities, want)) if c < w]
        if not short:
            return
        i, c, w = max(short, key=lambda s: s[2] - s[1])
        option, budget, opts = self.ctx.budget_option, self.ctx.budget, self.ctx.options
        enough = budget_mod.format_size(base + sum(want) * row)
        over = sum(w - c for _, c, w in short)
        if opts.batch_size > 1:  # a batch's union that does not fit is streamed through the rows, never dropped
            then = "batch steps whose predicted neurons exceed a cache stream them through its rows (exact, slower)"
        elif opts.on_overflow == "error":
            then = f"tokens predicting more than a cache holds (about {over} neurons per token over) are refused"
        else:
            then = (f"about {over} predicted neurons per token will be dropped, at a quality cost that `flashllm "
                    f"predictors eval MODEL --data TEXT {option} ...` measures")
        warnings.warn(f"{option} {budget_mod.format_size(budget)}: {len(short)} of {len(want)} layer caches hold fewer "
                      f"neurons than their predictors select per token on average (layer {i}: {c} for {w}), so "
                      f"{then}; {option} {enough} avoids it", RuntimeWarning, stacklevel=4)

    def describe(self) -> dict:
        sparsity = self.ctx.sparsity
        return {"window": self.window, "cache_capacity": self.capacities, "predictor": self.predictor.kind,
                "pinned_neurons": [c.pinned for c in self.caches],
                "gap_bytes": self.reader.io.gap_bytes, "prefetch_rows": self.prefetch_rows,
                "read_ahead": ("into cache rows" if self.ahead_in_place else "via a buffer") if self.read_ahead else "off",
                "read_ahead_cut": [self._cut(i) for i in range(len(self.caches))],
                "read_ahead_paused": [i for i in range(len(self.caches)) if self._cut(i) is None],
                **({"activation_sparsity": sparsity.to_stats()} if sparsity else {})}

    @property
    def capacity(self) -> int:
        """The largest per-layer cache (all equal unless the predictor knows per-layer needs)."""
        return max(self.capacities)

    def reset(self) -> None:
        self._drop_prefetch()
        if self._landing is not None:  # a layer left before its read was waited for (an error)
            self._landing[2].wait()
            self._landing = None
        for c in self.caches:
            c.reset()

    def before_ffn(self, layer: int, residual, cost) -> None:
        self._residual = residual if residual.shape[0] == cost.batch else None  # decode (one sequence or a batch)
        self._poll(cost)

    def _poll(self, cost) -> None:
        """Reap the read-ahead's completed reads without waiting (at sublayer boundaries): its read time
        then ends near when the disk finished, not when the layer waits for it (native AIO's reads are
        counted until reaped). Reaping is I/O (io_ms)."""
        if self._pending is not None and self._pending[3] is not None:
            with cost.timed("io_ms"):
                self._pending[3].done()

    def _load(self, layer: int, active: np.ndarray, window: int, cost, split: bool = False) -> int:
        """One cache step: evict outside the window, then read the missing bundles into free rows
        (those the lookahead already read into cache rows are held by then; those it read into the
        prefetch buffer are placed from there). `split`: only start that read, into the rows
        themselves (`_compute_split` waits for it). Returns the needed neurons loaded, read ahead or now."""
        cache = self.caches[layer]
        ahead = self._finish_prefetch(layer, active, cost)
        with cost.timed("mem_ms"):
            missing, _, _ = cache.evict(active, window)
        rest = self._use_prefetch(layer, missing, cost)
        if split and len(rest):
            rows = cache.free_rows(len(rest))
            with cost.timed("io_ms"):  # building and submitting the requests is I/O
                self._landing = (rest, rows, self.reader.submit(layer, rest, cache.store.landing(), rows))
            return len(missing) + ahead
        io = cache.insert(rest, self.reader.reader_for(layer), cost)
        if io is not None:
            cost.add_io(io)
        return len(missing) + ahead

    def _cut(self, layer: int) -> int | None:
        """The lowest of AHEAD_CUTS whose running precision clears AHEAD_PRECISION (an index), None: none."""
        ok = np.flatnonzero(self.ahead_right[layer] >= self.AHEAD_PRECISION * self.ahead_named[layer])
        return int(ok[0]) if len(ok) else None

    def _levels(self, mask: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        """The lookahead's sets above each cut [cuts, n]; a predictor without scores names one set (all cuts)."""
        if scores is None:
            return np.broadcast_to(mask, (len(self.AHEAD_CUTS), len(mask)))
        return scores[None, :] > self._cuts

    def _lookahead(self, layer: int, cost) -> None:
        """Predict `layer`'s neurons from the previous layer's residual stream (normed as `layer` norms
        its FFN input) and start reading those above the layer's cut (`_cut`) that are not cached: into
        the rows the cache frees for them by its window rule, keeping the neurons it scores above
        AHEAD_KEEP (`NeuronCache.reserve`), or into the prefetch buffer; `_load` of `layer` waits and
        corrects."""
        if not self.read_ahead or self._residual is None or layer >= len(self.caches):
            return
        self._drop_prefetch()
        cache = self.caches[layer]
        with cost.timed("predictor_ms"), self.backend.untimed_parts():  # the lookahead and its guess
            x = self.backend.norm(f"layers.{layer}.{self._norm}", self._residual)
            mask, scores = union(*predict_scored(self.predictor, layer, x))
            levels, cut = self._levels(mask, scores), self._cut(layer)
            guess = np.flatnonzero(levels[cut]) if cut is not None else np.flatnonzero(mask)[:0]
            if len(guess) > cache.capacity:  # `_fit` keeps the `capacity` best (as ranked there): read no others
                best = np.argsort(-scores[guess], kind="stable")[:cache.capacity] if scores is not None else \
                    np.arange(cache.capacity)
                guess = np.sort(guess[best])
        if not len(guess):  # nothing likely enough: only measure the lookahead
            ids, pending, rows = guess, None, guess if self.ahead_in_place else None
        elif self.ahead_in_place:
            keep = np.flatnonzero(scores > self.AHEAD_KEEP) if scores is not None else guess
            with cost.timed("mem_ms"):
                ids = cache.reserve(guess, self.window, keep)
                rows = cache.free_rows(len(ids))
            with cost.timed("io_ms"):  # building and submitting the requests is I/O, not compute
                pending = self.reader.submit(layer, ids, cache.store.landing(), rows)
        else:
            ids, rows = guess[cache.row_of[guess] < 0], None
            if len(ids) > self.prefetch_rows:  # the highest-scored ones fit
                keep = np.argsort(-scores[ids], kind="stable")[:self.prefetch_rows] if scores is not None else \
                    np.arange(self.prefetch_rows)
                ids = np.sort(ids[keep])
            with cost.timed("io_ms"):
                pending = self.reader.submit(layer, ids, self.prefetch_buf, np.arange(len(ids)))
        self._pending = (layer, ids, np.flatnonzero(mask), pending, rows, levels)
        cost.neurons_prefetched += len(ids)

    def _finish_prefetch(self, layer: int, active: np.ndarray, cost) -> int:
        """Wait for the read ahead of `layer` (once its true set `active` is known) and count the
        lookahead's recall and each cut's precision; read into cache rows, its neurons are held from now
        on. Returns how many of them the layer needs (those it does not are counted as wasted and leave
        at its eviction)."""
        if self._pending is None or self._pending[0] != layer:
            self._drop_prefetch()
            return 0
        _, ids, predicted, pending, rows, levels = self._pending
        if pending is not None:
            with cost.timed("io_ms"):
                cost.add_io(pending.wait())
        with cost.timed("predictor_ms"):  # the lookahead's recall and running precision per cut
            needed = np.zeros(levels.shape[1], dtype=bool)  # (a mask: no sorting, unlike np.isin)
            needed[active] = True
            if len(cost.lookahead_active) > layer:  # decode: the recall of the lookahead vs this prediction
                cost.lookahead_found[layer] = np.count_nonzero(needed[predicted])
                cost.lookahead_active[layer], cost.lookahead_named[layer] = len(active), len(predicted)
            named, right = np.count_nonzero(levels, axis=1), np.count_nonzero(levels[:, active], axis=1)
            self.ahead_named[layer] += self.AHEAD_EMA * (named - self.ahead_named[layer])
            self.ahead_right[layer] += self.AHEAD_EMA * (right - self.ahead_right[layer])
        if rows is None:
            return 0  # in the prefetch buffer: `_use_prefetch` places what the layer needs
        self._pending = None
        cache = self.caches[layer]
        cache.store.placed(ids, rows, cost)  # (times its own placing)
        with cost.timed("mem_ms"):
            cache.append(ids)
        unused = len(ids) - int(needed[ids].sum())
        cost.prefetch_unused += unused
        cost.bytes_wasted += unused * self.lay.stride  # read ahead for nothing
        if len(cost.ahead_used) > layer:
            cost.ahead_used[layer] = len(ids) - unused
        return len(ids) - unused

    def _use_prefetch(self, layer: int, missing: np.ndarray, cost) -> np.ndarray:
        """Place the bundles of `missing` neurons read ahead into the prefetch buffer (waited for by
        `_finish_prefetch`); the rest of `missing` is still to read."""
        if self._pending is None or self._pending[0] != layer:
            return missing
        ids = self._pending[1]
        self._pending = None
        pos = np.searchsorted(ids, missing)
        hit = (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == missing) if len(ids) else \
            np.zeros(len(missing), dtype=bool)
        cache = self.caches[layer]
        n = int(hit.sum())
        cache.store.place(self.prefetch_buf, pos[hit], missing[hit], cache.free_rows(n), cost)
        cache.append(missing[hit])
        cost.prefetch_unused += len(ids) - n
        if len(cost.ahead_used) > layer:
            cost.ahead_used[layer] = n
        cost.bytes_wasted += (len(ids) - n) * self.lay.stride  # read ahead for nothing
        return missing[~hit]

    def _drop_prefetch(self) -> None:
        """Wait for a read ahead that will not be used (its buffer is about to be reused)."""
        if self._pending is not None:
            if self._pending[3] is not None:
                self._pending[3].wait()
            self._pending = None

    def _fit(self, layer: int, active: np.ndarray, scores: np.ndarray | None, cost) -> np.ndarray:
        """The active set cut to the cache's capacity, keeping the highest-scored neurons; the dropped
        count and score mass are recorded (or, with on_overflow "error", refused)."""
        cache = self.caches[layer]
        if scores is not None:
            cost.predicted_mass += float(scores[active].sum())
        while cache.pinned:  # pinned neurons need no row; the others must fit the rest, else unpin the last
            rows = cache.row_of[active]
            over = int(((rows < 0) | (rows >= cache.pinned)).sum()) - (cache.capacity - cache.pinned)
            if over <= 0:
                return active
            cache.unpin(over)
        capacity = cache.capacity
        if len(active) <= capacity:
            return active
        if self.on_overflow == "error":
            raise FlashLLMError(f"layer {layer}: {len(active)} neurons predicted active but its cache holds "
                                f"{capacity}; raise --dram-budget or load with --on-overflow drop")
        order = np.argsort(-scores[active], kind="stable") if scores is not None else np.arange(len(active))
        keep, dropped = np.sort(active[order[:capacity]]), active[order[capacity:]]
        cost.neurons_dropped += len(dropped)
        if scores is not None:
            cost.dropped_mass += float(scores[dropped].sum())
        return keep

    def _compute(self, layer: int, x, n: int, with_down_bias: bool, pre=None, first: int = 0):
        """The FFN over cache rows first..n-1 (the down bias once, in the part that has it); `pre`: the
        resident gate's pre-activations of every neuron."""
        cache = self.caches[layer]
        rows, bias = cache.store.views(n)
        if first:
            rows, bias = {k: v[first:] for k, v in rows.items()}, {k: v[first:] for k, v in bias.items()}
        down_b = self.ctx.biases(layer)["down"] if with_down_bias else None
        index = None if first or n != cache.num_used else cache.held_rows()  # rows emptied and not refilled
        gate_pre = None if pre is None else self.backend.columns(pre, np.maximum(cache.pointer[first:n], 0))
        return self.backend.ffn(x, rows, bias.get("up"), bias.get("gate"), down_b, self.ffn_thresholds[layer],
                                gate_pre=gate_pre, index=index)

    def _compute_split(self, layer: int, x, pre, cost):
        """The FFN over the cache rows while the layer's missing rows are read into the others (`_load`
        with split): the rows held already, then, once the read has arrived, the new ones, summed in
        float32 and rounded once (the result of `_compute` up to float32 summation order). A row in flight
        is never read."""
        (ids, rows, pending), self._landing = self._landing, None
        cache, B = self.caches[layer], self.backend
        n = max(cache.num_used, int(rows.max()) + 1)
        held = np.flatnonzero(cache.pointer[:n] >= 0)
        views, bias = cache.store.views(n)
        gate_pre = None
        if pre is not None:  # the resident gate's pre-activations of each row's neuron
            neurons = np.maximum(cache.pointer[:n], 0)  # (rows left empty are not computed)
            neurons[rows] = ids
            gate_pre = B.columns(pre, neurons)
        acc, part = B.ffn_acc(x), (bias.get("up"), bias.get("gate"), None, self.ffn_thresholds[layer], gate_pre)
        B.ffn(x, views, *part, index=held, acc=acc)
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        cache.store.placed(ids, rows, cost)  # (sets the new rows' biases, seen through the views)
        cache.append(ids)
        B.ffn(x, views, *part, index=rows, acc=acc)
        return B.ffn_result(acc, x, self.ctx.biases(layer)["down"])

    def ffn(self, layer: int, x, cost):
        with cost.timed("predictor_ms"):
            pre = self.predictor.pre(layer, x) if self.resident_part else None
            mask, scores = predict_scored(self.predictor, layer, x, pre)
        self.ctx.hooks.emit("predict", layer, mask)
        if mask.shape[0] == cost.batch and (cost.batch == 1 or mask.any(axis=0).sum() <= self.caches[layer].capacity):
            # decode: one token, or one per sequence of a batch whose union fits the cache (a union that does
            # not fit is streamed through the cache rows like a prompt: exact, never dropped for batching)
            mask, scores = union(mask, scores)
            active = self._fit(layer, np.flatnonzero(mask), scores, cost)
            for per_layer in (cost.lookahead_found, cost.lookahead_active, cost.lookahead_named, cost.ahead_used):
                per_layer.append(0)
            cost.neurons_loaded.append(self._load(layer, active, self.window, cost, self.split and x.shape[0] == 1))
            self._lookahead(layer + 1, cost)  # in flight while this layer and the next attention compute
            y = self._compute_split(layer, x, pre, cost) if self._landing else \
                self._compute(layer, x, self.caches[layer].num_used, True, pre)
            cost.neurons_cached.append(self.caches[layer].held())
            self._poll(cost)
            return y
        return self._prefill(layer, x, mask, scores, cost, pre)

    def _prefill(self, layer: int, x, mask: np.ndarray, scores: np.ndarray | None, cost, pre=None):
        """Several tokens at once: stream the predicted union (or the whole layer, if cheaper) through
        the cache rows in chunks, then leave the cache as if the last `window` tokens were decoded (a
        prompt; a batch step whose union did not fit leaves it empty)."""
        cache, B = self.caches[layer], self.backend
        self._drop_prefetch()  # a read ahead may still be landing in this cache's free rows
        cache.reset()  # the window's rows serve as the read buffer below; pinned rows stay and are computed
        h = cache.pinned
        union = np.flatnonzero(mask.any(axis=0))
        union = union[cache.row_of[union] < 0]
        sparse_cost = len(union) * self.RANDOM_READ_PENALTY
        ids, strategy = (union, "sparse-union") if sparse_cost < self.lay.d_ffn - h else \
            (np.flatnonzero(cache.row_of < 0), "dense-stream")
        cost.prefill_strategy = strategy
        y = self._compute(layer, x, h, True, pre) if h else None
        room = cache.capacity - h
        for k in range(0, len(ids), room):  # the window's rows as a buffer: reset again below
            chunk = ids[k:k + room]
            cost.add_io(cache.store.fill(self.reader.reader_for(layer), chunk, h + np.arange(len(chunk)), cost))
            cache.pointer[h:h + len(chunk)] = chunk  # the rows' neurons (the cache is reset below)
            part = self._compute(layer, x, h + len(chunk), y is None, pre, first=h)
            y = part if y is None else B.add(y, part)
        cache.reset()
        loaded = 0
        replayed = len(mask) if cost.batch == 1 else 0  # a batch's rows are sequences, not a window of tokens
        for t in range(max(0, replayed - self.window), replayed):
            active = np.flatnonzero(mask[t])
            if len(active) > cache.capacity:  # cache state only: the output above used every predicted neuron
                active = active[np.argsort(-scores[t][active], kind="stable")[:cache.capacity]] \
                    if scores is not None else active[:cache.capacity]
            loaded += self._load(layer, np.sort(active), self.window, cost)
        cost.neurons_streamed.append(len(ids))
        cost.neurons_loaded.append(loaded)
        cost.neurons_cached.append(cache.held())
        if y is None:  # nothing predicted active: only the bias remains
            y = B.zeros_like(x)
            down_b = self.ctx.biases(layer)["down"]
            if down_b is not None:
                y = y + down_b
        return y

    def host_bytes(self) -> int:
        return self.backend.staging_bytes(self.lay.stride) + self.prefetch_rows * self.lay.stride

    def device_bytes(self) -> int:
        return sum(c.store.nbytes() for c in self.caches) + self.predictor.nbytes()


def union(mask: np.ndarray, scores: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The neurons predicted for any of the tokens of a decode step ([tokens, n] -> [n]) and, to rank
    them, each one's highest score (one token: its own mask and scores, as views)."""
    if len(mask) == 1:
        return mask[0], None if scores is None else scores[0]
    return mask.any(axis=0), None if scores is None else scores.max(axis=0)


def activation_frequencies(ctx: PlanContext) -> list[np.ndarray] | None:
    """Per layer, the share of calibration tokens each neuron was active on (`layers.{i}.freq` of the
    trained predictors); None when the model directory has none."""
    path = ctx.manifest.root / PREDICTOR_FILE
    if not path.is_file():
        return None
    st = SafetensorsFile(path)
    names = [f"layers.{i}.freq" for i in range(ctx.spec.n_layers)]
    if not all(n in st.entries and st.shape(n) == (ctx.spec.d_ffn,) for n in names):
        return None
    return [st.read(n).astype(np.float64) for n in names]


# Every mode, by the name the API and the CLI use; each plan's docstring line is its description.
PLANS = {"dense": DensePlan, "naive": NaivePlan, "hybrid": HybridPlan, "sparse": SparsePlan}
