"""The pieces of the mixture-of-experts modes: the router (the exact predictor), the expert cache's
bookkeeping, and the slots that hold a layer's cached experts.

Slots are chosen once at load (`choose_slots`, `make_slots`): `StoredSlots` hold experts as stored and
reads land in them (the CPU in the storage dtype, int4 experts stored in the backend's kernel layout, or
quantized experts dequantized at each use when too few dequantized ones would fit); `StagedSlots` read
experts into a staging buffer and insert them (repacked for the backend's int4 kernel, or converted or
dequantized to the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.modes.context import ModeContext
from flashllm.options import EXPERT_POLICIES

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
    layer's input (a read-ahead guess), so a replayed trace can give its recorded guess."""

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


@dataclass(frozen=True)
class SlotChoice:
    """How a layer's expert slots hold experts, decided at load."""

    kind: str  # one of SLOT_KINDS' keys
    slot_bytes: int  # one slot's bytes (stored bundles, kernel layout or the compute dtype)
    staging: int  # staging buffers of top_k bundles (0: reads land in the slots)


SLOT_KINDS = {"in place": "in place (as stored)", "kernel in place": None, "quantized as stored":
              "quantized as stored (dequantized at each use)", "kernel": None, "dequantized": "dequantized on insert",
              "converted": "converted on insert"}  # (None: the kernel slots' own KIND)


def choose_slots(ctx: ModeContext, read_ahead: bool) -> SlotChoice:
    """At load: where reads land in the slots as stored, else staged and inserted (with read-ahead, a second
    staging buffer holds the next layer's guesses). Quantized experts without a kernel layout stay as stored
    when fewer than top_k dequantized ones per layer would fit the budget."""
    B, lay, s, budget = ctx.backend, ctx.layout, ctx.spec, ctx.budget
    kernel_bytes = B.expert_slot_bytes(lay) if lay.quant is not None else None
    if B.reads_in_place():
        return SlotChoice("in place", lay.stride, 0)
    if kernel_bytes and B.expert_reads_in_place(lay):
        return SlotChoice("kernel in place", lay.stride, 0)
    if kernel_bytes:
        return SlotChoice("kernel", kernel_bytes, 2 if read_ahead else 1)
    converted = len(lay.parts) * lay.d_ffn * lay.d_model * B.itemsize
    staging = 2 if read_ahead else 1
    if lay.quant is not None and budget is not None and \
            budget - ctx.charged(staging * s.top_k * lay.stride, B.nbytes()) < s.n_layers * s.top_k * converted:
        return SlotChoice("quantized as stored", lay.stride, 0)
    return SlotChoice("dequantized" if lay.quant is not None else "converted", converted, staging)


class StoredSlots:
    """Each layer's slots are one host buffer of stored bundles that reads land in."""

    def __init__(self, ctx: ModeContext, choice: SlotChoice, capacity: int):
        B, lay, L = ctx.backend, ctx.layout, ctx.spec.n_layers
        self.ctx, self.layout, self.staging = ctx, lay, []
        if choice.kind == "kernel in place":  # the kernel's slots are the stored bundles
            self.kernel = [expert_slots(ctx, capacity) for _ in range(L)]
            self.raw = [slots.buffer for slots in self.kernel]
            self.kind = self.kernel[0].KIND
            self.rows = lambda layer, slot: self.kernel[layer].rows(slot)
        else:
            self.raw = [B.host_buffer((capacity, lay.stride)) for _ in range(L)]
            self.kind = SLOT_KINDS[choice.kind]
            if choice.kind == "in place":  # zero-copy views, made once
                views = [[expert_views(ctx, r[i]) for i in range(capacity)] for r in self.raw]
                self.rows = lambda layer, slot: views[layer][slot]
            else:  # quantized: dequantized at each use
                self.rows = lambda layer, slot: expert_views(ctx, self.raw[layer][slot])

    def read(self, reader, layer: int, experts: np.ndarray, slots: np.ndarray, ahead: dict, cost) -> None:
        """`experts` into `slots`, in one submission."""
        with cost.timed("io_ms"):
            cost.add_io(reader.read(layer, experts, self.raw[layer], slots))

    def read_ahead(self, reader, layer: int, cache: "ExpertCache", predicted: np.ndarray, todo: np.ndarray):
        """Start reading the uncached predicted experts `todo` into slots now theirs: (experts, read)."""
        todo = todo[:cache.capacity - np.isin(cache.expert_in, predicted).sum()]
        where = cache.place(todo, keep=predicted)
        cache.commit(todo, where)  # the read is waited for before this layer computes
        base, stride, _, _ = self.layout.segments(layer)[0]
        return todo, reader.io.submit_rows(base, stride, stride, todo, self.raw[layer], where)


class StagedSlots:
    """Each layer's slots hold experts converted for compute; reads go through staging buffers of top_k
    bundles (a second one holds read-ahead guesses until routing confirms them)."""

    def __init__(self, ctx: ModeContext, choice: SlotChoice, capacity: int):
        B, lay, s = ctx.backend, ctx.layout, ctx.spec
        self.layout = lay
        self.staging = [B.host_buffer((s.top_k, lay.stride)) for _ in range(choice.staging)]
        self.slots = [expert_slots(ctx, capacity) for _ in range(s.n_layers)]
        self.kind = self.slots[0].KIND if choice.kind == "kernel" else SLOT_KINDS[choice.kind]

    def rows(self, layer: int, slot: int) -> dict:
        return self.slots[layer].rows(slot)

    def _insert(self, layer: int, raw: np.ndarray, slots: np.ndarray) -> None:
        """Staged bundles raw[j] into `slots` (repacked, dequantized or converted)."""
        for j, slot in enumerate(slots):
            self.slots[layer].insert(int(slot), raw[j])

    def read(self, reader, layer: int, experts: np.ndarray, slots: np.ndarray, ahead: dict, cost) -> None:
        """`experts` into `slots` through the staging buffer (those read ahead, `ahead`: expert -> its row of the
        second buffer, are inserted from there)."""
        early = np.array([int(e) in ahead for e in experts], dtype=bool)
        if early.any():
            with cost.timed("mem_ms"):
                self._insert(layer, self.staging[1][[ahead[int(e)] for e in experts[early]]], slots[early])
        experts, slots, staging = experts[~early], slots[~early], self.staging[0]
        for k in range(0, len(experts), len(staging)):
            chunk = experts[k:k + len(staging)]
            with cost.timed("io_ms"):
                cost.add_io(reader.read(layer, chunk, staging, np.arange(len(chunk))))
            with cost.timed("mem_ms"):
                self._insert(layer, staging, slots[k:k + len(staging)])

    def read_ahead(self, reader, layer: int, cache: "ExpertCache", predicted: np.ndarray, todo: np.ndarray):
        """Start reading `todo` into the second staging buffer (inserted once routing confirms them)."""
        base, stride, _, _ = self.layout.segments(layer)[0]
        return todo, reader.io.submit_rows(base, stride, stride, todo, self.staging[1], np.arange(len(todo)))


def make_slots(ctx: ModeContext, choice: SlotChoice, capacity: int):
    return StagedSlots(ctx, choice, capacity) if choice.staging else StoredSlots(ctx, choice, capacity)
