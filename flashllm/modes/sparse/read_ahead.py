"""The sparse mode's read-ahead: layer l+1's likely neurons, predicted from layer l's residual stream, read
while layer l computes.

`SparseMode` owns one read-ahead object, chosen at load by `make_read_ahead`: `RowsReadAhead` reads into
the rows the layer's cache frees for them (no budget, no copy), `BufferReadAhead` into a buffer of its own
(placed into the cache once the layer knows its set), `NoReadAhead` reads nothing. All three measure the
early prediction the same way (its recall, and the running precision of each score cut that decides how
much of it is worth reading), so the stats describe them alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashllm import budget as budget_mod
from flashllm.modes.sparse.predictor import predict_scored, union
from flashllm.stats import ReadAheadCounts


@dataclass
class InFlight:
    """A read started ahead of one layer, and the early prediction that chose it."""

    layer: int
    ids: np.ndarray  # neurons read ahead (ascending)
    predicted: np.ndarray  # the early prediction's whole set
    levels: np.ndarray  # [cuts, d_ffn]: the early prediction's sets above each cut
    read: object | None  # the read in flight (a PendingRead); None: nothing was read
    rows: np.ndarray | None  # the cache rows it lands in; None: the read-ahead buffer


def wants_read_ahead(ctx, reader, in_place: bool) -> str:
    """At load, before the budget is shared out: "rows" (read into the rows a cache frees), "buffer" or
    "off". By default on only where reads land in cache rows through native AIO, the measured default
    (docs/architecture.md, "Defaults"); `read_ahead=True` asks for it anywhere."""
    option = ctx.options.read_ahead
    on = ctx.spec.n_layers > 1 and (option is True or option is None and in_place and reader.io.engine == "aio")
    return "off" if not on else "rows" if in_place else "buffer"


def buffer_rows(layout, n_layers: int, avail: int | None, row: int, need: list[float] | None) -> int:
    """Rows of `BufferReadAhead`'s buffer: the largest per-layer predicted set when the predictor knows it,
    from what is left once every cache holds its layer's predicted set (the caches come first: a smaller
    cache drops neurons); else one layer's share of the cache budget."""
    if need:
        want = [min(layout.d_ffn, math.ceil(f * layout.d_ffn)) for f in need]
        return max(want) if avail is None else min(max(want), max(0, avail - sum(want) * row) // layout.stride)
    if avail is None:
        return layout.d_ffn
    return min(budget_mod.sparse_capacities(avail, row, n_layers + 1, layout.d_ffn, None)) * row // layout.stride


class ReadAhead:
    """What every read-ahead shares: the early prediction and its measurement per layer.

    A layer reads ahead only the part of its early prediction that is likely right: the neurons scored above the
    lowest of CUTS (score above the predictor's threshold, logits for the low-rank predictors) whose running
    precision against the layer's own set is at least `precision`; the rest is read when the layer knows its
    set (wrong guesses cost reads and evict needed rows)."""

    kind = "off"
    PRECISION = 0.9
    CUTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    # reading into cache rows keeps the cached neurons the early prediction scores above this (likely needed)
    KEEP = -1.0
    EMA = 0.3  # weight of the newest token in the running shares

    def __init__(self, caches: list, predictor, reader, backend, window: int, layout, norm: str,
                 precision: float | None = None):
        self.caches, self.predictor, self.reader, self.backend = caches, predictor, reader, backend
        self.window, self.layout, self.norm = window, layout, norm  # `norm`: the norm that makes an FFN input
        self.precision = self.PRECISION if precision is None else precision  # LoadOptions.read_ahead_precision
        self.residual = None  # the residual stream the current layer's FFN input came from (decode)
        self.pending: InFlight | None = None
        # per layer and cut: running neurons the early prediction named above the cut, and of those the layer needed
        # (a prior of precision 1: a layer reads ahead until measured otherwise)
        self.named = np.ones((len(caches), len(self.CUTS)))
        self.right = np.ones((len(caches), len(self.CUTS)))
        self._cuts = np.asarray(self.CUTS, dtype=np.float32)[:, None]  # (exact: compared with float32 scores)

    rows = 0  # rows of the read-ahead buffer

    def host_bytes(self) -> int:
        return 0

    def describe(self) -> dict:
        L = len(self.caches)
        return {"read_ahead_rows": self.rows, "read_ahead": self.kind,
                "read_ahead_cut": [self.cut(i) for i in range(L)],
                "read_ahead_paused": [i for i in range(L) if self.cut(i) is None]}

    def cut(self, layer: int) -> int | None:
        """The lowest of CUTS whose running precision clears `precision` (an index), None: none."""
        ok = np.flatnonzero(self.right[layer] >= self.precision * self.named[layer])
        return int(ok[0]) if len(ok) else None

    # -- per token ---------------------------------------------------------------------------------
    def observe(self, residual, cost) -> None:
        """Before a layer's FFN: the residual stream its input was normed from (decode only), and a poll."""
        self.residual = residual if residual.shape[0] == cost.batch else None  # decode (one sequence or a batch)
        self.poll(cost)

    def poll(self, cost) -> None:
        """Reap completed reads without waiting (at sublayer boundaries): the read time then ends near when
        the disk finished, not when the layer waits for it (native AIO's reads are counted until reaped).
        Reaping is I/O (io_ms)."""
        if self.pending is not None and self.pending.read is not None:
            with cost.timed("io_ms"):
                self.pending.read.done()

    def start(self, layer: int, cost) -> None:
        """Predict `layer`'s neurons from the previous layer's residual stream (normed as `layer` norms its
        FFN input) and start reading those above the layer's cut that are not cached; `finish` of `layer`
        waits for them."""
        if self.residual is None or layer >= len(self.caches):
            return
        self.drop()
        cache = self.caches[layer]
        with cost.timed("predictor_ms"), self.backend.untimed_parts():  # the early prediction and its guess
            x = self.backend.norm(f"layers.{layer}.{self.norm}", self.residual)
            mask, scores = union(*predict_scored(self.predictor, layer, x))
            levels = scores[None, :] > self._cuts if scores is not None else \
                np.broadcast_to(mask, (len(self.CUTS), len(mask)))  # without scores: one set at every cut
            cut = self.cut(layer)
            guess = np.flatnonzero(levels[cut]) if cut is not None else np.flatnonzero(mask)[:0]
            if len(guess) > cache.capacity:  # `SparseMode._fit` keeps the `capacity` best: read no others
                best = np.argsort(-scores[guess], kind="stable")[:cache.capacity] if scores is not None else \
                    np.arange(cache.capacity)
                guess = np.sort(guess[best])
        ids, read, rows = self._submit(layer, guess, scores, cost)
        self.pending = InFlight(layer, ids, np.flatnonzero(mask), levels, read, rows)
        cost.neurons_read_ahead += len(ids)

    def _submit(self, layer: int, guess: np.ndarray, scores, cost) -> tuple:
        """(ids, read, rows) of the read started for `guess` (nothing likely enough when empty)."""
        return guess, None, None

    def landing(self, layer: int, cost) -> bool:
        """Whether a read ahead of `layer` into its cache rows is still in flight (reaps without waiting)."""
        p = self.pending
        if p is None or p.layer != layer or p.rows is None or p.read is None:
            return False
        with cost.timed("io_ms"):
            return not p.read.done()

    def finish(self, layer: int, active: np.ndarray, counts: ReadAheadCounts | None, cost) -> int:
        """Wait for the read ahead of `layer` once its true set `active` is known, and measure the early prediction
        (`counts`: this decode layer's record, None in a prompt). Returns how many neurons read ahead into
        cache rows the layer needs (they are held from now on; the others leave at its eviction)."""
        p = self.pending
        if p is None or p.layer != layer:
            self.drop()
            return 0
        if p.read is not None:
            with cost.timed("io_ms"):
                cost.add_io(p.read.wait())
        with cost.timed("predictor_ms"):  # the early prediction's recall and running precision per cut
            needed = np.zeros(p.levels.shape[1], dtype=bool)  # (a mask: no sorting, unlike np.isin)
            needed[active] = True
            if counts is not None:
                counts.found, counts.active, counts.named = np.count_nonzero(needed[p.predicted]), len(active), \
                    len(p.predicted)
            named, right = np.count_nonzero(p.levels, axis=1), np.count_nonzero(p.levels[:, active], axis=1)
            self.named[layer] += self.EMA * (named - self.named[layer])
            self.right[layer] += self.EMA * (right - self.right[layer])
        if p.rows is None:
            return 0  # in the buffer: `place` places what the layer needs
        self.pending = None
        cache = self.caches[layer]
        cache.store.placed(p.ids, p.rows, cost)  # (times its own placing)
        with cost.timed("mem_ms"):
            cache.append(p.ids)
        used = int(needed[p.ids].sum())
        self._count(len(p.ids) - used, used, counts, cost)
        return used

    def place(self, layer: int, missing: np.ndarray, counts: ReadAheadCounts | None, cost) -> np.ndarray:
        """After eviction: the `missing` neurons still to read (a buffer places those it holds first)."""
        return missing

    def _count(self, unused: int, used: int, counts: ReadAheadCounts | None, cost) -> None:
        cost.read_ahead_unused += unused
        cost.bytes_wasted += unused * self.layout.stride  # read ahead for nothing
        if counts is not None:
            counts.used = used

    def drop(self) -> None:
        """Wait for a read ahead that will not be used (its rows or buffer are about to be reused)."""
        if self.pending is not None:
            if self.pending.read is not None:
                self.pending.read.wait()
            self.pending = None


class NoReadAhead(ReadAhead):
    """No reads ahead: every layer reads what it needs when it knows its set."""

    def start(self, layer: int, cost) -> None:
        pass


class RowsReadAhead(ReadAhead):
    """Reads into the rows the layer's cache frees for them by its window rule (`NeuronCache.reserve`),
    keeping the cached neurons the early prediction scores above KEEP."""

    kind = "into cache rows"

    def _submit(self, layer: int, guess: np.ndarray, scores, cost) -> tuple:
        if not len(guess):  # nothing likely enough: only measure the early prediction
            return guess, None, guess
        cache = self.caches[layer]
        keep = np.flatnonzero(scores > self.KEEP) if scores is not None else guess
        with cost.timed("mem_ms"):
            ids = cache.reserve(guess, self.window, keep)
            rows = cache.free_rows(len(ids))
        with cost.timed("io_ms"):  # building and submitting the requests is I/O, not compute
            read = self.reader.submit(layer, ids, cache.store.landing(), rows)
        return ids, read, rows


class BufferReadAhead(ReadAhead):
    """Reads into a host buffer of `rows` bundles; `place` moves the neurons the layer needs into its cache."""

    kind = "via a buffer"

    def __init__(self, *args, rows: int, **kw):
        super().__init__(*args, **kw)
        self.rows = rows
        self.buffer = self.backend.host_buffer((rows, self.layout.stride))

    def host_bytes(self) -> int:
        return self.rows * self.layout.stride

    def _submit(self, layer: int, guess: np.ndarray, scores, cost) -> tuple:
        if not len(guess):
            return guess, None, None
        ids = guess[self.caches[layer].row_of[guess] < 0]
        if len(ids) > self.rows:  # the highest-scored ones fit
            keep = np.argsort(-scores[ids], kind="stable")[:self.rows] if scores is not None else \
                np.arange(self.rows)
            ids = np.sort(ids[keep])
        with cost.timed("io_ms"):
            read = self.reader.submit(layer, ids, self.buffer, np.arange(len(ids)))
        return ids, read, None

    def place(self, layer: int, missing: np.ndarray, counts: ReadAheadCounts | None, cost) -> np.ndarray:
        p = self.pending
        if p is None or p.layer != layer:
            return missing
        self.pending = None
        ids = p.ids
        pos = np.searchsorted(ids, missing)
        hit = (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == missing) if len(ids) else \
            np.zeros(len(missing), dtype=bool)
        cache = self.caches[layer]
        n = int(hit.sum())
        cache.store.place(self.buffer, pos[hit], missing[hit], cache.free_rows(n), cost)
        cache.append(missing[hit])
        self._count(len(ids) - n, n, counts, cost)
        return missing[~hit]


def make_read_ahead(kind: str, buffer_rows: int, *args, precision: float | None = None) -> ReadAhead:
    """The read-ahead object of `kind` ("rows", "buffer", "off"); a buffer of no rows reads nothing ahead.
    `precision`: the running precision a score cut must clear (None: ReadAhead.PRECISION)."""
    if kind == "rows":
        return RowsReadAhead(*args, precision=precision)
    if kind == "buffer" and buffer_rows:
        return BufferReadAhead(*args, rows=buffer_rows, precision=precision)
    return NoReadAhead(*args, precision=precision)
