"""Per-token cost accounting: bytes and reads from flash, time split by what it was spent on."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

TIMED = ("io_ms", "mem_ms", "compute_ms", "predictor_ms")


@contextmanager
def untimed(what: str):
    """`TokenCost.timed` for callers that account no cost."""
    yield


@dataclass
class ReadAheadCounts:
    """One decode layer's read-ahead: how well its early prediction named the layer's own set."""

    found: int = 0  # predicted neurons the early prediction named
    active: int = 0  # predicted neurons (0: the layer had no early prediction)
    named: int = 0  # neurons the early prediction named
    used: int = 0  # loaded neurons that were read ahead


@dataclass
class TokenCost:
    """What one forward (the prompt or one decode token) cost."""

    tokens: int = 0
    batch: int = 1  # > 1: a batch decode step, one token of each of `batch` sequences (tokens == batch)
    bytes_read: int = 0
    bytes_wasted: int = 0  # read but not used: alignment, gap filling, unused read-ahead (bytes_read includes it)
    reads: int = 0
    io_ms: float = 0.0  # submitting reads and waiting for them (reads overlapped with compute cost nothing here)
    read_ms: float = 0.0  # the I/O engine's own time of this token's reads, overlapped or not
    mem_ms: float = 0.0
    compute_ms: float = 0.0
    predictor_ms: float = 0.0
    total_ms: float = 0.0
    neurons_loaded: list[int] = field(default_factory=list)  # per layer: read from flash into the neuron cache
    neurons_streamed: list[int] = field(default_factory=list)  # prompt, per layer: read through the cache rows
    neurons_cached: list[int] = field(default_factory=list)  # per layer, after the update
    neurons_dropped: int = 0  # predicted neurons left out because the cache could not hold them
    read_ahead: list[ReadAheadCounts] = field(default_factory=list)  # per decode layer: how its read-ahead did
    neurons_read_ahead: int = 0  # bundles read ahead from the early prediction
    read_ahead_unused: int = 0  # ... of which the layer did not need
    predicted_mass: float = 0.0  # sum of the predictor's scores over the predicted neurons
    dropped_mass: float = 0.0  # ... over those dropped (lowest-scored first)
    prefill_strategy: str = ""
    experts_hit: int = 0  # MoE: routed experts found in the expert cache, summed over layers
    experts_missed: int = 0  # MoE: routed experts read from flash
    experts_read_ahead: int = 0  # MoE read-ahead: experts read ahead by the next layer's router
    experts_read_ahead_unused: int = 0  # ... of which the layer's own routing then did not use
    experts_predicted: int = 0  # routed experts the previous layer's read-ahead prediction named
    experts_routed: int = 0  # routed experts of the layers that had a read-ahead prediction
    verify: bool = False  # a speculative verification: the last token and drafts at consecutive positions of one sequence
    drafted: int = 0  # ... its drafted tokens
    accepted: int = 0  # ... of which the model accepted
    produced: int = 0  # ... tokens it yielded (accepted + 1, fewer after an end of sequence); 0: `batch` counts
    draft_ms: float = 0.0  # ... time spent drafting them (included in total_ms)

    @contextmanager
    def timed(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, what, getattr(self, what) + (time.perf_counter() - t0) * 1e3)

    def add_io(self, io) -> None:
        """Account one I/O engine call (an IOStats)."""
        self.bytes_read += io.bytes_read
        self.bytes_wasted += io.bytes_read - io.bytes_requested
        self.reads += io.reads
        self.read_ms += io.wall_s * 1e3


class PartTimer:
    """Profiler-style timer of a backend's compute parts (see Backend.parts): milliseconds summed per
    part since the last `reset`. `sync(out)` waits for an asynchronous device or a lazy graph."""

    PARTS = ("embed", "norms", "attn_proj", "attention", "ffn", "logits")

    def __init__(self, sync=lambda out: None):
        self.sync = sync
        self.reset()

    def reset(self) -> None:
        self.ms = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)

    def add(self, part: str, t0: float, out) -> None:
        self.sync(out)
        self.add_ms(part, (time.perf_counter() - t0) * 1e3)

    def add_ms(self, part: str, ms: float) -> None:
        """Charge `ms` measured elsewhere (a native call's own clock, per step) to `part`."""
        self.ms[part] += ms
        self.calls[part] += 1


def summarize(costs: list[TokenCost], dram_bytes: int, extra: dict | None = None, prompts: int = 1) -> dict:
    """The stats dict of one call: decode-token averages, the prompt(s) separately, peak DRAM. The first
    `prompts` costs are prompts (batch mode: one per sequence); a batch step counts its `batch` tokens."""
    prompt, decode = (_combined(costs[:prompts]), costs[prompts:]) if costs else (None, [])
    tokens = sum(c.produced or c.batch for c in decode)  # a verification counts the tokens it yielded
    n = max(tokens, 1)
    out = {"decode_tokens": tokens, "dram_bytes": dram_bytes}
    for key in ("bytes_read", "bytes_wasted", "reads", "neurons_dropped", "read_ms") + TIMED + ("total_ms",):
        out[key] = sum(getattr(c, key) for c in decode) / n
    predicted = sum(c.predicted_mass for c in decode)
    out["dropped_mass_share"] = sum(c.dropped_mass for c in decode) / predicted if predicted > 0 else \
        (None if out["neurons_dropped"] else 0.0)
    if decode and decode[-1].neurons_cached:
        layers = len(decode[-1].neurons_cached)
        out["neurons_loaded_per_layer"] = [sum(c.neurons_loaded[i] for c in decode) / n for i in range(layers)]
        out["neurons_cached_per_layer"] = list(decode[-1].neurons_cached)
    layers = max((len(c.read_ahead) for c in decode), default=0)  # (a step some layers streamed has fewer)
    ahead = [c for c in decode if c.read_ahead and len(c.read_ahead) == layers]
    if any(r.active for c in ahead for r in c.read_ahead):
        def per_layer(key: str) -> np.ndarray:
            return np.sum([[getattr(r, key) for r in c.read_ahead] for c in ahead], axis=0)

        found, active, named, used = (per_layer(k) for k in ("found", "active", "named", "used"))
        out["read_ahead_recall_per_layer"] = [float(f / a) if a else None for f, a in zip(found, active)]
        out["read_ahead_recall"] = float(found.sum() / active.sum()) if active.sum() else None
        out["read_ahead_precision_per_layer"] = [float(f / m) if m else None for f, m in zip(found, named)]
        loaded = np.sum([c.neurons_loaded for c in ahead], axis=0)
        out["read_ahead_share_per_layer"] = [float(u / m) if m else None for u, m in zip(used, loaded)]
        out["neurons_read_ahead"] = sum(c.neurons_read_ahead for c in decode) / n
        out["read_ahead_unused"] = sum(c.read_ahead_unused for c in decode) / n
    if any(c.experts_hit or c.experts_missed for c in costs):
        hit, missed = (sum(getattr(c, k) for c in decode) for k in ("experts_hit", "experts_missed"))
        out.update(expert_hits=hit / n, expert_misses=missed / n,
                   expert_hit_rate=hit / (hit + missed) if hit + missed else None)
        predicted, routed = (sum(getattr(c, k) for c in decode) for k in ("experts_predicted", "experts_routed"))
        if routed:
            out.update(expert_read_ahead_recall=predicted / routed,
                       experts_read_ahead=sum(c.experts_read_ahead for c in decode) / n,
                       experts_read_ahead_unused=sum(c.experts_read_ahead_unused for c in decode) / n)
    if any(c.verify for c in decode):
        out.update(speculative_stats(decode, tokens))
    if prompt is not None:
        out["prompt"] = {"tokens": prompt.tokens, "bytes_read": prompt.bytes_read, "reads": prompt.reads,
                         "total_ms": prompt.total_ms, "io_ms": prompt.io_ms, "strategy": prompt.prefill_strategy}
        if prompt.neurons_streamed:
            out["prompt"]["neurons_streamed_per_layer"] = list(prompt.neurons_streamed)
    out["tokens_per_s"] = 1e3 / out["total_ms"] if decode and out["total_ms"] > 0 else None
    out.update(extra or {})
    return out


def speculative_stats(decode: list[TokenCost], tokens: int) -> dict:
    """What speculative decoding did: drafts verified and accepted, forward passes, flash bytes per generated token."""
    drafted, accepted = sum(c.drafted for c in decode), sum(c.accepted for c in decode)
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "forward_passes": len(decode),
            "tokens_per_forward": tokens / len(decode) if decode else None,
            "bytes_per_generated_token": sum(c.bytes_read for c in decode) / max(tokens, 1),
            "draft_ms": sum(c.draft_ms for c in decode) / max(tokens, 1)}


def _combined(prompts: list[TokenCost]) -> TokenCost:
    """The prompts of a batch as one cost (the summed tokens, bytes, reads and times; one prompt as it is)."""
    if len(prompts) == 1:
        return prompts[0]
    total = TokenCost(prefill_strategy=",".join(sorted({p.prefill_strategy for p in prompts} - {""})))
    for key in ("tokens", "bytes_read", "reads", "total_ms", "io_ms"):
        setattr(total, key, sum(getattr(p, key) for p in prompts))
    return total
