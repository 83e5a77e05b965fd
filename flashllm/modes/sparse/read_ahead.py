"""The sparse mode's read-ahead: layer l+1's likely neurons, predicted from l's residual, read while l computes."""

from __future__ import annotations

import math

import numpy as np

from flashllm import budget as budget_mod
from flashllm.modes.sparse.predictor import predict_scored, union


class ReadAhead:
    """A part of `SparseMode` (flashllm/modes/sparse/mode.py): the lookahead's prediction, its reads (into the rows a cache frees
    for them, or into a buffer of its own), their completion and placing, and the running precision per layer
    that decides how much of a lookahead set is worth reading. Uses the mode's caches, predictor, reader, window
    and layout."""

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

    def _want_read_ahead(self, in_place: bool) -> None:
        """At load, before the budget is shared out: whether to read ahead, and into cache rows or a buffer."""
        ctx, options = self.ctx, self.ctx.options
        # read-ahead (layer l+1's lookahead set read while layer l computes): straight into the rows its cache
        # frees for them where reads land in cache rows (no budget, no copy), else into a buffer of its own; by
        # default only into cache rows through native AIO, where it measured faster (reader threads and the
        # buffer's copy take the cores the compute needs: bench/results/io_runtime_7b.md)
        self.read_ahead = ctx.spec.n_layers > 1 and (options.prefetch is True or options.prefetch is None and
                                                     in_place and self.reader.io.engine == "aio")
        self.ahead_in_place = self.read_ahead and in_place

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

    def _start_read_ahead(self) -> None:
        """At load, once the caches are sized: the read-ahead buffer of `prefetch_rows` rows and the running state."""
        ctx, L = self.ctx, self.ctx.spec.n_layers
        self.prefetch_buf = self.backend.host_buffer((self.prefetch_rows, self.lay.stride)) if self.prefetch_rows \
            else None
        self.read_ahead = self.read_ahead and (self.ahead_in_place or self.prefetch_buf is not None)
        self._residual = None  # the residual stream the current layer's FFN input came from (decode)
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

