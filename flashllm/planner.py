"""`flashllm plan`: choose how to run a model at a DRAM budget by solving a small MILP on the cost model.

Inputs: the machine profile (profile.py), the disk profile of the model's disk (disk_profile.py), the
model's shapes, its predictors' sets on sample text replayed through the cache (replay.py), and a
short run of the runtime itself per mode (calibration.py), which the cost model's terms are scaled to.

The MILP (scipy.optimize.milp / HiGHS), for each compute dtype: binary y_k picks one window; binary
z[l,k,j] picks capacity c_j for layer l under window k (sum_j z[l,k,j] = y_k); the caches' bytes
sum_l c * row fit what the budget leaves after resident weights, KV cache, staging and predictors;
minimise sum z * cost[l,k,j], cost = FFN over the rows held + I/O of the loads + placing them
(costmodel.py, each term scaled as calibrated). Capacities whose replay drops predicted neurons are
excluded unless the user allows a share (`--max-dropped`; no silent quality trade). Dense (all
resident) and hybrid (the largest resident share that fits, rest streamed) have one configuration
each and are costed as measured. The cheapest wins, unless its predicted gain over the runtime's
defaults is within the measured noise: then the defaults are kept. Threads and the I/O engine stay
at the runtime's defaults; no hot set is chosen; FFN quantization is as converted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import costmodel as cm
from .errors import FlashLLMError
from .replay import Replays, sample_ids, sample_masks

PLAN_FILE = "plan.json"
PLAN_FORMAT, PLAN_VERSION = "flashllm-plan", 1
MAX_DROPPED = 0.0  # default share of predicted neurons a plan may drop for lack of cache rows
SAMPLE_TOKENS = 512
CALIBRATE_TOKENS = 12  # decode tokens the runtime measures per mode (0: the cost model alone)
CALIBRATE_PREFILL, CALIBRATE_WARMUP = 4, 2  # prompt tokens before them; decode tokens not counted


@dataclass
class Plan:
    """The chosen way to run a model at a budget, with its predicted cost per decode token."""

    mode: str
    dtype: str
    dram_budget: int | None
    window: int = 4
    cache_rows: list[int] | None = None
    hybrid_fraction: float | None = None
    threads: int = 32
    predicted: dict = field(default_factory=dict)  # total_ms and its parts
    alternatives: list = field(default_factory=list)  # the other options costed, best first
    notes: list = field(default_factory=list)
    key: dict = field(default_factory=dict)  # what this plan was made for (model, predictors, machine)

    def load_options(self) -> dict:
        opts = {"mode": self.mode, "dtype": self.dtype, "dram_budget": self.dram_budget, "threads": self.threads}
        if self.mode == "sparse":
            opts.update(window=self.window, cache_rows=tuple(self.cache_rows) if self.cache_rows else None)
        if self.mode == "hybrid":
            opts["hybrid_fraction"] = self.hybrid_fraction
        return opts

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "format_version": PLAN_VERSION, **asdict(self)}

    def describe(self) -> str:
        p = self.predicted
        what = {"sparse": f"sparse, window {self.window}, cache rows per layer {self.cache_rows}",
                "hybrid": f"hybrid, resident share {self.hybrid_fraction:.3f}", "dense": "dense (all resident)"}
        lines = [f"plan: {what[self.mode]}, compute dtype {self.dtype}, threads {self.threads}",
                 f"predicted decode token: {p['total_ms']:.2f} ms = compute {p['compute_ms']:.2f} + predictor "
                 f"{p['predictor_ms']:.2f} + I/O {p['io_ms']:.2f} + memory {p['mem_ms']:.2f} ms"
                 + (f"; {p['bytes_per_token'] / 1024:.1f} KiB and {p['reads_per_token']:.1f} reads per token"
                    if "bytes_per_token" in p else "")]
        for a in self.alternatives[:6]:
            lines.append(f"  alternative: {a['what']}: {a['total_ms']:.2f} ms")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# -- memory: what the runtime counts (budget.py, modes.py) --------------------------------------
def fixed_bytes(manifest, dtype: str, context: int, predictor_ranks: list[int] | None) -> dict:
    """Bytes each mode holds besides its FFN rows, as `Model.counted` adds them up on a CPU."""
    from . import format as fmt
    from .budget import row_bytes

    spec, lay, it = manifest.spec, manifest.layout, cm.ITEMSIZE[dtype]
    resident = sum(int(np.prod(s)) for s in fmt.resident_shapes(spec).values()) * it
    kv = 2 * spec.n_layers * context * spec.n_kv_heads * spec.head_dim * it
    in_place = dtype == manifest.dtype and manifest.data.get("quantization", "none") == "none"
    staging_rows = max(1, min((1 << 20) // lay.stride, spec.d_ffn))
    pred = sum(r * spec.d_model + spec.d_ffn * r + spec.d_ffn for r in predictor_ranks or []) * it
    return {"resident": resident + kv, "predictors": pred, "staging": 0 if in_place else 2 * staging_rows * lay.stride,
            "row": row_bytes(lay, in_place, it), "in_place": in_place,
            "dense_rows": spec.n_layers * spec.d_ffn * len(lay.parts) * spec.d_model * it}


def _runtime_capacities(avail: int, row: int, spec, fractions, unlimited: bool) -> list[int] | None:
    """The cache rows the runtime gives each layer by default (budget.sparse_capacities), if any fit."""
    from .budget import sparse_capacities

    if avail < spec.n_layers * row:
        return None
    usable = fractions if all(isinstance(f, (int, float)) and f > 0 for f in fractions) else None
    return sparse_capacities(None if unlimited else avail, row, spec.n_layers, spec.d_ffn, usable)


def _budget_bytes(budget, manifest) -> int | None:
    from .budget import budget_bytes

    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    return budget_bytes(budget, model_bytes)


# -- costs ---------------------------------------------------------------------------------------
def sparse_cost(machine, disk, manifest, dtype: str, mem: dict, point: dict, rank: int, threads: int) -> cm.Parts:
    """One layer's decode-token cost at a replayed (window, capacity) point."""
    spec, lay = manifest.spec, manifest.layout
    nbytes = point["transferred"] * lay.stride
    placed = machine.cast_s(manifest.dtype, dtype, point["loaded"] * (lay.stride if mem["in_place"] else mem["row"]))
    return cm.Parts(compute_s=machine.layer_s["sparse"], ffn_s=cm.ffn_s(machine, spec, dtype, point["held"]),
                    predictor_s=cm.predictor_s(machine, spec, dtype, rank, fixed=True),
                    io_s=cm.io_s(disk, point["reads"], nbytes, threads), mem_s=placed)


def _sparse_parts(machine, disk, manifest, dtype, mem, replays, window, caps, ranks, threads) -> tuple[cm.Parts, dict]:
    """Predicted parts of sparse decoding at `window` and per-layer `caps`, and its bytes, reads and drops."""
    parts, extra = _resident_parts(machine, manifest.spec, dtype), {"bytes_per_token": 0.0, "reads_per_token": 0.0}
    dropped = []
    for layer, cap in enumerate(caps):
        pt = replays.at(layer, window, cap)
        parts = parts + sparse_cost(machine, disk, manifest, dtype, mem, pt, ranks[layer], threads)
        extra["bytes_per_token"] += pt["transferred"] * manifest.layout.stride
        extra["reads_per_token"] += pt["reads"]
        dropped.append(pt["drop_share"])
    extra["dropped_share"] = float(np.mean(dropped))
    return parts, extra


def _resident_parts(machine, spec, dtype: str) -> cm.Parts:
    return cm.Parts(compute_s=cm.head_s(machine, spec, dtype) + spec.n_layers * cm.attention_s(machine, spec, dtype))


def dense_cost(machine, manifest, dtype: str) -> cm.Parts:
    spec = manifest.spec
    p = _resident_parts(machine, spec, dtype)
    p.compute_s += spec.n_layers * machine.layer_s["dense"]
    p.ffn_s = spec.n_layers * cm.ffn_s(machine, spec, dtype, spec.d_ffn)
    return p


def hybrid_cost(machine, disk, manifest, dtype: str, mem: dict, resident_rows: int, threads: int) -> cm.Parts:
    spec, lay = manifest.spec, manifest.layout
    streamed = (spec.d_ffn - resident_rows) * lay.stride
    p = dense_cost(machine, manifest, dtype)
    p.io_s = spec.n_layers * cm.io_s(disk, math.ceil(streamed / (1 << 20)), streamed, threads)
    p.mem_s = spec.n_layers * machine.cast_s(manifest.dtype, dtype, (spec.d_ffn - resident_rows) * mem["row"])
    return p


# -- the MILP ------------------------------------------------------------------------------------
def solve_sparse(layer_costs: list[dict], layer_curves: list[dict], row: int, avail: int) -> tuple[int, list[int], float] | None:
    """min sum cost over (window, per-layer capacity) with the caches' bytes <= avail; None if infeasible.

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
    mem = np.concatenate([np.zeros(K), np.array(size, float)])
    rows.append(mem), lo.append(-np.inf), hi.append(float(avail))
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


# -- the plan ------------------------------------------------------------------------------------
def _key(manifest, machine, disk, budget, context: int) -> dict:
    from .predictor import PREDICTOR_FILE

    pred = manifest.root / PREDICTOR_FILE
    return {"ffn_sha256": manifest.data["files"]["ffn"]["sha256"],
            "predictors_sha256": _sha(pred) if pred.is_file() else None,
            "machine": f"{machine.host}-{machine.backend}-{machine.device}", "machine_measured": machine.measured_at,
            "disk_measured": getattr(disk, "date", None), "dram_budget": budget, "context": context}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_plan(model_dir, budget, machine, disk, data: str | None = None, dtypes: list[str] | None = None,
              context: int | None = None, threads: int = 32, sample_tokens: int = SAMPLE_TOKENS,
              max_dropped: float = MAX_DROPPED, gap_bytes: int | None = 0, calibrate_tokens: int = CALIBRATE_TOKENS,
              log=None) -> Plan:
    """The cheapest way (by the cost model) to decode with `model_dir` within `budget` bytes or fraction.

    With `calibrate_tokens` > 0 the runtime itself decodes that many tokens of each mode's reference
    configuration first (calibration.py): dense and hybrid are then costed as measured, sparse by the
    cost model scaled per term to its measurement at the runtime's default caches; and a plan whose
    predicted gain over those defaults is below the measured noise keeps the defaults."""
    from . import format as fmt
    from .backends.base import default_compute_dtype
    from .predictor import PREDICTOR_META

    log = log or (lambda msg: None)
    manifest = fmt.read_manifest(model_dir, verify=False)
    spec = manifest.spec
    if spec.is_moe:
        raise FlashLLMError(f"{model_dir}: flashllm plan does not cover mixture-of-experts models yet")
    context = min(context or 4096, spec.context_limit)
    nbudget = _budget_bytes(budget, manifest)
    meta = json.loads((manifest.root / PREDICTOR_META).read_text()) if (manifest.root / PREDICTOR_META).is_file() else None
    ranks = [int(layer["rank"]) for layer in meta["layers"]] if meta else None
    fractions = [f.get("predicted_fraction") for f in meta["layers"]] if meta else None
    ids = sample_ids(model_dir, data, CALIBRATE_PREFILL + CALIBRATE_WARMUP + calibrate_tokens) if calibrate_tokens else None
    options, notes, reference, defaults, noise = [], [], [], None, 0.0
    dtypes = dtypes or [default_compute_dtype(None, manifest.dtype, True)]

    def measured(plan: Plan, what: str):
        """The runtime's own costs of `plan` (calibration.Measured), or None with a note if it cannot run."""
        from . import calibration

        log(f"measuring {what} ({calibrate_tokens} decode tokens)")
        try:
            return calibration.measure(model_dir, {**plan.load_options(), "context": context}, ids,
                                       CALIBRATE_PREFILL, CALIBRATE_WARMUP)
        except FlashLLMError as exc:
            notes.append(f"{what}: not measured, left out ({exc})")
            return None

    def add(parts: cm.Parts, plan: Plan, what: str, m=None) -> None:
        nonlocal noise
        if m is not None:  # costed as measured
            plan.predicted = {**plan.predicted, "model_ms": parts.total_s * 1e3, "calibrated": True}
            parts = cm.Parts(compute_s=(m.compute_ms - m.ffn_ms) / 1e3, ffn_s=m.ffn_ms / 1e3,
                             predictor_s=m.predictor_ms / 1e3, io_s=m.io_ms / 1e3, mem_s=m.mem_ms / 1e3)
            noise = max(noise, m.spread)
        options.append((parts, plan, what))

    def sparse_defaults(dtype: str) -> tuple[dict, int, list[int] | None]:
        """(memory, bytes for caches, the runtime's default cache rows) at this budget."""
        mem = fixed_bytes(manifest, dtype, context, ranks)
        avail = (10 ** 18) if nbudget is None else nbudget - mem["resident"] - mem["staging"] - mem["predictors"]
        return mem, avail, _runtime_capacities(avail, mem["row"], spec, fractions, nbudget is None)

    # the sparse defaults are measured first, before the replay or another mode has read the model's file
    # (reads a host-side disk cache still holds would flatter them)
    sparse_measured = {}
    for dtype in dtypes if meta and ids else ():
        default = sparse_defaults(dtype)[2]
        if default is not None:
            sparse_measured[dtype] = measured(Plan("sparse", dtype, nbudget, window=4, cache_rows=default,
                                                   threads=threads), f"sparse window 4, runtime defaults, compute {dtype}")
    replays = None
    if meta:
        log(f"replaying the predictors' sets on {sample_tokens} sample tokens through the cache")
        stride = manifest.layout.stride
        gap_rows = (disk.gap_bytes(threads) if gap_bytes is None else gap_bytes) // stride
        replays = Replays(sample_masks(model_dir, data, sample_tokens), spec.d_ffn, gap_rows, max(1, (1 << 20) // stride))

    for dtype in dtypes:
        mem = fixed_bytes(manifest, dtype, context, ranks)
        tag = f"compute {dtype}"
        dense_need = mem["resident"] + mem["dense_rows"]
        if nbudget is None or dense_need <= nbudget:
            plan = Plan("dense", dtype, nbudget, threads=threads)
            m = measured(plan, f"dense, {tag}") if ids else None
            if m is not None or not ids:
                add(dense_cost(machine, manifest, dtype), plan, f"dense, {tag}", m)
        base = mem["resident"] + manifest.layout.d_ffn * manifest.layout.stride
        avail = None if nbudget is None else nbudget - base - spec.d_ffn * mem["row"]
        if avail is None or avail >= 0:
            h = spec.d_ffn // 2 if avail is None else min(spec.d_ffn, avail // (spec.n_layers * mem["row"]))
            plan = Plan("hybrid", dtype, nbudget, hybrid_fraction=h / spec.d_ffn, threads=threads)
            what = f"hybrid {h}/{spec.d_ffn} resident, {tag}"
            m = measured(plan, what) if ids else None
            if m is not None or not ids:
                add(hybrid_cost(machine, disk, manifest, dtype, mem, h, threads), plan, what, m)
        if replays is None:
            continue
        mem, avail, default = sparse_defaults(dtype)
        layer_curves = replays.curves(default)
        cal = None
        if default is not None:  # the runtime's own sizing at the default window: the hand defaults
            parts, extra = _sparse_parts(machine, disk, manifest, dtype, mem, replays, 4, default, ranks, threads)
            what = f"sparse window 4, runtime default caches, {tag}"
            plan = Plan("sparse", dtype, nbudget, window=4, cache_rows=default, threads=threads, predicted=extra)
            m = sparse_measured.get(dtype)
            if m is not None:
                from . import calibration

                cal = calibration.calibrate(m, parts.ffn_s, parts.io_s, parts.mem_s)
                plan.predicted.update(model_ms=parts.total_s * 1e3, calibrated=True,
                                      calibration={k: getattr(cal, k) for k in ("ffn_scale", "io_scale", "mem_scale")})
                parts, noise = cal.apply(parts.ffn_s, parts.io_s, parts.mem_s), max(noise, cal.noise)
            if extra["dropped_share"] > max_dropped:
                reference.append({"what": f"{what} (drops {extra['dropped_share']:.1%} of predicted neurons)",
                                  **parts.to_ms(), **plan.predicted})
            elif m is not None or not ids:
                options.append((parts, plan, what))
                defaults = plan

        def weigh(p: cm.Parts) -> float:  # what a layer's choice changes (calibrated: as measured)
            return p.total_s if cal is None else cal.ffn_scale * p.ffn_s + cal.io_scale * p.io_s + cal.mem_scale * p.mem_s

        costs = [{k: [(weigh(sparse_cost(machine, disk, manifest, dtype, mem, pt, ranks[l], threads))
                       if pt["drop_share"] <= max_dropped else None) for pt in pts]
                  for k, pts in cur.items()} for l, cur in enumerate(layer_curves)]
        found = solve_sparse(costs, layer_curves, mem["row"], avail)
        if found is None:
            notes.append(f"sparse, {tag}: no window and capacities fit while dropping at most {max_dropped:.1%} "
                         f"of the predicted neurons (--max-dropped allows more, at a quality cost)")
            continue
        window, caps, _ = found
        if defaults is not None and (window, caps) == (defaults.window, defaults.cache_rows):
            continue  # the MILP's choice is the runtime's default
        parts, extra = _sparse_parts(machine, disk, manifest, dtype, mem, replays, window, caps, ranks, threads)
        if cal is not None:
            extra.update(model_ms=parts.total_s * 1e3, calibrated=True)
            parts = cal.apply(parts.ffn_s, parts.io_s, parts.mem_s)
        options.append((parts, Plan("sparse", dtype, nbudget, window=window, cache_rows=caps, threads=threads,
                                    predicted=extra), f"sparse window {window}, {tag}, {sum(caps)} cache rows"))
    if not options:
        raise FlashLLMError(f"{model_dir}: nothing fits --dram-budget {budget} (see `flashllm generate --help` "
                            f"for the smallest budget each mode needs)")
    options.sort(key=lambda o: o[0].total_s)
    if defaults is not None and options[0][1] is not defaults and noise > 0:
        default_s = next(p.total_s for p, o, _ in options if o is defaults)
        gain = 1 - options[0][0].total_s / default_s
        if gain < noise:  # not distinguishable from the machine's variation: keep what is known to work
            notes.append(f"kept the runtime defaults: the best alternative ({options[0][2]}) is predicted only "
                         f"{gain:.1%} faster, within the measured noise of {noise:.1%}")
            options.sort(key=lambda o: o[1] is not defaults)
    parts, best, _ = options[0]
    best.predicted = {**parts.to_ms(), **best.predicted}
    best.alternatives = [{"what": w, **p.to_ms(), **o.predicted} for p, o, w in options[1:]] + reference
    best.notes = notes + ["threads and the I/O engine: runtime defaults; hot set: not chosen (no pinned set in "
                          "the runtime yet); FFN quantization: as converted"]
    if ids:
        best.notes.append(f"calibrated on {calibrate_tokens} decode tokens per mode measured now; noise "
                          f"(half the interquartile range of per-token latency) {noise:.1%}")
    best.key = _key(manifest, machine, disk, budget, context)
    return best


def save_plan(model_dir, plan: Plan) -> Path:
    """plan.json in the model directory, written to a temporary file and renamed."""
    path = Path(model_dir) / PLAN_FILE
    tmp = path.parent / f".{PLAN_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def saved_plan(model_dir) -> Plan | None:
    path = Path(model_dir) / PLAN_FILE
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if d.get("format") != PLAN_FORMAT or d.get("format_version") != PLAN_VERSION:
        return None
    return Plan(**{k: v for k, v in d.items() if k not in ("format", "format_version")})
