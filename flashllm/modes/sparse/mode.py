"""The sparse mode: predicted neurons streamed from flash into per-layer sliding-window neuron caches."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from flashllm import budget as budget_mod
from flashllm.errors import DroppedNeuronsWarning, FlashLLMError, OptionsError, OptionsWarning, cli_option
from flashllm.format.safetensors_io import SafetensorsFile
from flashllm.modes.base import StreamingMode
from flashllm.modes.context import ModeContext
from flashllm.modes.sparse.neuron_cache import NeuronCache, pinned_rows
from flashllm.modes.sparse.predictor import PREDICTOR_FILE, make_predictor, predict_scored, union
from flashllm.modes.sparse.read_ahead import buffer_rows, make_read_ahead, wants_read_ahead
from flashllm.stats import ReadAheadCounts


@dataclass
class Prediction:
    """A layer's predicted neurons for the tokens of one call."""

    mask: np.ndarray  # [T, d_ffn] bool
    scores: np.ndarray | None  # [T, d_ffn] float32, where the predictor scores neurons
    pre: object | None  # the resident gate's pre-activations of every neuron (a gate predictor), else None


@dataclass
class Landing:
    """A decode layer's missing rows, read straight into its cache rows while the held rows compute."""

    ids: np.ndarray  # neurons being read
    rows: np.ndarray  # the cache rows they land in
    read: object  # the read in flight (a PendingRead)


class SparseMode(StreamingMode):
    """Predicted neurons streamed into per-layer sliding-window caches (paper §3.1-3.3)."""

    summary = "predicted neurons streamed into sliding-window caches"
    gap_filling = True

    RANDOM_READ_PENALTY = 1.5  # a bundle read costs about this much more per byte than a sequential one
    AIO_DEPTH = 2048  # native AIO reads in flight by default (a 7B layer's ~800 at once)

    def __init__(self, ctx: ModeContext):
        self.predictor = make_predictor(ctx.options.predictor, ctx)
        # a predictor holding the gate rows resident: read and cache only the other parts of each bundle
        self.resident_part = getattr(self.predictor, "resident_part", None)
        self.read_layout = ctx.layout if self.resident_part is None else \
            ctx.layout.only(tuple(p for p in ctx.layout.parts if p != self.resident_part))
        options, in_place = ctx.options, ctx.backend.reads_in_place()
        if options.aio_depth is None:  # native AIO serves sparse reads by default (docs/architecture.md, "Defaults")
            self.aio_depth = self.AIO_DEPTH
        super().__init__(ctx)
        ahead = wants_read_ahead(ctx, self.reader, in_place)
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
        ahead_rows = buffer_rows(lay, L, avail, row, need) if ahead == "buffer" else 0
        if avail is not None:
            avail -= ctx.charged(ahead_rows * lay.stride, 0)
        self.capacities = budget_mod.sparse_capacities(avail, row, L, lay.d_ffn, need) if options.cache_rows is None \
            else budget_mod.given_capacities(options.cache_rows, avail, row, L, lay.d_ffn)
        # overlap inside a layer: a decode layer's FFN over its held rows while its missing rows are read into
        # the others (where reads land in cache rows and the backend computes row subsets without copying them)
        self.split = options.read_ahead is not False and in_place and B.ffn_index_in_place()
        self._landing: Landing | None = None  # the read of the layer being computed, with `split`
        # with `split`: a layer whose read-ahead is still landing first computes the rows it holds already
        self.early_held = True
        self._verified: dict[int, tuple] = {}  # layer -> (token, masks, prior last_active) of a verification
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
        norm = "attn_norm" if ctx.spec.parallel_attn and not ctx.spec.ffn_norm else "ffn_norm"  # makes FFN inputs
        self.read_ahead = make_read_ahead(ahead, ahead_rows, self.caches, self.predictor, self.reader, B,
                                          self.window, lay, norm, precision=options.read_ahead_precision)
        self._pin_hot()
        # a prompt's neurons are computed in pieces of this many per layer: the rows left beside the pins at load
        self.prompt_rows = [c.capacity - c.pinned for c in self.caches]

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

    def _warn_if_short(self, base: int, row: int, need: list[float]) -> None:
        """At load: caches smaller than their layer's mean predicted set per token drop predicted
        neurons on most tokens, which costs quality; say so with the numbers and the budget that avoids it."""
        want = [math.ceil(f * self.lay.d_ffn) for f in need]
        short = [(i, c, w) for i, (c, w) in enumerate(zip(self.capacities, want)) if c < w]
        if not short:
            return
        i, c, w = max(short, key=lambda s: s[2] - s[1])
        field, budget, opts = self.ctx.budget_field, self.ctx.budget, self.ctx.options
        enough = budget_mod.format_size(base + sum(want) * row)
        over = sum(w - c for _, c, w in short)
        category = OptionsWarning  # DroppedNeuronsWarning only where neurons will be dropped (users filter on it)
        if opts.batch_size > 1:  # a batch's union that does not fit is streamed through the rows, never dropped
            then = "batch steps whose predicted neurons exceed a cache stream them through its rows (exact, slower)"
        elif opts.on_overflow == "error":
            then = f"tokens predicting more than a cache holds (about {over} neurons per token over) are refused"
        else:
            category = DroppedNeuronsWarning
            then = (f"about {over} predicted neurons per token will be dropped, at a quality cost that `flashllm "
                    f"predictors eval MODEL --data TEXT {cli_option(field)} ...` measures")
        # a template (errors.NamesOptions): the budget named as flashllm.load's keyword, or the CLI's flag
        warnings.warn(category(
            f"{{{field}={budget_mod.format_size(budget)}}}: {len(short)} of {len(want)} layer caches hold fewer "
            f"neurons than their predictors select per token on average (layer {i}: {c} for {w}), so "
            f"{then}; {{{field}={enough}}} avoids it"), stacklevel=4)

    def describe(self) -> dict:
        sparsity = self.ctx.sparsity
        return {"window": self.window, "cache_capacity": self.capacities, "predictor": self.predictor.kind,
                "pinned_neurons": [c.pinned for c in self.caches], "gap_bytes": self.reader.io.gap_bytes,
                "ffn_overlap": self.split,
                **self.read_ahead.describe(), **({"activation_sparsity": sparsity.to_stats()} if sparsity else {})}

    @property
    def capacity(self) -> int:
        """The largest per-layer cache (all equal unless the predictor knows per-layer needs)."""
        return max(self.capacities)

    def reset(self) -> None:
        self.read_ahead.drop()
        if self._landing is not None:  # a layer left before its read was waited for (an error)
            self._landing.read.wait()
            self._landing = None
        for c in self.caches:
            c.reset()

    def before_ffn(self, layer: int, residual, cost) -> None:
        self.read_ahead.observe(residual, cost)

    def ffn(self, layer: int, x, cost):
        """One layer's FFN: predict -> fit -> evict -> read (what was read ahead arrives first) -> look ahead
        -> compute. Several tokens whose predicted union does not fit go through `_prefill` instead."""
        cache = self.caches[layer]
        p = self._predict(layer, x, cost)
        if not self._decodes(p, cache, cost):
            return self._prefill(layer, x, p, cost)
        mask, scores = union(p.mask, p.scores)
        active = self._fit(layer, np.flatnonzero(mask), scores, cost)
        if cost.verify:  # the window is settled once the verification's kept positions are known
            self._verified[layer] = (cache.token, p.mask, active, cache.last_active[active].copy())
        self.ctx.hooks.emit("fit", layer, active)
        counts = ReadAheadCounts()
        cost.read_ahead.append(counts)
        early = acc = None
        if self.split and self.early_held and x.shape[0] == 1 and self.read_ahead.landing(layer, cost):
            # the rows this token needs that are held already, computed while the read ahead of them lands
            early = held_rows_of(cache, active)
            acc = self._part(layer, x, p.pre, early, cache.num_used, self.backend.ffn_acc(x))
        ahead = self.read_ahead.finish(layer, active, counts, cost)  # held from now on: the needed read-ahead
        with cost.timed("mem_ms"):
            missing, _, _ = cache.evict(active, self.window)
        self._read(layer, self.read_ahead.place(layer, missing, counts, cost), cost, self.split and x.shape[0] == 1)
        cost.neurons_loaded.append(len(missing) + ahead)
        self.read_ahead.start(layer + 1, cost)  # in flight while this layer and the next attention compute
        y = self._compute(layer, x, p.pre, active, cost, acc, early)
        cost.neurons_cached.append(cache.held())
        self.read_ahead.poll(cost)
        return y

    def _predict(self, layer: int, x, cost) -> Prediction:
        with cost.timed("predictor_ms"):
            pre = self.predictor.pre(layer, x) if self.resident_part else None
            mask, scores = predict_scored(self.predictor, layer, x, pre)
        self.ctx.hooks.emit("predict", layer, mask)
        return Prediction(mask, scores, pre)

    @staticmethod
    def _decodes(p: Prediction, cache: NeuronCache, cost) -> bool:
        """Decode: one token, or one per sequence of a batch whose union fits the cache (a union that does not
        fit is streamed through the cache rows like a prompt: exact, never dropped for batching)."""
        rows = p.mask.shape[0]  # a verification's positions are decoded together like a batch's sequences
        return (rows == cost.batch or cost.verify) and (rows == 1 or p.mask.any(axis=0).sum() <= cache.capacity)

    def keep_verified(self, kept: int, policy: str) -> None:
        """The window after a verification decoded as one step (`ffn` marked its union active at one token):
        it counts `kept` tokens, the kept positions' neurons each at its own; "accepted" (the paper's policy)
        restores the rejected positions' neurons to what they were, "verified" keeps them as the last token's."""
        for layer, (token, masks, active, prior) in self._verified.items():
            cache = self.caches[layer]
            cache.last_active[active] = prior
            for t, mask in enumerate(masks if policy == "verified" else masks[:kept]):
                cache.last_active[np.flatnonzero(mask)] = token + 1 + min(t, kept - 1)
            cache.token = token + kept
        self._verified.clear()

    def _read(self, layer: int, ids: np.ndarray, cost, overlap: bool) -> None:
        """The bundles of neurons `ids` into free cache rows; with `overlap`, only start that read, into the
        rows themselves (`_compute` waits for it)."""
        cache = self.caches[layer]
        if overlap and len(ids):
            rows = cache.free_rows(len(ids))
            with cost.timed("io_ms"):  # building and submitting the requests is I/O
                self._landing = Landing(ids, rows, self.reader.submit(layer, ids, cache.store.landing(), rows))
            return
        io = cache.insert(ids, self.reader.reader_for(layer), cost)
        if io is not None:
            cost.add_io(io)

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
            raise OptionsError(f"layer {layer}: {len(active)} neurons predicted active but its cache holds "
                               f"{capacity}; raise {{{self.ctx.budget_field}}} or load with {{on_overflow=drop}}")
        order = np.argsort(-scores[active], kind="stable") if scores is not None else np.arange(len(active))
        keep, dropped = np.sort(active[order[:capacity]]), active[order[capacity:]]
        cost.neurons_dropped += len(dropped)
        if scores is not None:
            cost.dropped_mass += float(scores[dropped].sum())
        return keep

    def _compute(self, layer: int, x, pre, active: np.ndarray, cost, acc=None, early=None):
        """The FFN over the cache rows of this token's neurons `active` (the paper's semantics), once their reads
        have arrived: never over other cached rows, so that the output does not depend on what earlier
        tokens or requests left in the cache. `acc`: the float32 sum of rows `early`, computed already."""
        if self._landing is not None:
            return self._compute_split(layer, x, pre, active, cost, acc, early)
        cache = self.caches[layer]
        rows = held_rows_of(cache, active)
        if acc is None:
            return self._rows_ffn(layer, x, cache.num_used, True, pre, index=rows)
        return self._part(layer, x, pre, rows[~np.isin(rows, early)], cache.num_used, acc, finish=True)

    def _part(self, layer: int, x, pre, rows: np.ndarray, n: int, acc, finish: bool = False, landing=None):
        """Cache rows `rows` (of rows :n) added to the float32 sum `acc` (use the result); with `finish`, the
        layer's output from it (rounded once, plus the down bias). `landing` (ids, rows): neurons whose rows
        are being read and not marked held yet (their resident gate pre-activations)."""
        cache, B = self.caches[layer], self.backend
        down_b = self.ctx.biases(layer)["down"] if finish else None
        if not len(rows):
            return B.ffn_result(acc, x, down_b) if finish else acc
        views, bias = cache.store.views(n)
        gate_pre = None
        if pre is not None:  # the resident gate's pre-activations of each row's neuron
            neurons = np.maximum(cache.pointer[:n], 0)  # (rows left empty are not computed)
            if landing is not None:
                neurons[landing[1]] = landing[0]
            gate_pre = B.columns(pre, neurons)
        return B.ffn(x, views, bias.get("up"), bias.get("gate"), down_b, self.ffn_thresholds[layer],
                     gate_pre=gate_pre, index=rows, acc=acc, finish=finish)

    def _rows_ffn(self, layer: int, x, n: int, with_down_bias: bool, pre=None, index=None, acc=None):
        """The FFN over cache rows :n (the down bias once, in the part that has it), or only rows `index` (an
        empty one gives the bias alone); `pre`: the resident gate's pre-activations of every neuron. With `acc`
        (from `ffn_acc`): the rows' float32 contributions added to it (use the result)."""
        cache, B = self.caches[layer], self.backend
        down_b = self.ctx.biases(layer)["down"] if with_down_bias and acc is None else None
        if index is not None and not len(index):
            if acc is not None:
                return acc
            y = B.zeros_like(x)
            return y if down_b is None else y + down_b
        rows, bias = cache.store.views(n)
        if index is None and n == cache.num_used:
            index = cache.held_rows()  # rows emptied and not refilled
        elif index is not None and len(index) == n and (index == np.arange(n)).all():
            index = None  # every row, in order: no selection
        gate_pre = None if pre is None else B.columns(pre, np.maximum(cache.pointer[:n], 0))
        return B.ffn(x, rows, bias.get("up"), bias.get("gate"), down_b, self.ffn_thresholds[layer],
                     gate_pre=gate_pre, index=index, acc=acc)

    def _compute_split(self, layer: int, x, pre, active: np.ndarray, cost, acc=None, early=None):
        """The FFN over the rows of `active` while the layer's missing rows are read into free rows (`_read`
        with overlap): the rows held already (less `early`, in `acc` already), then, once the read has arrived,
        the new ones, summed in float32 and rounded once (`_compute`'s result up to float32 summation order).
        A row in flight is never read."""
        (ids, rows, pending), self._landing = (self._landing.ids, self._landing.rows, self._landing.read), None
        cache, B = self.caches[layer], self.backend
        n = max(cache.num_used, int(rows.max()) + 1)
        held = held_rows_of(cache, active)  # (the neurons landing are not marked held yet)
        if early is not None:
            held = held[~np.isin(held, early)]
        acc = self._part(layer, x, pre, held, n, B.ffn_acc(x) if acc is None else acc, landing=(ids, rows))
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        cache.store.placed(ids, rows, cost)  # (sets the new rows' biases, seen through the views)
        cache.append(ids)
        return self._part(layer, x, pre, rows, n, acc, finish=True)

    def _prefill(self, layer: int, x, p: Prediction, cost):
        """Several tokens at once: stream the predicted union (or the whole layer, if cheaper) through
        the cache rows in chunks, then leave the cache as if the last `window` tokens were decoded (a
        prompt; a batch step whose union did not fit leaves it empty)."""
        cache, B, mask, scores, pre = self.caches[layer], self.backend, p.mask, p.scores, p.pre
        self.read_ahead.drop()  # a read ahead may still be landing in this cache's free rows
        cache.reset()  # the window's rows serve as the read buffer below; pinned rows stay and are computed
        h = cache.pinned
        predicted = np.flatnonzero(mask.any(axis=0))
        # the prompt's FFN is over the predicted union, or every neuron where streaming them all reads less; the
        # choice is the prompt's alone (not the pinned rows', which earlier tokens may have released), and so is
        # the output
        sparse = len(predicted) * self.RANDOM_READ_PENALTY < self.lay.d_ffn
        cost.prefill_strategy = "sparse-union" if sparse else "dense-stream"
        # one float32 sum over pieces of the computed neurons in neuron order, of a size fixed at load (the rows
        # beside the pins made then), rounded once: the same sum whatever pinned rows earlier tokens released
        computed, step, streamed = predicted if sparse else np.arange(self.lay.d_ffn), self.prompt_rows[layer], 0
        acc = B.ffn_acc(x)
        for k in range(0, len(computed), step):  # the window's rows as a read buffer: reset again below
            piece = computed[k:k + step]
            rows = cache.row_of[piece]  # pinned rows, or -1
            new = piece[rows < 0]
            rows[rows < 0] = h + np.arange(len(new))
            if len(new):
                cost.add_io(cache.store.fill(self.reader.reader_for(layer), new, h + np.arange(len(new)), cost))
                cache.pointer[h:h + len(new)] = new  # the rows' neurons (the cache is reset below)
            acc = self._rows_ffn(layer, x, h + len(new), False, pre, index=rows, acc=acc)
            streamed += len(new)
        y = B.ffn_result(acc, x, self.ctx.biases(layer)["down"])
        cache.reset()
        loaded = 0
        replayed = len(mask) if cost.batch == 1 else 0  # a batch's rows are sequences, not a window of tokens
        for t in range(max(0, replayed - self.window), replayed):
            active = np.flatnonzero(mask[t])
            if len(active) > cache.capacity:  # cache state only: the output above used every predicted neuron
                active = active[np.argsort(-scores[t][active], kind="stable")[:cache.capacity]] \
                    if scores is not None else active[:cache.capacity]
            with cost.timed("mem_ms"):
                missing, _, _ = cache.evict(np.sort(active), self.window)
            self._read(layer, missing, cost, overlap=False)
            loaded += len(missing)
        cost.neurons_streamed.append(streamed)
        cost.neurons_loaded.append(loaded)
        cost.neurons_cached.append(cache.held())
        return y

    def host_bytes(self) -> int:
        return self.backend.staging_bytes(self.lay.stride) + self.read_ahead.host_bytes()

    def device_bytes(self) -> int:
        return sum(c.store.nbytes() for c in self.caches) + self.predictor.nbytes()


def held_rows_of(cache: NeuronCache, neurons: np.ndarray) -> np.ndarray:
    """The cache rows holding `neurons` (ascending ids), in neuron order: a summation order that depends on the
    set alone, not on where earlier tokens left each neuron; neurons not held are left out."""
    rows = cache.row_of[neurons]
    return rows[rows >= 0]


def activation_frequencies(ctx: ModeContext) -> list[np.ndarray] | None:
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

