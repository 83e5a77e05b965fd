"""`flashllm plan`: choose how to run a model at a DRAM budget by solving a small MILP on the cost model.

Inputs: the machine profile (flashllm/planner/profile.py), the disk profile of the model's disk (flashllm/io/disk_profile.py), the
model's shapes, its predictors' sets on sample text replayed through the cache (flashllm/planner/replay.py), and a
short run of the runtime itself per mode (flashllm/planner/calibration.py), which the cost model's terms are scaled to.

The MILP (scipy.optimize.milp / HiGHS), for each compute dtype: binary y_k picks one window; binary
z[l,k,j] picks capacity c_j for layer l under window k (sum_j z[l,k,j] = y_k); the caches' bytes
sum_l c * row fit what the runtime leaves them after resident weights, KV cache, staging and predictor;
minimise sum z * cost[l,k,j], cost = FFN over the rows held + I/O of the loads + placing them
(flashllm/planner/cost_model.py, each term scaled as calibrated). Capacities whose replay drops predicted neurons are
excluded unless the user allows a share (`--max-dropped`; no silent quality trade). Dense (all
resident) and hybrid (the largest resident share that fits, rest streamed) have one configuration
each and are costed as measured. Sparse is planned per predictor the model can run (the low-rank
predictors; for a gated FFN with a sparse activation or calibrated thresholds also the resident gate,
whose rows count against the budget and leave 2/3 of a bundle to read), each loaded at the budget so
that memory and reads are the runtime's own (flashllm/planner/sparse.py). The cheapest wins, unless its predicted
gain over the runtime's defaults is within the measured noise: then the defaults are kept. Threads
and the I/O engine stay at the runtime's defaults; hot neurons are pinned as the runtime pins them;
FFN quantization is as converted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flashllm.planner import cost_model as cm
from flashllm.errors import DroppedNeuronsWarning, FlashLLMError
from flashllm.planner.replay import Replays, sample_ids, sample_masks

PLAN_FILE = "plan.json"
PLAN_FORMAT, PLAN_VERSION = "flashllm-plan", 2
MAX_DROPPED = 0.0  # default share of predicted neurons a plan may drop for lack of cache rows
SAMPLE_TOKENS = 512
CALIBRATE_TOKENS = 12  # decode tokens the runtime measures per mode (0: the cost model alone)
CALIBRATE_PREFILL, CALIBRATE_WARMUP = 4, 2  # prompt tokens before them; decode tokens not counted
CALIBRATE_SECONDS = 3.0  # ... decoded again until this long: a shared machine's load varies over seconds
CALIBRATE_WARM_PASSES = 1  # ... after this many uncounted passes (a model just loaded is cold)


class NothingFits(FlashLLMError):
    """No mode, dtype and setting the plan may choose from fits the budget (the message names what to widen)."""


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
    predictor: str = "auto"  # sparse: the predictor it was planned for (predictor.PREDICTORS)
    predicted: dict = field(default_factory=dict)  # total_ms and its parts
    alternatives: list = field(default_factory=list)  # the other options costed, best first
    notes: list = field(default_factory=list)
    key: dict = field(default_factory=dict)  # what this plan was made for (model, predictors, machine)

    def load_options(self) -> dict:
        opts = {"mode": self.mode, "dtype": self.dtype, "dram_budget": self.dram_budget, "threads": self.threads}
        if self.mode == "sparse":
            opts.update(window=self.window, cache_rows=tuple(self.cache_rows) if self.cache_rows else None,
                        predictor=self.predictor)
        if self.mode == "hybrid":
            opts["hybrid_fraction"] = self.hybrid_fraction
        return opts

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "format_version": PLAN_VERSION, **asdict(self)}

    def describe(self) -> str:
        p = self.predicted
        if self.mode == "sparse":
            what = f"sparse, {self.predictor} predictor, window {self.window}, cache rows per layer {self.cache_rows}"
        else:
            what = f"hybrid, resident share {self.hybrid_fraction:.3f}" if self.mode == "hybrid" else "dense (all resident)"
        lines = [f"plan: {what}, compute dtype {self.dtype}, flash reads in flight {self.threads}",
                 f"predicted decode token: {p['total_ms']:.2f} ms = compute {p['compute_ms']:.2f} + predictor "
                 f"{p['predictor_ms']:.2f} + I/O {p['io_ms']:.2f} + memory {p['mem_ms']:.2f} ms"
                 + (f"; {p['bytes_per_token'] / 1024:.1f} KiB and {p['reads_per_token']:.1f} reads per token"
                    if "bytes_per_token" in p else "")
                 + (f" (measured on this model now; the profiles alone predict {p['model_ms']:.2f} ms)"
                    if p.get("calibrated") and "model_ms" in p else "")]
        for a in self.alternatives[:6]:
            lines.append(f"  alternative: {a['what']}: {a['total_ms']:.2f} ms")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# -- memory of dense and hybrid (sparse: read from the runtime, plan_sparse.probe) ----------------
def fixed_bytes(manifest, dtype: str, context: int) -> dict:
    """Bytes dense and hybrid hold besides their FFN rows, as `Model.counted` adds them up on a CPU."""
    from flashllm.format import manifest as fmt
    from flashllm.budget import row_bytes

    spec, lay, it = manifest.spec, manifest.layout, cm.ITEMSIZE[dtype]
    resident = sum(int(np.prod(s)) for s in fmt.resident_shapes(spec).values()) * it
    kv = 2 * spec.n_layers * context * spec.n_kv_heads * spec.head_dim * it
    in_place = dtype == manifest.dtype and manifest.data.get("quantization", "none") == "none"
    return {"resident": resident + kv, "row": row_bytes(lay, in_place, it),
            "dense_rows": spec.n_layers * spec.d_ffn * len(lay.parts) * spec.d_model * it}


def _budget_bytes(budget, manifest) -> int | None:
    from flashllm.budget import budget_bytes

    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    return budget_bytes(budget, model_bytes)


# -- costs of dense and hybrid -------------------------------------------------------------------
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


def _profile_only(parts: cm.Parts) -> dict:
    """What the cost model alone (the profiles, no calibration run) predicts, kept beside a calibrated
    prediction: `model_ms` and its parts."""
    return {"model_ms": parts.total_s * 1e3, "model_parts": parts.to_ms()}


def predictor_choices(manifest) -> list[str]:
    """The predictors a sparse plan may run besides what `auto` picks: the low-rank predictors where
    trained, and for a gated FFN with a sparse activation or calibrated thresholds the resident gate."""
    from flashllm.modes.sparse.predictor import PREDICTOR_META, SPARSE_ACTIVATIONS
    from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE

    spec, root = manifest.spec, manifest.root
    kinds = ["lowrank"] if (root / PREDICTOR_META).is_file() else []
    if spec.gated_ffn and (spec.activation in SPARSE_ACTIVATIONS or (root / SPARSITY_FILE).is_file()):
        kinds.append("gate")
    return kinds


# -- the plan ------------------------------------------------------------------------------------
def _key(manifest, machine, disk, budget, context: int) -> dict:
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE

    pred = manifest.root / PREDICTOR_FILE
    return {"ffn_sha256": manifest.data["files"]["ffn"]["sha256"],
            "predictors_sha256": _sha(pred) if pred.is_file() else None,
            "machine": f"{machine.host}-{machine.backend}-{machine.device}", "machine_measured": machine.measured_at,
            "disk_measured": getattr(disk, "date", None), "dram_budget": budget, "context": context}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_plan(model_dir, budget, machine, disk, data: str | None = None, dtypes: list[str] | None = None,
              context: int | None = None, threads: int = 32, sample_tokens: int = SAMPLE_TOKENS,
              max_dropped: float = MAX_DROPPED, calibrate_tokens: int = CALIBRATE_TOKENS,
              calibrate_seconds: float | None = None, log=None) -> Plan:
    """The cheapest way (by the cost model) to decode with `model_dir` within `budget` bytes or fraction.

    Sparse mode is loaded at the budget once per candidate predictor, so its memory (what the caches may
    take, a row's bytes, the default capacities) and its reads (layout, staging, alignment, pinning) are
    the runtime's own. With `calibrate_tokens` > 0 each loaded reference configuration also decodes that
    many tokens (flashllm/planner/calibration.py): dense and hybrid are then costed as measured, sparse by the cost model
    scaled per term to its measurement at the runtime's default caches; and a plan whose predicted gain
    over those defaults is below the measured noise keeps the defaults."""
    from flashllm import load
    from flashllm.planner import calibration
    from flashllm.format import manifest as fmt
    from flashllm.planner import sparse as plan_sparse
    from flashllm.backends.base import default_compute_dtype
    from flashllm.budget import BudgetTooSmall, format_size

    log = log or (lambda msg: None)
    disk_for = disk if callable(disk) else (lambda engine: disk)  # the profile measured with an I/O engine
    disk = disk_for("preadv")  # dense and hybrid read with reader threads; sparse with its reader's engine
    calibrate_seconds = CALIBRATE_SECONDS if calibrate_seconds is None else calibrate_seconds
    manifest = fmt.read_manifest(model_dir, verify=False)
    spec = manifest.spec
    if spec.is_moe:
        raise FlashLLMError(f"{model_dir}: flashllm plan does not cover mixture-of-experts models yet")
    context = min(context or 4096, spec.context_limit)
    nbudget = _budget_bytes(budget, manifest)
    ids = sample_ids(model_dir, data, CALIBRATE_PREFILL + CALIBRATE_WARMUP + calibrate_tokens) if calibrate_tokens else None
    options, notes, reference, defaults, noise, needs = [], [], [], None, 0.0, []
    dropping = False  # sparse mode loads at the budget but would drop more predicted neurons than allowed
    least_sparse = []  # where sparse mode does not load at the budget: the runtime's least (it drops most there)
    dtypes = dtypes or [default_compute_dtype(None, manifest.dtype, True, quantized_ffn=manifest.layout.quant is not None)]

    def loaded(plan: Plan, what: str):
        """(the runtime loaded with `plan`'s options, its measured costs or None when not calibrating);
        (None, None) with a note when it does not fit or cannot run."""
        try:
            with warnings.catch_warnings():  # generate's advice on dropped neurons; the plan says it in its own words
                warnings.simplefilter("ignore", DroppedNeuronsWarning)
                model = load(model_dir, **{**plan.load_options(), "context": context})
                if not ids:
                    return model, None
                log(f"measuring {what} ({calibrate_tokens} decode tokens, again until {calibrate_seconds:g} s)")
                rows = calibration.token_costs(model, ids, CALIBRATE_PREFILL, CALIBRATE_WARMUP, calibrate_seconds,
                                               CALIBRATE_WARM_PASSES)
            dropped = [r["neurons_dropped"] for r in rows if r["neurons_dropped"]]
            if dropped:
                notes.append(f"{what}: its caches could not hold every predicted neuron on {len(dropped)} of "
                             f"{len(rows)} calibration tokens ({np.mean(dropped):.1f} dropped on those, lowest "
                             f"scores first)")
            return model, calibration.typical(rows)
        except BudgetTooSmall as exc:
            needs.append(getattr(exc, "needed", None))
            notes.append(f"{what}: does not fit ({exc.cli_message()})")
        except FlashLLMError as exc:
            notes.append(f"{what}: not measured, left out ({exc.cli_message()})")
        return None, None

    def add(parts: cm.Parts, plan: Plan, what: str, m=None) -> None:
        nonlocal noise
        if m is not None:  # costed as measured
            plan.predicted = {**plan.predicted, **_profile_only(parts), "calibrated": True,
                              "calibration_run": m.to_dict()}
            parts = cm.Parts(compute_s=(m.compute_ms - m.ffn_ms) / 1e3, ffn_s=m.ffn_ms / 1e3,
                             predictor_s=m.predictor_ms / 1e3, io_s=calibration.cold_io_s(m.io_ms / 1e3, m.bytes_read, disk),
                             mem_s=m.mem_ms / 1e3)
            noise = max(noise, m.spread)
        options.append((parts, plan, what))

    # sparse first, before the replay or another mode has read the model's file (reads a host-side disk
    # cache still holds would flatter them): the runtime's defaults (predictor auto) and each other predictor
    sparse, masks = [], {}  # (dtype, SparseFacts, Measured or None, the runtime's default?, fits the budget?)
    kinds = predictor_choices(manifest)
    for dtype in dtypes if kinds else ():
        for kind in ["auto"] + kinds:
            if kind in {e[1].predictor for e in sparse if e[0] == dtype}:
                continue  # auto resolved to it
            plan = Plan("sparse", dtype, nbudget, window=4, threads=threads, predictor=kind)
            model, m = loaded(plan, f"sparse window 4, runtime default caches, {kind} predictor, compute {dtype}")
            fits = model is not None
            if not fits and needs and needs[-1]:  # too small: loaded at the runtime's least, to say what a plan needs
                try:
                    with warnings.catch_warnings():  # the runtime's warnings about a budget the user did not give
                        warnings.simplefilter("ignore")
                        model = load(model_dir, **{**plan.load_options(), "dram_budget": needs[-1], "context": context})
                except FlashLLMError:
                    continue
                least_sparse.append(needs.pop())
            if model is not None:
                sparse.append((dtype, plan_sparse.probe(model), m, kind == "auto" and dtype == dtypes[0], fits))
                del model

    for dtype in dtypes:
        mem = fixed_bytes(manifest, dtype, context)
        tag = f"compute {dtype}"
        if nbudget is None or mem["resident"] + mem["dense_rows"] <= nbudget:
            plan = Plan("dense", dtype, nbudget, threads=threads)
            model, m = loaded(plan, f"dense, {tag}") if ids else (None, None)
            if m is not None or not ids:
                add(dense_cost(machine, manifest, dtype), plan, f"dense, {tag}", m)
        base = mem["resident"] + manifest.layout.d_ffn * manifest.layout.stride
        avail = None if nbudget is None else nbudget - base - spec.d_ffn * mem["row"]
        if avail is None or avail >= 0:
            h = spec.d_ffn // 2 if avail is None else min(spec.d_ffn, avail // (spec.n_layers * mem["row"]))
            plan = Plan("hybrid", dtype, nbudget, threads=threads)
            model, m = loaded(plan, f"hybrid, {tag}") if ids else (None, None)
            h = model.mode_impl.resident_rows if model is not None else h  # as the runtime sized it
            plan.hybrid_fraction = h / spec.d_ffn
            if m is not None or not ids:
                add(hybrid_cost(machine, disk, manifest, dtype, mem, h, threads), plan,
                    f"hybrid {h}/{spec.d_ffn} resident, {tag}", m)
            del model

    for dtype, facts, m, runtime_default, fits in sparse:
        tag = f"{facts.predictor} predictor, compute {dtype}"
        sdisk, inflight = disk_for(facts.engine), facts.inflight
        if facts.predictor not in masks:
            log(f"replaying the {facts.predictor} predictor's sets on {sample_tokens} sample tokens through the cache")
            masks[facts.predictor] = sample_masks(model_dir, data, sample_tokens, facts.predictor)
        replays = Replays(masks[facts.predictor], spec.d_ffn, facts.geometry, facts.hot)
        layer_curves = replays.curves(facts.capacities)
        # the runtime's own sizing at the default window: the hand defaults (or, for another predictor, its own)
        parts, extra = plan_sparse.parts_at(machine, sdisk, manifest, dtype, facts, replays, 4, facts.capacities, inflight)
        what = f"sparse window 4, runtime default caches, {tag}"
        plan = Plan("sparse", dtype, nbudget, window=4, cache_rows=facts.capacities, threads=threads,
                    predictor=facts.predictor, predicted=extra)
        cal = None
        if m is not None:
            cal = calibration.calibrate(m, parts.ffn_s, parts.io_s, parts.mem_s, disk=sdisk)
            plan.predicted.update(**_profile_only(parts), calibrated=True, calibration_run=m.to_dict(),
                                  calibration={k: getattr(cal, k) for k in ("ffn_scale", "io_scale", "mem_scale")})
            parts, noise = cal.apply(parts.ffn_s, parts.io_s, parts.mem_s), max(noise, cal.noise)
        if not fits:
            pass
        elif extra["dropped_share"] > max_dropped:
            dropping = True
            reference.append({"what": f"{what} (drops {extra['dropped_share']:.1%} of predicted neurons)",
                              **parts.to_ms(), **plan.predicted})
        elif m is not None or not ids:
            options.append((parts, plan, what))
            defaults = plan if runtime_default else defaults  # what `auto` resolves to, at the first dtype

        def weigh(p: cm.Parts) -> float:  # what a layer's choice changes (calibrated: as measured)
            return p.total_s if cal is None else cal.ffn_scale * p.ffn_s + cal.io_scale * p.io_s + cal.mem_scale * p.mem_s

        costs = [{k: [(weigh(plan_sparse.point_cost(machine, sdisk, manifest, dtype, facts, pt, l, inflight))
                       if pt["drop_share"] <= max_dropped else None) for pt in pts]
                  for k, pts in cur.items()} for l, cur in enumerate(layer_curves)]
        found = plan_sparse.solve(costs, layer_curves, facts.row, facts.avail) if fits else None
        if found is None and facts.avail is not None:  # the smallest budget whose caches hold a usable capacity
            least = [min(pt["capacity"] for pt, c in zip(cur[1], cost[1]) if c is not None)  # window 1 needs least
                     for cur, cost in zip(layer_curves, costs)]
            needs.append(facts.fixed + facts.row * sum(least))
        if not fits:
            continue
        if found is None:
            dropping = True
            notes.append(f"sparse, {tag}: no window and capacities fit while dropping at most {max_dropped:.1%} "
                         f"of the predicted neurons (--max-dropped allows more, at a quality cost)")
            continue
        window, caps, _ = found
        if (window, caps) == (4, facts.capacities):
            continue  # the MILP's choice is the runtime's default
        parts, extra = plan_sparse.parts_at(machine, sdisk, manifest, dtype, facts, replays, window, caps, inflight)
        if cal is not None:
            extra.update(**_profile_only(parts), calibrated=True)
            parts = cal.apply(parts.ffn_s, parts.io_s, parts.mem_s)
        options.append((parts, Plan("sparse", dtype, nbudget, window=window, cache_rows=caps, threads=threads,
                                    predictor=facts.predictor, predicted=extra),
                        f"sparse window {window}, {tag}, {sum(caps)} cache rows"))
    if not options:
        smallest = min((n for n in needs if n), default=None)
        hint = f"the smallest budget that works is --dram-budget {format_size(smallest)}" if smallest else \
            "see `flashllm generate --help` for the smallest budget each mode needs"
        drop_from = min(least_sparse, default=None)  # below `smallest` only by dropping (--max-dropped)
        wider = []
        if dropping:
            wider.append("--max-dropped SHARE (sparse mode runs here by dropping predicted neurons: a quality cost)")
        elif drop_from is not None and drop_from < (smallest or 0):
            wider.append(f"--max-dropped SHARE (sparse mode loads from --dram-budget {format_size(drop_from)}, "
                         f"dropping more predicted neurons the smaller its caches: a quality cost)")
        if set(dtypes) == {"float32"}:
            wider.append(f"--dtypes {dtypes[0]},bfloat16")
        wider.append("a smaller --context")
        raise NothingFits(f"{model_dir}: nothing fits --dram-budget {format_size(nbudget)} with --max-dropped "
                            f"{max_dropped:g} and --dtypes {','.join(dtypes)} (to let the plan choose from more: "
                            f"{', '.join(wider)}); {hint}")
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
    best.notes = notes + ["threads and the I/O engine: runtime defaults; hot set: as the runtime pins it; "
                          "FFN quantization: as converted"]
    if ids:
        best.notes.append(f"calibrated on {calibrate_tokens} decode tokens per mode measured now (repeated for "
                          f"{calibrate_seconds:g} s); noise "
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
