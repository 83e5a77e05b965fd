"""The runtime measured on the model being planned: a few decode tokens of one configuration, timed
by the runtime's own stats and part timer (the actual kernels, row layouts and read sizes, on the
machine as loaded now), and the factors that bring the cost model's terms to what was measured.

Why: a profile of synthetic matvecs and a scratch file misses what the runtime really does (fused
projections, strided cache rows, per-dtype kernels, Python per layer, a disk whose host caches
differ between files) and a shared machine's load changes between a profile and a run; see
docs/cost_model.md, "Calibration".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

FIELDS = ("total_ms", "compute_ms", "ffn_ms", "predictor_ms", "io_ms", "mem_ms")


@dataclass
class Measured:
    """Per-decode-token costs (ms) and counts of a short run: means over the tokens whose latency lies
    in the interquartile range (robust to a shared machine's outliers)."""

    total_ms: float
    compute_ms: float  # everything but I/O waits, placing rows and predictors (as the runtime splits it)
    ffn_ms: float  # ... of which the FFN kernels (part timer)
    predictor_ms: float
    io_ms: float
    mem_ms: float
    bytes_read: float
    reads: float
    spread: float  # half the interquartile range of the per-token totals, relative to their median
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def token_costs(model, ids: list[int], prefill: int, warmup: int = 2, min_seconds: float = 0.0,
                warm_passes: int = 0) -> list[dict]:
    """Per decode token of ids[prefill:] (after the prompt ids[:prefill] and `warmup` uncounted decode
    tokens): the runtime's stats and the FFN kernels' time from its part timer. The sequence is decoded
    again (from its prompt) until `min_seconds` have passed: on a shared machine a window of a few
    tokens sees one moment's load, not the typical one (the embedded model decodes 12 tokens in 0.1 s).
    `warm_passes` whole passes are decoded first and not counted: a model just loaded pays once for
    touching its resident weights and cache rows for the first time (page faults) and for filling its
    caches from empty, which a running model does not."""
    from flashllm.stats import PartTimer

    for _ in range(warm_passes):
        model.logits(ids, prefill)
    timer = model.backend.parts = PartTimer(model.backend.sync)
    rows, start = [], time.perf_counter()
    while not rows or time.perf_counter() - start < min_seconds:
        model.logits(ids[:prefill])
        for i, t in enumerate(ids[prefill:]):
            timer.reset()
            model.forward([t], prefill + i)
            cost = model.token_stats[-1]
            if i >= warmup:
                rows.append({**{k: cost[k] for k in FIELDS if k != "ffn_ms"}, "ffn_ms": timer.ms["ffn"],
                             "bytes_read": cost["bytes_read"], "reads": cost["reads"],
                             "neurons_dropped": cost["neurons_dropped"]})
        if len(ids) <= prefill + warmup:
            break
    model.backend.parts = None
    if not rows:
        raise ValueError(f"no decode tokens measured: {len(ids)} ids, prefill {prefill}, warm-up {warmup}")
    return rows


def typical(rows: list[dict]) -> Measured:
    """The typical token of `rows` (token_costs): means over the tokens whose latency lies in the
    interquartile range, so the parts still add up; `spread` is half that range over the median."""
    totals = np.array([r["total_ms"] for r in rows])
    q1, q3 = np.percentile(totals, [25, 75])
    mid = [r for r in rows if q1 <= r["total_ms"] <= q3]
    mean = {k: float(np.mean([r[k] for r in mid])) for k in FIELDS + ("bytes_read", "reads")}
    return Measured(**mean, spread=float((q3 - q1) / 2 / np.median(totals)), tokens=len(rows))


@dataclass
class Calibration:
    """Measured (runtime) over predicted (cost model) per term at one configuration of a mode, so that
    other configurations of that mode are predicted as measured x (model there / model here)."""

    fixed_s: float  # compute outside the FFN kernels per token (attention, head, norms, the runtime's Python)
    predictor_s: float
    ffn_scale: float
    io_scale: float
    mem_scale: float
    measured: dict  # the Measured it came from
    noise: float  # relative: gains below this are not distinguishable from the machine's variation
    const_s: tuple = (0.0, 0.0, 0.0)  # measured FFN, I/O, memory seconds where the model has none (added as is)

    def apply(self, ffn_s: float, io_s: float, mem_s: float):
        """Calibrated costmodel.Parts from the cost model's FFN, I/O and memory seconds of a configuration."""
        from flashllm.planner.cost_model import Parts

        ffn, io, mem = (scale * x + c for scale, x, c in zip((self.ffn_scale, self.io_scale, self.mem_scale),
                                                            (ffn_s, io_s, mem_s), self.const_s))
        return Parts(compute_s=self.fixed_s, ffn_s=ffn, predictor_s=self.predictor_s, io_s=io, mem_s=mem)


def cold_io_s(measured_s: float, nbytes: float, disk) -> float:
    """I/O seconds of a measured configuration, never below what its bytes take at the disk profile's
    fastest measured rate: a virtual disk's host may cache a file written or read shortly before (a model
    just converted), whose reads then run faster than the disk can, which a plan must not count on.
    Measured reads slower than that stand as measured (the cost model's random-read time is no floor: a
    disk profile taken under contention overstates it)."""
    mibps = getattr(disk, "mibps", None)
    return max(measured_s, nbytes / (max(map(max, mibps)) * (1 << 20))) if mibps else measured_s


def calibrate(m: Measured, model_ffn_s: float, model_io_s: float, model_mem_s: float,
              min_noise: float = 0.05, disk=None) -> Calibration:
    """The factors from a measurement `m` and the cost model's terms at the same configuration (a term
    the model puts at zero keeps its measured value as a constant; measured I/O as `cold_io_s`)."""

    pairs = ((m.ffn_ms / 1e3, model_ffn_s), (cold_io_s(m.io_ms / 1e3, m.bytes_read, disk), model_io_s),
             (m.mem_ms / 1e3, model_mem_s))
    scales = [measured / model if model > 0 else 1.0 for measured, model in pairs]
    return Calibration(fixed_s=(m.compute_ms - m.ffn_ms) / 1e3, predictor_s=m.predictor_ms / 1e3,
                       ffn_scale=scales[0], io_scale=scales[1], mem_scale=scales[2], measured=m.to_dict(),
                       noise=max(min_noise, m.spread),
                       const_s=tuple(0.0 if model > 0 else measured for measured, model in pairs))
