"""Sparse mode for `flashllm plan`: what the runtime's sparse plan holds at a budget (read from the
runtime itself, never re-derived), its cost at a replayed (window, capacities) point, and the MILP
that picks the window and per-layer capacities.

The runtime is loaded once per candidate predictor at the budget (`probe`): the bytes its caches may
take, a cache row's bytes, its default capacities, the read layout (a resident gate leaves up and
down rows to read), the staging chunk and direct-I/O alignment its reads go through, and whether it
pins hot neurons. The replay (flashllm/planner/replay.py) then counts reads and bytes as that reader issues them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashllm.planner import cost_model as cm
from flashllm.planner.replay import ReadGeometry


@dataclass
class SparseFacts:
    """The runtime's sparse plan at one budget, compute dtype and predictor."""

    predictor: str  # the kind it runs (auto resolved: gate or lowrank)
    fixed: int  # bytes charged besides the caches: resident weights, KV cache, staging, predictor
    avail: int | None  # bytes its caches may take: the budget less `fixed` (None: unlimited)
    row: int  # bytes one cached neuron takes
    capacities: list[int]  # its default cache rows per layer
    geometry: ReadGeometry  # how its missing neurons become reads
    in_place: bool  # reads land in cache rows (no staging copy or cast)
    hot: list | None  # activation frequencies it pins by (None: no pinning)
    ranks: list[int] | None  # low-rank predictor ranks (None: the gate predictor)
    predictor_bytes: int
    engine: str = "preadv"  # its reader's I/O engine (FlashReader.engine): which disk profile costs its reads
    inflight: int = 32  # the most reads that engine has in flight (AIO depth, or reader threads)


def probe(model) -> SparseFacts:
    """The facts of a model loaded in sparse mode (flashllm.load(..., mode="sparse"))."""
    from flashllm.modes.sparse.mode import activation_frequencies

    plan, ctx, B = model.mode_impl, model.mode_context, model.backend
    pred = plan.predictor
    fixed = ctx.charged(plan.host_bytes(), B.nbytes() + pred.nbytes())
    lay = plan.lay
    geometry = ReadGeometry(lay, plan.reader.io.gap_bytes, None if B.reads_in_place() else B.staging_rows(lay.stride),
                            plan.reader.io.alignment)
    hot = activation_frequencies(ctx) if model.options.pin_hot else None
    ranks = [int(a.shape[0]) for a in pred.proj_in] if pred.kind == "lowrank" else None
    io = plan.reader.io
    return SparseFacts(pred.kind, fixed, None if ctx.budget is None else ctx.budget - fixed, ctx.row_bytes(lay), list(plan.capacities), geometry, B.reads_in_place(),
                       hot, ranks, pred.nbytes(), io.engine, io.aio_depth if io.engine == "aio" else io.threads)


def point_cost(machine, disk, manifest, dtype: str, facts: SparseFacts, point: dict, layer: int,
               threads: int) -> cm.Parts:
    """One layer's decode-token cost at a replayed (window, capacity) point."""
    spec, lay = manifest.spec, facts.geometry.layout
    placed = machine.cast_s(manifest.dtype, dtype, point["loaded"] * (lay.stride if facts.in_place else facts.row)) + \
        machine.layer_s.get("sparse_mem", 0.0)  # the cache's bookkeeping, timed as memory by the runtime
    if facts.ranks is None:  # the gate predictor: every gate row, its pre-activations reused by the FFN
        predictor = machine.matvec_s(dtype, spec.d_ffn, spec.d_model, cm.ITEMSIZE[dtype]) + \
            machine.layer_s.get("predictor", 0.0)
    else:
        predictor = cm.predictor_s(machine, spec, dtype, facts.ranks[layer], fixed=True)
    return cm.Parts(compute_s=machine.layer_s["sparse"],
                    ffn_s=cm.ffn_s(machine, spec, dtype, point["held"], len(lay.parts)),
                    predictor_s=predictor, io_s=cm.io_s(disk, point["reads"], point["bytes"], threads,
                                                                  point["calls"]), mem_s=placed)


def parts_at(machine, disk, manifest, dtype, facts, replays, window, caps, threads) -> tuple[cm.Parts, dict]:
    """Predicted parts of sparse decoding at `window` and per-layer `caps`, with its bytes, reads, drops
    and pinned rows per token."""
    spec = manifest.spec
    parts = cm.Parts(compute_s=cm.head_s(machine, spec, dtype) + spec.n_layers * cm.attention_s(machine, spec, dtype))
    extra = {"bytes_per_token": 0.0, "reads_per_token": 0.0, "pinned": 0}
    dropped = []
    for layer, cap in enumerate(caps):
        pt = replays.at(layer, window, cap)
        parts = parts + point_cost(machine, disk, manifest, dtype, facts, pt, layer, threads)
        extra["bytes_per_token"] += pt["bytes"]
        extra["reads_per_token"] += pt["reads"]
        extra["pinned"] += pt["pinned"]
        dropped.append(pt["drop_share"])
    extra["dropped_share"] = float(np.mean(dropped))
    return parts, extra


def solve(layer_costs: list[dict], layer_curves: list[dict], row: int, avail: int | None) -> tuple[int, list[int], float] | None:
    """min sum cost over (window, per-layer capacity) with the caches' bytes <= avail; None if infeasible.

    The MILP (scipy.optimize.milp / HiGHS): binary y_k picks one window; binary z[l,k,j] picks capacity
    c_j for layer l under window k (sum_j z[l,k,j] = y_k); sum z * c * row <= avail.
    layer_costs[l][k][j]: seconds at capacity point j of window k (None: excluded)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    windows = sorted(layer_curves[0])
    index, cost, size = [], [], []
    for k in windows:
        for l, (lc, cur) in enumerate(zip(layer_costs, layer_curves)):
            for j, (c, pt) in enumerate(zip(lc[k], cur[k])):
                if c is not None:
                    index.append((k, l, j))
                    cost.append(c)
                    size.append(pt["capacity"] * row)
    nz, K = len(index), len(windows)
    if nz == 0:
        return None
    c = np.concatenate([np.zeros(K), np.array(cost)])
    rows, lo, hi = [], [], []
    one = np.zeros(K + nz)
    one[:K] = 1
    rows.append(one), lo.append(1), hi.append(1)  # exactly one window
    for ki, k in enumerate(windows):
        for l in range(len(layer_curves)):
            r = np.zeros(K + nz)
            r[ki] = -1
            for v, (kk, ll, _) in enumerate(index):
                if kk == k and ll == l:
                    r[K + v] = 1
            rows.append(r), lo.append(0), hi.append(0)  # one capacity per layer under the chosen window
    if avail is not None:
        rows.append(np.concatenate([np.zeros(K), np.array(size, float)])), lo.append(-np.inf), hi.append(float(avail))
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=np.ones(K + nz),
               bounds=Bounds(0, 1))
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    window = windows[int(np.argmax(x[:K]))]
    caps = [0] * len(layer_curves)
    for v, (k, l, j) in enumerate(index):
        if x[K + v]:
            caps[l] = layer_curves[l][k][j]["capacity"]
    return window, caps, float(res.fun)
