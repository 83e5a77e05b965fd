"""`flashllm plan`: choose how to run a model at a DRAM budget by solving a small MILP on the cost model.

Inputs: the machine profile (profile.py), the disk profile of the model's disk (disk_profile.py), the
model's shapes and its predictors' behaviour on sample text: per layer, the predicted set of every
token, replayed through the runtime's own NeuronCache for each window k and a ladder of capacities c
to count bundles loaded, reads issued (runs of adjacent ids), rows held and neurons dropped per token.

The MILP (scipy.optimize.milp / HiGHS), for each compute dtype: binary y_k picks one window; binary
z[l,k,j] picks capacity c_j for layer l under window k (sum_j z[l,k,j] = y_k); the caches' bytes
sum_l c * row fit what the budget leaves after resident weights, KV cache, staging and predictors;
minimise sum z * cost[l,k,j], cost = predictor + FFN over the rows held + I/O of the loads + placing
them (costmodel.py). Capacities whose replay drops predicted neurons are
excluded unless the user allows a share (`--max-dropped`; no silent quality trade). Dense (all resident) and hybrid (the largest resident share that
fits, rest streamed sequentially) are costed in closed form; the cheapest choice wins.
Threads and the I/O engine stay at the runtime's defaults (threads only matter past them); the hot
set is not chosen (the runtime has no pinned hot set yet); FFN quantization is as converted.
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

PLAN_FILE = "plan.json"
PLAN_FORMAT, PLAN_VERSION = "flashllm-plan", 1
WINDOWS = (1, 2, 3, 4, 6, 8)
CAPACITY_POINTS = 8
MAX_DROPPED = 0.0  # default share of predicted neurons a plan may drop for lack of cache rows
SAMPLE_TOKENS = 512


class _NoStore:
    """NeuronCache bookkeeping without rows: what the replay needs."""

    def move(self, dst, src):
        pass


def reads_of(ids: np.ndarray, gap_rows: int, chunk_rows: int) -> tuple[int, int]:
    """(reads, bundles transferred) for sorted needed ids, as the engine plans them: ids at most `gap_rows`
    apart are read with the gap in one read, a read holds at most `chunk_rows` bundles."""
    if not len(ids):
        return 0, 0
    brk = np.flatnonzero(np.diff(ids) > gap_rows + 1)
    starts, ends = np.concatenate([[ids[0]], ids[brk + 1]]), np.concatenate([ids[brk], [ids[-1]]])
    spans = ends - starts + 1
    return int(np.sum(-(-spans // chunk_rows))), int(spans.sum())


def replay(masks: list[np.ndarray], window: int, capacity: int, d_ffn: int, gap_rows: int = 0,
           chunk_rows: int = 1 << 30) -> dict:
    """One layer's predicted sets (bool [tokens, d_ffn] per sequence) through a NeuronCache: per token
    means of bundles loaded, bundles transferred (gaps included), reads, rows held; and the share of
    predicted neurons dropped for lack of rows."""
    from .neuron_cache import NeuronCache

    cache = NeuronCache(capacity, d_ffn, _NoStore())
    loaded = moved = reads = held = dropped = predicted = tokens = 0
    for seq in masks:
        cache.reset()
        for row in seq:
            active = np.flatnonzero(row)
            predicted += len(active)
            if len(active) > capacity:
                active, dropped = active[:capacity], dropped + len(active) - capacity
            missing, _, cut = cache.evict(active, window)
            missing, dropped = missing[:len(missing) - cut] if cut else missing, dropped + cut
            cache.append(missing)
            r, b = reads_of(missing, gap_rows, chunk_rows)
            loaded, moved, reads = loaded + len(missing), moved + b, reads + r
            held, tokens = held + cache.num_used, tokens + 1
    n = max(tokens, 1)
    return {"loaded": loaded / n, "transferred": moved / n, "reads": reads / n, "held": held / n,
            "drop_share": dropped / max(predicted, 1)}


def sample_masks(model_dir, data: str | None, tokens: int, seq_len: int = 128) -> list[list[np.ndarray]]:
    """Per layer, per sequence: the trained predictors' sets on `tokens` tokens of sample text (the
    file `data`, or this Python's standard library sources when None)."""
    from . import load
    from .predictor import LowRankPredictor

    model = load(model_dir, mode="dense", context=seq_len) if _fits_dense(model_dir) else \
        load(model_dir, mode="naive", context=seq_len)
    predictor = LowRankPredictor(model.plan_context)
    seq_len = min(seq_len, model.context)
    text = Path(data).read_text(errors="replace") if data else _stdlib_text(tokens * 8)
    ids = model.tokenizer.encode(text)[:tokens] if model.manifest.has("tokenizer.json") else \
        list(np.random.default_rng(0).integers(3, model.spec.vocab_size, tokens))
    per_layer = [[] for _ in range(model.spec.n_layers)]
    with model.hooks.observing("ffn_input", lambda layer, x: per_layer[layer][-1].append(predictor.predict(layer, x))):
        for k in range(0, len(ids), seq_len):
            for lst in per_layer:
                lst.append([])
            model.plan.reset()
            model.forward([int(i) for i in ids[k:k + seq_len]], 0)
    return [[np.concatenate(s) for s in lst if s] for lst in per_layer]


def _fits_dense(model_dir) -> bool:
    from . import format as fmt

    m = fmt.read_manifest(model_dir, verify=False)
    return m.data["files"]["ffn"]["size"] < (1 << 30)


def _stdlib_text(nbytes: int) -> str:
    """Real text on every machine: this Python's standard library sources, in a fixed order."""
    import sysconfig

    root, out, size = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for p in sorted(root.glob("*.py")):
        text = p.read_text(errors="replace")
        out.append(text)
        size += len(text)
        if size >= nbytes:
            break
    return "\n\n".join(out)


class Replays:
    """Replayed cache behaviour per (layer, window, capacity), computed once each."""

    def __init__(self, masks_per_layer, d_ffn: int, gap_rows: int = 0, chunk_rows: int = 1 << 30):
        self.masks, self.d_ffn, self._memo = masks_per_layer, d_ffn, {}
        self.gap_rows, self.chunk_rows = gap_rows, chunk_rows
        self.sizes = [np.concatenate([m.sum(axis=1) for m in masks]) for masks in masks_per_layer]

    def at(self, layer: int, window: int, capacity: int) -> dict:
        key = (layer, window, min(capacity, self.d_ffn))
        if key not in self._memo:
            self._memo[key] = {"capacity": key[2], **replay(self.masks[layer], window, key[2], self.d_ffn,
                                                            self.gap_rows, self.chunk_rows)}
        return self._memo[key]

    def curves(self, extra: list[int] | None = None, windows=WINDOWS, points: int = CAPACITY_POINTS) -> list[dict]:
        """Per layer, per window: replays at a ladder of capacities from the median set per token to the
        window's largest union, plus `extra[layer]` (e.g. what the runtime would size by default)."""
        out = []
        for layer, masks in enumerate(self.masks):
            low = max(int(np.percentile(self.sizes[layer], 50)), 1)
            curve = {}
            for k in windows:
                top = max(_max_union(masks, k), low)
                caps = {int(c) for c in np.linspace(low, top, points)} | ({min(extra[layer], top)} if extra else set())
                curve[k] = [self.at(layer, k, c) for c in sorted(caps)]
            out.append(curve)
        return out


def _max_union(masks, k: int) -> int:
    best = 0
    for m in masks:
        u = m.copy()
        for j in range(1, k):
            u[j:] |= m[:-j]
        best = max(best, int(u.sum(axis=1).max()) if len(u) else 0)
    return best


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
    return cm.Parts(compute_s=cm.ffn_s(machine, spec, dtype, point["held"]) + machine.layer_s["sparse"],
                    predictor_s=cm.predictor_s(machine, spec, dtype, rank, fixed=True),
                    io_s=cm.io_s(disk, point["reads"], nbytes, threads), mem_s=placed)


def _sparse_parts(machine, disk, manifest, dtype, mem, replays, window, caps, ranks, threads) -> tuple[cm.Parts, dict]:
    """Predicted parts of sparse decoding at `window` and per-layer `caps`, and its bytes, reads and drops."""
    parts, extra = _resident_parts(machine, manifest.spec, dtype), {"bytes_per_token": 0.0, "reads_per_token": 0.0}
    dropped = []
    for layer, cap in enumerate(caps):
        pt = replays.at(layer, window, cap)
        lp = sparse_cost(machine, disk, manifest, dtype, mem, pt, ranks[layer], threads)
        for f in ("compute_s", "predictor_s", "io_s", "mem_s"):
            setattr(parts, f, getattr(parts, f) + getattr(lp, f))
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
    p.compute_s += spec.n_layers * (cm.ffn_s(machine, spec, dtype, spec.d_ffn) + machine.layer_s["dense"])
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
              max_dropped: float = MAX_DROPPED, gap_bytes: int | None = None, log=None) -> Plan:
    """The cheapest way (by the cost model) to decode with `model_dir` within `budget` bytes or fraction."""
    from . import format as fmt
    from .predictor import PREDICTOR_META

    log = log or (lambda msg: None)
    manifest = fmt.read_manifest(model_dir, verify=False)
    spec = manifest.spec
    if spec.is_moe:
        raise FlashLLMError(f"{model_dir}: flashllm plan does not cover mixture-of-experts models yet")
    context = min(context or 4096, spec.context_limit)
    nbudget = _budget_bytes(budget, manifest)
    has_pred = (manifest.root / PREDICTOR_META).is_file()
    ranks = [int(layer["rank"]) for layer in json.loads((manifest.root / PREDICTOR_META).read_text())["layers"]] \
        if has_pred else None
    replays = None
    if has_pred:
        log(f"replaying the predictors' sets on {sample_tokens} sample tokens through the cache")
        stride = manifest.layout.stride
        gap_rows = (disk.gap_bytes(threads) if gap_bytes is None else gap_bytes) // stride
        replays = Replays(sample_masks(model_dir, data, sample_tokens), spec.d_ffn, gap_rows, max(1, (1 << 20) // stride))
        fractions = [f.get("predicted_fraction") for f in json.loads((manifest.root / PREDICTOR_META).read_text())["layers"]]
    options, notes, reference = [], [], []
    from .backends.base import default_compute_dtype

    for dtype in dtypes or [default_compute_dtype(None, manifest.dtype, True)]:
        mem = fixed_bytes(manifest, dtype, context, ranks)
        tag = f"compute {dtype}"
        dense_need = mem["resident"] + mem["dense_rows"]
        if nbudget is None or dense_need <= nbudget:
            options.append((dense_cost(machine, manifest, dtype), Plan("dense", dtype, nbudget, threads=threads),
                            f"dense, {tag}"))
        base = mem["resident"] + manifest.layout.d_ffn * manifest.layout.stride
        avail = None if nbudget is None else nbudget - base - spec.d_ffn * mem["row"]
        if avail is None or avail >= 0:
            h = spec.d_ffn // 2 if avail is None else min(spec.d_ffn, avail // (spec.n_layers * mem["row"]))
            options.append((hybrid_cost(machine, disk, manifest, dtype, mem, h, threads),
                            Plan("hybrid", dtype, nbudget, hybrid_fraction=h / spec.d_ffn, threads=threads),
                            f"hybrid {h}/{spec.d_ffn} resident, {tag}"))
        if replays is not None:
            avail = (10 ** 18) if nbudget is None else nbudget - mem["resident"] - mem["staging"] - mem["predictors"]
            default = _runtime_capacities(avail, mem["row"], spec, fractions, nbudget is None)
            layer_curves = replays.curves(default)
            costs = [{k: [(sparse_cost(machine, disk, manifest, dtype, mem, pt, ranks[l], threads).total_s
                           if pt["drop_share"] <= max_dropped else None) for pt in pts]
                      for k, pts in cur.items()} for l, cur in enumerate(layer_curves)]
            found = solve_sparse(costs, layer_curves, mem["row"], avail)
            if found is None:
                notes.append(f"sparse, {tag}: no window and capacities fit while dropping at most {max_dropped:.1%} "
                             f"of the predicted neurons (--max-dropped allows more, at a quality cost)")
            else:
                window, caps, _ = found
                parts, extra = _sparse_parts(machine, disk, manifest, dtype, mem, replays, window, caps, ranks, threads)
                plan = Plan("sparse", dtype, nbudget, window=window, cache_rows=caps, threads=threads)
                plan.predicted = extra
                options.append((parts, plan, f"sparse window {window}, {tag}, {sum(caps)} cache rows"))
            if default is not None:  # the runtime's own sizing at the default window, for comparison
                parts, extra = _sparse_parts(machine, disk, manifest, dtype, mem, replays, 4, default, ranks, threads)
                if extra["dropped_share"] > max_dropped:
                    reference.append({"what": f"sparse window 4, runtime default caches, {tag} (drops "
                                              f"{extra['dropped_share']:.1%} of predicted neurons)", **parts.to_ms(), **extra})
                else:
                    options.append((parts, Plan("sparse", dtype, nbudget, window=4, cache_rows=default, threads=threads,
                                                predicted=extra), f"sparse window 4, runtime default caches, {tag}"))
    if not options:
        raise FlashLLMError(f"{model_dir}: nothing fits --dram-budget {budget} (see `flashllm generate --help` "
                            f"for the smallest budget each mode needs)")
    options.sort(key=lambda o: o[0].total_s)
    parts, best, _ = options[0]
    best.predicted = {**parts.to_ms(), **best.predicted}
    best.alternatives = [{"what": w, **p.to_ms(), **o.predicted} for p, o, w in options[1:]] + reference
    best.notes = notes + ["threads and the I/O engine: runtime defaults; hot set: not chosen (no pinned set in "
                          "the runtime yet); FFN quantization: as converted"]
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
