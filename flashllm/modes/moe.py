"""Mixture-of-experts layers: the router (the exact predictor), expert cache slots, dense and sparse modes.

Dense holds every expert. Sparse streams experts from flash into a per-layer cache of slots sized
by the DRAM budget: per token the router picks the top-k experts, the ones not cached are read in
one I/O submission per layer into slots freed by the eviction policy. On the CPU in the storage
dtype the slots are one preallocated buffer per layer that direct I/O fills in place; otherwise
(quantized experts, MLX, CUDA, another compute dtype) experts pass through a staging buffer and are
inserted into preallocated per-layer slots: int4 experts repacked into the backend's int4 kernel
layout where it has one (torch on the CPU; experts stored in that layout are read straight into
those slots instead), else dequantized or converted to the compute dtype. A
layer may have fewer slots than top-k (a token's experts then pass through them in chunks). The
result is exactly the dense one, whatever the budget (only bytes read change).

`LoadOptions.expert_routing` replaces the router's choice (benchmarks replay recorded routing);
the weights of the chosen experts still come from the router's own logits.
"""

from __future__ import annotations

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.options import EXPERT_POLICIES
from flashllm.modes.registry import Mode
from flashllm.modes.context import ModeContext

NEVER = -(1 << 62)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, spec, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k expert ids [T, k] and their float32 weights from router logits [T, n_experts], computed as
    transformers does (softmax in float32 over all experts, top-k, optional renormalisation); with
    `ids` given, the weights those experts get instead."""
    logits = logits.astype(np.float32)
    if ids is None:
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :spec.top_k]  # softmax keeps the order
    if spec.router_softmax == "after_topk":
        return ids, softmax(np.take_along_axis(logits, ids, axis=-1))
    weights = np.take_along_axis(softmax(logits), ids, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


def by_expert(ids: np.ndarray, weights: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """expert id -> (the tokens routed to it, ascending; their router weights)."""
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    tokens, w = order // ids.shape[1], weights.ravel()[order]
    bounds = list(starts[1:]) + [len(order)]
    return {int(e): (tokens[a:b], w[a:b]) for e, a, b in zip(experts, starts, bounds)}


class Router:
    """The MoE predictor: exact, since the router itself decides which experts a token uses.

    `choose(layer, logits, early)` (LoadOptions.expert_routing), if given, picks the expert ids
    [T, top_k] instead; `early` is True when layer `layer`'s router is run ahead on the previous
    layer's input (a prefetch guess), so a replayed trace can give its recorded guess."""

    kind = "router"

    def __init__(self, ctx: ModeContext):
        self.backend, self.spec = ctx.backend, ctx.spec
        self.choose = ctx.options.expert_routing

    def predict(self, layer: int, x, early: bool = False) -> tuple[np.ndarray, np.ndarray]:
        B = self.backend
        logits = B.to_host(B.linear(x, B.w[f"layers.{layer}.router.weight"], None))
        if self.choose is None:
            return route(logits, self.spec)
        ids = np.asarray(self.choose(layer, logits, early), dtype=np.int64)
        T, k, E = logits.shape[0], self.spec.top_k, self.spec.n_experts
        if ids.shape != (T, k) or ids.min() < 0 or ids.max() >= E or \
                any(len(np.unique(row)) != k for row in ids):
            raise FlashLLMError(f"expert_routing gave layer {layer} expert ids of shape {ids.shape} "
                                f"(expected {k} distinct ids in 0..{E - 1} for each of {T} tokens)")
        return route(logits, self.spec, ids)

    def nbytes(self) -> int:
        return 0  # the router weights are resident tensors, counted with the backend's


class ExpertCache:
    """Which expert each slot of one layer's cache holds, and which slots to free for new experts.

    Policies: `lru` evicts the least recently used expert when no slot is free; `lfu` the least
    frequently used one among those not used in the last `window` tokens (then LRU); `window` (the
    paper's neuron cache) also frees every expert not used in the last `window` tokens at once.
    Experts the current step needs are never evicted.
    """

    def __init__(self, capacity: int, n_experts: int, window: int, policy: str = "lru"):
        if policy not in EXPERT_POLICIES:
            raise FlashLLMError(f"expert cache policy {policy!r}: expected one of {', '.join(EXPERT_POLICIES)}")
        self.capacity, self.n_experts, self.window, self.policy = capacity, n_experts, window, policy
        self.reset()

    def reset(self) -> None:
        self.expert_in = np.full(self.capacity, -1, dtype=np.int64)  # expert held by each slot
        self.slot_of = np.full(self.n_experts, -1, dtype=np.int64)  # slot of each expert, -1: not cached
        self.last_used = np.full(self.n_experts, NEVER, dtype=np.int64)
        self.uses = np.zeros(self.n_experts, dtype=np.int64)
        self.token = -1

    def start(self, ids: np.ndarray) -> np.ndarray:
        """Advance over the tokens whose experts are `ids` [T, k]; return the experts they use."""
        T = ids.shape[0]
        np.maximum.at(self.last_used, ids.ravel(), np.repeat(self.token + 1 + np.arange(T), ids.shape[1]))
        self.uses += np.bincount(ids.ravel(), minlength=self.n_experts)
        self.token += T
        if self.policy == "window":
            held = self.expert_in[self.expert_in >= 0]
            self._evict(self.slot_of[held[self.last_used[held] <= self.token - self.window]])
        return np.unique(ids)

    def _evict(self, slots: np.ndarray) -> None:
        self.slot_of[self.expert_in[slots]] = -1
        self.expert_in[slots] = -1

    def place(self, experts: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for `experts` (none cached): free ones first, then evicting experts not in `keep`."""
        free = np.flatnonzero(self.expert_in < 0)
        need = len(experts) - len(free)
        if need > 0:
            cand = np.flatnonzero((self.expert_in >= 0) & ~np.isin(self.expert_in, keep))
            held = self.expert_in[cand]
            if self.policy == "lfu":
                recent = self.last_used[held] > self.token - self.window
                order = np.lexsort((self.last_used[held], self.uses[held], recent))
            else:
                order = np.argsort(self.last_used[held], kind="stable")
            if len(cand) < need:
                raise FlashLLMError(f"expert cache of {self.capacity} slots cannot hold {len(experts)} more experts")
            self._evict(cand[order[:need]])
            free = np.flatnonzero(self.expert_in < 0)
        return free[:len(experts)]

    def commit(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """Record that `experts` were read into `slots`."""
        self.expert_in[slots] = experts
        self.slot_of[experts] = slots


def expert_values(ctx: ModeContext, raw: np.ndarray):
    """One stored expert bundle (uint8, >= bundle_bytes) as its values [parts, d_ffn, d_model]: a view
    in the storage dtype, or float32 dequantized (flashllm/format/quant.py) when the experts are quantized."""
    lay = ctx.layout
    values = lay.dequantize(raw) if lay.quant else ctx.backend.storage_view(raw[:lay.bundle_bytes])
    return values.reshape(len(lay.parts), lay.d_ffn, lay.d_model)


def expert_views(ctx: ModeContext, raw: np.ndarray) -> dict:
    """One expert bundle as part -> [d_ffn, d_model] backend tensors (views of `raw`, no copy, when the
    backend computes on the CPU in the storage dtype and the experts are not quantized)."""
    values = expert_values(ctx, raw)
    return {p: ctx.backend.tensor(values[k]) for k, p in enumerate(ctx.layout.parts)}


class ConvertedSlots:
    """One layer's expert slots in the compute dtype, one preallocated array: a stored bundle is
    dequantized or converted when it is inserted."""

    def __init__(self, ctx: ModeContext, capacity: int):
        lay, self.ctx = ctx.layout, ctx
        self.array = ctx.backend.zeros((capacity, len(lay.parts), lay.d_ffn, lay.d_model))

    def insert(self, slot: int, raw: np.ndarray) -> None:
        self.array[slot] = self.ctx.backend.tensor(expert_values(self.ctx, raw))

    def rows(self, slot: int) -> dict:
        return {p: self.array[slot, k] for k, p in enumerate(self.ctx.layout.parts)}


def expert_slots(ctx: ModeContext, capacity: int):
    """A layer's `capacity` slots: in the backend's quantized kernel layout where it has one, else converted."""
    if ctx.layout.quant and ctx.backend.expert_slot_bytes(ctx.layout):
        return ctx.backend.expert_slots(ctx.layout, capacity)
    return ConvertedSlots(ctx, capacity)


class MoEMode(Mode):
    """Shared by the MoE modes: routing, the shared expert and the weighted sum of expert outputs (in float32,
    so dense and streamed modes, which add the experts in different groups, agree)."""

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        self.spec = ctx.spec
        self.predictor = Router(ctx)

    def route(self, layer: int, x, cost) -> tuple[np.ndarray, np.ndarray]:
        with cost.timed("predictor_ms"):
            return self.predictor.predict(layer, x)

    def combine(self, x, groups: list, acc=None):
        """Adds weight * expert(x[tokens]) for each (rows, tokens, weights) group to the float32 sum `acc`."""
        return self.backend.moe_experts(x, groups, acc)

    def output(self, layer: int, x, acc):
        """The layer's FFN output: the routed experts' float32 sum plus the shared expert, in x's dtype."""
        B, p = self.backend, f"layers.{layer}."
        rows = gate = None
        if self.spec.d_shared_expert:
            rows = {"gate": B.w[p + "shared_gate.weight"], "up": B.w[p + "shared_up.weight"],
                    "down": B.w[p + "shared_down.weight"].T}
            gate = B.w.get(p + "shared_expert_gate.weight")
        return B.moe_output(x, acc, rows, gate)


class MoEDenseMode(MoEMode):
    """Every expert resident: the reference for the streamed mode."""

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        lay, E = self.lay, self.spec.n_experts
        reader = ctx.ffn_reader(threads=4, verify=False)
        self.experts = []
        kernel = lay.quant and self.backend.expert_slot_bytes(lay)  # experts stay quantized, as when streamed
        try:
            for layer in range(self.spec.n_layers):
                slots = expert_slots(ctx, E) if kernel else None
                direct = kernel and self.backend.expert_reads_in_place(lay)
                buf = slots.buffer if direct else self.backend.host_buffer((E, lay.stride))
                reader.read(layer, np.arange(E), buf, np.arange(E))
                if kernel:
                    if not direct:
                        for e in range(E):
                            slots.insert(e, buf[e])
                    self.experts.append([slots.rows(e) for e in range(E)])
                else:
                    self.experts.append([expert_views(ctx, buf[e]) for e in range(E)])
        finally:
            reader.close()
        ctx.check_fits(ctx.charged(0, self.backend.nbytes() + self.device_bytes()), "all weights and the KV cache")

    def ffn(self, layer: int, x, cost):
        ids, weights = self.route(layer, x, cost)
        groups = [(self.experts[layer][e], t, w) for e, (t, w) in by_expert(ids, weights).items()]
        return self.output(layer, x, self.combine(x, groups))

    def device_bytes(self) -> int:
        B = self.backend
        return sum(B.nbytes_of(t) for layer in self.experts for ex in layer for t in ex.values())


class MoESparseMode(MoEMode):
    """Experts streamed from flash into per-layer cache slots; prefill streams each layer's union once."""

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        B, lay, s, options, budget = self.backend, self.lay, self.spec, ctx.options, ctx.budget
        window, policy = options.window, options.expert_policy
        self.window, self.policy = window, policy
        # prefetch: while layer l computes, read the experts layer l+1's router picks for layer l's input
        self.prefetch = options.expert_read_ahead
        self.pending: dict[int, tuple] = {}  # layer -> (predicted experts, experts read, PendingRead)
        # slots hold experts as stored (reads land in them: CPU in the storage dtype, int4 experts stored in
        # the backend's kernel layout, or quantized experts without a kernel layout when fewer than top-k
        # dequantized ones would fit per layer, dequantized at each use), or inserted through a staging
        # buffer holding one token's experts (and, with prefetch, a second one for the next layer's
        # guesses): repacked for the backend's int4 kernel, or converted/dequantized to the compute dtype
        self.in_place = B.reads_in_place()
        self.kernel = not self.in_place and lay.quant is not None and bool(B.expert_slot_bytes(lay))
        self.kernel_in_place = self.kernel and B.expert_reads_in_place(lay)
        converted = B.expert_slot_bytes(lay) if self.kernel else len(lay.parts) * lay.d_ffn * lay.d_model * B.itemsize
        staging_bytes = (2 if self.prefetch else 1) * s.top_k * lay.stride
        self.as_stored = self.in_place or self.kernel_in_place or (
            lay.quant is not None and not self.kernel and budget is not None and
            budget - ctx.charged(staging_bytes, B.nbytes()) < s.n_layers * s.top_k * converted)
        self.staging = [] if self.as_stored else \
            [B.host_buffer((s.top_k, lay.stride)) for _ in range(2 if self.prefetch else 1)]
        self.slot_bytes = lay.stride if self.as_stored else converted
        if budget is None:
            capacity = s.n_experts
        else:
            base = ctx.charged(self.host_bytes(), B.nbytes())
            capacity = min(s.n_experts, max(0, budget - base) // (s.n_layers * self.slot_bytes))
            if capacity < 1:
                raise ctx.too_small(base + s.n_layers * self.slot_bytes,
                                    "resident weights, KV cache and 1 expert slot per layer")
        self.capacities = [capacity] * s.n_layers
        self.caches = [ExpertCache(capacity, s.n_experts, window, policy) for _ in range(s.n_layers)]
        if self.kernel:  # preallocated once; inserting an expert writes its slot, or the read lands in it
            self.slots = [expert_slots(ctx, capacity) for _ in range(s.n_layers)]
        if self.kernel_in_place:
            self.raw = [slots.buffer for slots in self.slots]
        elif self.as_stored:
            self.raw = [B.host_buffer((capacity, lay.stride)) for _ in range(s.n_layers)]
            if self.in_place:  # zero-copy views, made once
                self.views = [[expert_views(ctx, r[i]) for i in range(capacity)] for r in self.raw]
        elif not self.kernel:
            self.slots = [expert_slots(ctx, capacity) for _ in range(s.n_layers)]
        self.reader = ctx.ffn_reader(verify=False)

    def describe(self) -> dict:
        return {"window": self.window, "cache_capacity": self.capacities, "predictor": self.predictor.kind,
                "expert_slots": "in place (as stored)" if self.in_place else
                self.slots[0].KIND if self.kernel else
                "quantized as stored (dequantized at each use)" if self.as_stored else
                "dequantized on insert" if self.lay.quant else "converted on insert"}

    def reset(self) -> None:
        for _, _, read in self.pending.values():
            read.wait()
        self.pending = {}
        for c in self.caches:
            c.reset()

    def slot(self, layer: int, slot: int) -> dict:
        """Part -> [d_ffn, d_model] views of one slot (quantized slots: dequantized now)."""
        if self.in_place:
            return self.views[layer][slot]
        if self.as_stored and not self.kernel_in_place:
            return expert_views(self.ctx, self.raw[layer][slot])
        return self.slots[layer].rows(slot)

    def _insert(self, layer: int, raw: np.ndarray, slots: np.ndarray) -> None:
        """Staged bundles raw[j] into `slots` (repacked, dequantized or converted)."""
        for j, slot in enumerate(slots):
            self.slots[layer].insert(int(slot), raw[j])

    def _prefetch(self, layer: int, x, cost) -> None:
        """Start reading the experts layer `layer`'s router picks for `x` (the previous layer's FFN input):
        into cache slots (in place), or into the second staging buffer (inserted once routing confirms them)."""
        with cost.timed("predictor_ms"):
            predicted = np.unique(self.predictor.predict(layer, x, early=True)[0])
        cache = self.caches[layer]
        todo = predicted[cache.slot_of[predicted] < 0]
        with cost.timed("io_ms"):
            base, stride, _, _ = self.lay.segments(layer)[0]
            if self.as_stored:
                todo = todo[:cache.capacity - np.isin(cache.expert_in, predicted).sum()]
                where = cache.place(todo, keep=predicted)
                cache.commit(todo, where)  # the read is waited for before this layer computes
                read = self.reader.io.submit_rows(base, stride, stride, todo, self.raw[layer], where)
            else:
                read = self.reader.io.submit_rows(base, stride, stride, todo, self.staging[1], np.arange(len(todo)))
        self.pending[layer] = (predicted, todo, read)
        cost.experts_read_ahead += len(todo)

    def _finish_prefetch(self, layer: int, routed: np.ndarray, cost) -> dict[int, int]:
        """Wait for the read ahead of `layer`; the experts it read -> their staging row (staged path)."""
        predicted, todo, read = self.pending.pop(layer)
        with cost.timed("io_ms"):
            cost.add_io(read.wait())
        cost.experts_predicted += len(np.intersect1d(predicted, routed))
        cost.experts_routed += len(routed)
        cost.experts_read_ahead_unused += len(np.setdiff1d(todo, routed))
        return {int(e): j for j, e in enumerate(todo)}

    def _read(self, layer: int, experts: np.ndarray, slots: np.ndarray, ahead: dict, cost) -> None:
        """Experts into slots: one submission (slots as stored), or through the staging buffer, then
        inserted (experts already read ahead are inserted from the prefetch buffer)."""
        if self.as_stored:
            with cost.timed("io_ms"):
                cost.add_io(self.reader.read(layer, experts, self.raw[layer], slots))
            return
        early = np.array([int(e) in ahead for e in experts], dtype=bool)
        if early.any():
            with cost.timed("mem_ms"):
                self._insert(layer, self.staging[1][[ahead[int(e)] for e in experts[early]]], slots[early])
        experts, slots, staging = experts[~early], slots[~early], self.staging[0]
        for k in range(0, len(experts), len(staging)):
            chunk = experts[k:k + len(staging)]
            with cost.timed("io_ms"):
                cost.add_io(self.reader.read(layer, chunk, staging, np.arange(len(chunk))))
            with cost.timed("mem_ms"):
                self._insert(layer, staging, slots[k:k + len(staging)])

    def ffn(self, layer: int, x, cost):
        ids, weights = self.route(layer, x, cost)
        cache = self.caches[layer]
        groups = by_expert(ids, weights)
        routed = np.fromiter(groups, dtype=np.int64)
        ahead = self._finish_prefetch(layer, routed, cost) if layer in self.pending else {}
        with cost.timed("mem_ms"):
            cache.start(ids)
        cached = [e for e in groups if cache.slot_of[e] >= 0]  # in place, what was read ahead is cached
        missing = np.array([e for e in groups if cache.slot_of[e] < 0], dtype=np.int64)
        # hits: cached by earlier tokens; misses: read for this token, on demand or ahead
        early = sum(e in ahead for e in cached)
        cost.experts_hit += len(cached) - early
        cost.experts_missed += len(missing) + early
        # read ahead for the next layer once this layer's own reads are done (they would queue behind it)
        prefetch = self.prefetch and layer + 1 < self.spec.n_layers and ids.shape[0] == 1
        if prefetch and not len(missing):
            self._prefetch(layer + 1, x, cost)
        with cost.timed("mem_ms"):  # views; quantized slots are dequantized here
            hits = [(self.slot(layer, cache.slot_of[e]), *groups[e]) for e in cached]
        if self.as_stored and len(missing) and len(groups) <= cache.capacity:
            return self._overlapped(layer, x, cache, groups, routed, missing, hits, prefetch, cost)
        acc = self.combine(x, hits)
        # the missing experts (the union of a prompt's), each read once, in chunks of the cache size;
        # the most recently used are read last, so they are the ones left cached
        missing = missing[np.argsort(cache.last_used[missing], kind="stable")]
        for k in range(0, len(missing), cache.capacity):
            chunk = missing[k:k + cache.capacity]
            with cost.timed("mem_ms"):
                where = cache.place(chunk, keep=chunk)
            self._read(layer, chunk, where, ahead, cost)
            cache.commit(chunk, where)
            if prefetch and k + cache.capacity >= len(missing):
                self._prefetch(layer + 1, x, cost)
            with cost.timed("mem_ms"):
                read = [(self.slot(layer, s), *groups[int(e)]) for e, s in zip(chunk, where)]
            acc = self.combine(x, read, acc)
        return self.output(layer, x, acc)

    def _overlapped(self, layer: int, x, cache: ExpertCache, groups: dict, routed: np.ndarray, missing: np.ndarray,
                    hits: list, prefetch: bool, cost):
        """`ffn` when reads land in the slots and every routed expert fits: the misses' read is in flight
        while the cached experts compute (io_ms is then only the wait beyond that compute)."""
        with cost.timed("mem_ms"):
            where = cache.place(missing, keep=routed)  # never a slot a hit is computing from
        with cost.timed("io_ms"):
            pending = self.reader.submit(layer, missing, self.raw[layer], where)
        acc = self.combine(x, hits)
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        cache.commit(missing, where)
        if prefetch:
            self._prefetch(layer + 1, x, cost)
        with cost.timed("mem_ms"):
            read = [(self.slot(layer, s), *groups[int(e)]) for e, s in zip(missing, where)]
        return self.output(layer, x, self.combine(x, read, acc))

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.staging)

    def device_bytes(self) -> int:
        return sum(self.capacities) * self.slot_bytes


MOE_MODES = {"dense": MoEDenseMode, "sparse": MoESparseMode}
