"""The mixture-of-experts modes: dense holds every expert; sparse streams experts from flash into a per-layer
cache of slots sized by the DRAM budget.

Per token the router picks the top-k experts (it is the exact predictor); the ones not cached are read in one
I/O submission per layer into slots freed by the eviction policy. How slots hold experts is chosen at load
(flashllm/modes/experts.py). A layer may have fewer slots than top-k (a token's experts then pass through
them in chunks). The result is exactly the dense one, whatever the budget (only bytes read change).

`LoadOptions.expert_routing` replaces the router's choice (benchmarks replay recorded routing); the weights of
the chosen experts still come from the router's own logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.modes.base import Mode
from flashllm.modes.context import ModeContext
from flashllm.modes.experts import (ExpertCache, Router, by_expert, choose_slots, expert_slots, expert_views,
                                    make_slots)


@dataclass
class ExpertsInFlight:
    """The experts read ahead for one layer, from the previous layer's input."""

    predicted: np.ndarray  # the experts its router picked for that input
    experts: np.ndarray  # those read (not cached then)
    read: object  # the read in flight (a PendingRead)


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
        self.experts, self.held = [], 0  # held: bytes of the experts' slots or tensors
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
                    self.held += slots.nbytes()
                else:
                    self.experts.append([expert_views(ctx, buf[e]) for e in range(E)])
                    self.held += sum(self.backend.nbytes_of(t) for ex in self.experts[-1] for t in ex.values())
        finally:
            reader.close()
        ctx.check_fits(ctx.charged(0, self.backend.nbytes() + self.device_bytes()), "all weights and the KV cache")

    def ffn(self, layer: int, x, cost):
        ids, weights = self.route(layer, x, cost)
        groups = [(self.experts[layer][e], t, w) for e, (t, w) in by_expert(ids, weights).items()]
        return self.output(layer, x, self.combine(x, groups))

    def device_bytes(self) -> int:
        return self.held


class MoESparseMode(MoEMode):
    """Experts streamed from flash into per-layer cache slots; prefill streams each layer's union once."""

    def __init__(self, ctx: ModeContext):
        super().__init__(ctx)
        B, lay, s, options, budget = self.backend, self.lay, self.spec, ctx.options, ctx.budget
        self.window = options.window
        # read-ahead: while layer l computes, read the experts layer l+1's router picks for layer l's input
        self.read_ahead = options.expert_read_ahead
        self.pending: dict[int, ExpertsInFlight] = {}
        choice = choose_slots(ctx, self.read_ahead)
        self.slot_bytes = choice.slot_bytes
        if budget is None:
            capacity = s.n_experts
        else:
            base = ctx.charged(choice.staging * s.top_k * lay.stride, B.nbytes())
            capacity = min(s.n_experts, max(0, budget - base) // (s.n_layers * self.slot_bytes))
            if capacity < 1:
                raise ctx.too_small(base + s.n_layers * self.slot_bytes,
                                    "resident weights, KV cache and 1 expert slot per layer")
        self.capacities = [capacity] * s.n_layers
        self.caches = [ExpertCache(capacity, s.n_experts, self.window, options.expert_policy)
                       for _ in range(s.n_layers)]
        self.slots = make_slots(ctx, choice, capacity)  # preallocated once
        # reads that land in the slots overlap a token's cached experts' compute
        self.overlap = not choice.staging
        self.reader = ctx.ffn_reader(verify=False)

    def describe(self) -> dict:
        return {"window": self.window, "cache_capacity": self.capacities, "predictor": self.predictor.kind,
                "expert_slots": self.slots.kind, "expert_slot_bytes": self.slot_bytes,
                "expert_staging_bytes": self.host_bytes()}

    def reset(self) -> None:
        for p in self.pending.values():
            p.read.wait()
        self.pending = {}
        for c in self.caches:
            c.reset()

    def ffn(self, layer: int, x, cost):
        """One layer's experts: route -> read ahead arrives -> evict -> read the misses -> look ahead -> compute."""
        ids, weights = self.route(layer, x, cost)
        cache, groups = self.caches[layer], by_expert(ids, weights)
        routed = np.fromiter(groups, dtype=np.int64)
        ahead = self._await_read_ahead(layer, routed, cost)
        with cost.timed("mem_ms"):
            cache.start(ids)
        cached = [e for e in groups if cache.slot_of[e] >= 0]  # (what was read into slots ahead is cached)
        missing = np.array([e for e in groups if cache.slot_of[e] < 0], dtype=np.int64)
        early = sum(e in ahead for e in cached)  # hits: cached by earlier tokens; misses: read for this token
        cost.experts_hit += len(cached) - early
        cost.experts_missed += len(missing) + early
        # read ahead for the next layer once this layer's own reads are done (they would queue behind it)
        look = self.read_ahead and layer + 1 < self.spec.n_layers and ids.shape[0] == 1
        if look and not len(missing):
            self._start_read_ahead(layer + 1, x, cost)
        with cost.timed("mem_ms"):  # views; quantized slots are dequantized here
            hits = [(self.slots.rows(layer, cache.slot_of[e]), *groups[e]) for e in cached]
        if self.overlap and len(missing) and len(groups) <= cache.capacity:
            return self._overlapped(layer, x, cache, groups, routed, missing, hits, look, cost)
        acc = self.combine(x, hits)
        # the missing experts (the union of a prompt's), each read once, in chunks of the cache size;
        # the most recently used are read last, so they are the ones left cached
        missing = missing[np.argsort(cache.last_used[missing], kind="stable")]
        for k in range(0, len(missing), cache.capacity):
            chunk = missing[k:k + cache.capacity]
            with cost.timed("mem_ms"):
                where = cache.place(chunk, keep=chunk)
            self.slots.read(self.reader, layer, chunk, where, ahead, cost)
            cache.commit(chunk, where)
            if look and k + cache.capacity >= len(missing):
                self._start_read_ahead(layer + 1, x, cost)
            with cost.timed("mem_ms"):
                read = [(self.slots.rows(layer, s), *groups[int(e)]) for e, s in zip(chunk, where)]
            acc = self.combine(x, read, acc)
        return self.output(layer, x, acc)

    def _overlapped(self, layer: int, x, cache: ExpertCache, groups: dict, routed: np.ndarray, missing: np.ndarray,
                    hits: list, look: bool, cost):
        """`ffn` when reads land in the slots and every routed expert fits: the misses' read is in flight
        while the cached experts compute (io_ms is then only the wait beyond that compute)."""
        with cost.timed("mem_ms"):
            where = cache.place(missing, keep=routed)  # never a slot a hit is computing from
        with cost.timed("io_ms"):
            pending = self.reader.submit(layer, missing, self.slots.raw[layer], where)
        acc = self.combine(x, hits)
        with cost.timed("io_ms"):
            cost.add_io(pending.wait())
        cache.commit(missing, where)
        if look:
            self._start_read_ahead(layer + 1, x, cost)
        with cost.timed("mem_ms"):
            read = [(self.slots.rows(layer, s), *groups[int(e)]) for e, s in zip(missing, where)]
        return self.output(layer, x, self.combine(x, read, acc))

    def _start_read_ahead(self, layer: int, x, cost) -> None:
        """Start reading the experts layer `layer`'s router picks for `x` (the previous layer's FFN input)."""
        with cost.timed("predictor_ms"):
            predicted = np.unique(self.predictor.predict(layer, x, early=True)[0])
        cache = self.caches[layer]
        with cost.timed("io_ms"):
            todo, read = self.slots.read_ahead(self.reader, layer, cache, predicted,
                                               predicted[cache.slot_of[predicted] < 0])
        self.pending[layer] = ExpertsInFlight(predicted, todo, read)
        cost.experts_read_ahead += len(todo)

    def _await_read_ahead(self, layer: int, routed: np.ndarray, cost) -> dict[int, int]:
        """Wait for the read ahead of `layer`, if any; the experts it read -> their row of the staging buffer."""
        p = self.pending.pop(layer, None)
        if p is None:
            return {}
        with cost.timed("io_ms"):
            cost.add_io(p.read.wait())
        cost.experts_predicted += len(np.intersect1d(p.predicted, routed))
        cost.experts_routed += len(routed)
        cost.experts_read_ahead_unused += len(np.setdiff1d(p.experts, routed))
        return {int(e): j for j, e in enumerate(p.experts)}

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.slots.staging)

    def device_bytes(self) -> int:
        return sum(self.capacities) * self.slot_bytes


MOE_MODES = {"dense": MoEDenseMode, "sparse": MoESparseMode}
