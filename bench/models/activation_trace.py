"""Activation traces: the active FFN neurons of a real (small) model, replayed onto a bigger model.

A model with random weights has no real activation sparsity (about half of its ReLU neurons fire
for any token), so sparse-mode measurements on a 7B-shaped random model take their active sets
from a trace instead:

1. `record`: the embedded real model (a trained ReLU OPT) decodes held-out text one token at a
   time in flashllm's sparse mode (window 1, no DRAM limit), and for every token and layer the
   active set its predictor chose is stored: the trained low-rank predictors when the model
   directory has them, else the oracle (the true activations); the trace says which. The true
   active set is stored beside it (for recall). Text is cut into sequences of --seq-len tokens,
   each starting from an empty KV cache with the tokenizer's BOS, as separate documents would.
2. `TracePredictor`: maps the trace onto a model with other dimensions. Large layer j follows
   small layer floor(j * L_small / L_large) (proportional depth); in each large layer, neuron i
   follows one small neuron, a fixed random assignment (numpy seed) in which every small neuron is
   followed by the same number (±1) of large neurons, so the large layer has the same distribution
   of per-neuron activation frequencies and the same token-to-token reuse as the small one.
   Decode token t uses trace token t (wrapping around after the last). So that the predictor's own
   cost is not left out, it also computes a stand-in low-rank predictor of rank --predictor-rank
   with random weights per layer (sigmoid(B A x) in the compute dtype; result discarded) and
   counts its weights in the DRAM budget.

What this does not preserve: which neurons fire together beyond the small model's own
co-activation (each small neuron's large copies always fire together), and any difference in
sparsity between a small model and a real 7B model (OPT-6.7B is much sparser than the embedded
model: the paper reports ~97% of its FFN neurons inactive per token).

    python -m bench models trace record MODEL_DIR --data heldout.txt --out trace.npz --tokens 2048
    python -m bench models trace info trace.npz [--json]

MODEL_DIR is a converted flashllm model (with predictors.json for the low-rank predictors) or an
HF checkpoint (converted to a temporary directory first; --predictors DIR copies trained predictor
files into it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flashllm
from flashllm.format import manifest as fmt
from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_META, OraclePredictor, make_predictor

TRACE_FORMAT = "flashllm-activation-trace"
TRACE_VERSION = 1
DEFAULT_SEQ_LEN = 256


# -- recording ---------------------------------------------------------------------------------
class _Recorder:
    """Wraps the runtime's predictor: returns its prediction unchanged and records it (and the truth)."""

    def __init__(self, inner, oracle, n_layers: int):
        self.inner, self.oracle, self.kind = inner, oracle, inner.kind
        self.predicted = [[] for _ in range(n_layers)]
        self.true = [[] for _ in range(n_layers)]

    def predict(self, layer: int, x) -> np.ndarray:
        mask = self.inner.predict(layer, x)
        self.predicted[layer].append(np.packbits(mask, axis=1))
        truth = mask if self.oracle is None else self.oracle.predict(layer, x)
        self.true[layer].append(np.packbits(truth, axis=1))
        return mask

    def nbytes(self) -> int:
        return self.inner.nbytes()


def _prepare_model_dir(model_dir: Path, predictors: Path | None, tmp: Path) -> Path:
    """A flashllm model directory: MODEL_DIR itself, or MODEL_DIR (an HF checkpoint) converted into tmp."""
    if not (model_dir / fmt.MANIFEST).is_file():
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"{model_dir}: neither a flashllm model directory nor an HF checkpoint")
        from flashllm.converters import convert

        model_dir = convert(model_dir, tmp / "model", dtype="float32", progress=False)
    if predictors is not None:
        if model_dir.resolve() != (tmp / "model").resolve():
            shutil.copytree(model_dir, tmp / "model")
            model_dir = tmp / "model"
        for name in (PREDICTOR_FILE, PREDICTOR_META):
            shutil.copyfile(predictors / name, model_dir / name)
    return model_dir


def record(model_dir: str | Path, data: str | Path, out: str | Path, tokens: int = 2048, predictor: str = "auto",
           predictors: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN, threads: int = 4) -> dict:
    """Decode `tokens` held-out tokens one at a time and write the trace to `out` (.npz); returns its meta."""
    from flashllm.predictors.collect import tokens_of

    src = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="flashllm-trace-") as tmp:
        root = _prepare_model_dir(src, Path(predictors) if predictors else None, Path(tmp))
        kind = predictor
        if kind == "auto":
            kind = "lowrank" if predictors_match(root) else "oracle"
            if predictors_match(root) is False:
                print(f"warning: {root / PREDICTOR_META} was trained for another model; recording the oracle "
                      "(true) active sets instead", file=sys.stderr)
        if kind == "lowrank" and predictors_match(root) is False:
            raise SystemExit(f"{root / PREDICTOR_META}: trained for another model (its ffn sha256 differs from "
                             "this model's): train them again, or use --predictor oracle")
        holder = {}

        def build(ctx):
            inner = make_predictor(kind, ctx)
            oracle = OraclePredictor(ctx) if kind != "oracle" else None
            holder["rec"] = _Recorder(inner, oracle, ctx.spec.n_layers)
            return holder["rec"]

        model = flashllm.load(root, mode="sparse", predictor=build, window=1, dram_budget=None, threads=threads,
                              context=seq_len, read_ahead=False)  # no lookahead: one prediction per layer and token
        rec, spec = holder["rec"], model.spec
        chunks = tokens_of(model, data, seq_len, tokens)
        t0 = time.perf_counter()
        ids_all = []
        for chunk in chunks:
            model.logits(chunk, prefill=1)  # the first token alone, then one at a time
            ids_all += chunk
        seconds = time.perf_counter() - t0
        pred = np.stack([np.concatenate(p) for p in rec.predicted])  # [layers, tokens, ceil(d_ffn/8)]
        true = np.stack([np.concatenate(t) for t in rec.true])
        n = pred.shape[1]
        meta = {"format": TRACE_FORMAT, "format_version": TRACE_VERSION,
                "model": str(src.resolve()), "model_sha256": fmt.read_manifest(root, verify=False).data["files"]
                ["ffn"]["sha256"], "family": spec.family, "n_layers": spec.n_layers, "d_model": spec.d_model,
                "d_ffn": spec.d_ffn, "predictor": rec.kind, "predictor_meta": getattr(rec.inner, "meta", None),
                "data": str(Path(data).resolve()), "data_sha256": _sha(data), "tokens": n,
                "sequences": len(chunks), "seq_len": seq_len, "seconds": round(seconds, 2),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "token_ids_sha256": hashlib.sha256(
                    np.asarray(ids_all, dtype=np.int64).tobytes()).hexdigest()}
    trace = Trace(pred, true, meta)
    meta["summary"] = trace.summary()
    trace.save(out)
    return meta


def predictors_match(model_dir: Path) -> bool | None:
    """Whether the model directory's predictors were trained on this very model (None: no predictors)."""
    meta_path = Path(model_dir) / PREDICTOR_META
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    want = (meta.get("model") or {}).get("sha256", {}).get("ffn")
    have = fmt.read_manifest(model_dir, verify=False).data["files"]["ffn"]["sha256"]
    return want is None or want == have


def _sha(path) -> str:
    return fmt.sha256_file(path)


# -- the trace file ----------------------------------------------------------------------------
class Trace:
    """Per layer and token, the predicted (and true) active neurons of the recorded model."""

    def __init__(self, predicted: np.ndarray, true: np.ndarray | None, meta: dict):
        self.meta = meta
        self.d_ffn = int(meta["d_ffn"])
        self._packed, self._packed_true = predicted, true
        self.n_layers, self.tokens = predicted.shape[:2]
        self.predicted = np.unpackbits(predicted, axis=2, count=self.d_ffn).astype(bool)  # [L, N, d]

    @property
    def true(self) -> np.ndarray | None:
        if self._packed_true is None:
            return None
        return np.unpackbits(self._packed_true, axis=2, count=self.d_ffn).astype(bool)

    def save(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial.npz")
        arrays = {"predicted": self._packed, "meta": np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8)}
        if self._packed_true is not None:
            arrays["true"] = self._packed_true
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "Trace":
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes().decode())
                if meta.get("format") != TRACE_FORMAT or meta.get("format_version") != TRACE_VERSION:
                    raise SystemExit(f"{path}: not a flashllm activation trace (version {TRACE_VERSION})")
                return cls(z["predicted"], z["true"] if "true" in z.files else None, meta)
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"{path}: unreadable trace ({exc})") from None

    def summary(self, windows=(1, 2, 4, 8)) -> dict:
        """Per layer: active fraction; fraction of the FFN new per token for a window of k tokens
        (active now, not active in the previous k tokens); the union held for that window; recall."""
        P = self.predicted
        out = {"active": P.mean(axis=(1, 2)).round(4).tolist()}
        for k in windows:
            new, held = [], []
            for layer in range(self.n_layers):
                m = P[layer]
                prev = np.zeros_like(m)
                for j in range(1, k + 1):  # union of the previous k tokens
                    prev[j:] |= m[:-j]
                new.append(float((m & ~prev)[k:].mean()))
                cur = np.zeros_like(m)
                for j in range(k):  # union of the last k tokens, this one included (what the cache holds)
                    cur[j:] |= m[:len(m) - j]
                held.append(float(cur[k:].mean()))
            out[f"new_w{k}"] = np.round(new, 4).tolist()
            out[f"held_w{k}"] = np.round(held, 4).tolist()
        true = self.true
        if true is not None:
            tp = (P & true).sum(axis=(1, 2))
            out["recall"] = (tp / np.maximum(true.sum(axis=(1, 2)), 1)).round(4).tolist()
            out["predicted_over_true"] = (P.sum(axis=(1, 2)) / np.maximum(true.sum(axis=(1, 2)), 1)).round(4).tolist()
        out["mean_active"] = round(float(P.mean()), 4)
        for k in windows:
            out[f"mean_new_w{k}"] = round(float(np.mean(out[f"new_w{k}"])), 4)
        return out


# -- replaying a trace on a bigger model -------------------------------------------------------
def layer_map(small_layers: int, large_layers: int) -> list[int]:
    """Large layer j follows small layer floor(j * L_small / L_large)."""
    return [min(small_layers - 1, j * small_layers // large_layers) for j in range(large_layers)]


def neuron_map(small: int, large: int, rng: np.random.Generator) -> np.ndarray:
    """For each large neuron the small neuron it follows: every small neuron equally often (±1)."""
    reps = math.ceil(large / small)
    return np.concatenate([rng.permutation(small) for _ in range(reps)])[:large]


class TracePredictor:
    """A predictor object (kind "trace") replaying a recorded trace on a model with `spec`.

    `backend` (the model's backend) enables the cost stand-in: a random low-rank predictor of rank
    `cost_rank` per layer, evaluated on each call (result discarded) and counted in nbytes().
    """

    kind = "trace"

    def __init__(self, trace: "Trace | str | Path", spec, backend=None, seed: int = 0, cost_rank: int = 128,
                 order: str | None = None, window: int = 4, lookahead: dict | None = None):
        self.trace = trace if isinstance(trace, Trace) else Trace.load(trace)
        self.early = False  # set while the runtime's lookahead predicts (bench/paper/measure.py flags it)
        self.lookahead = None if lookahead is None else _early_model(lookahead, self.trace.n_layers, spec.n_layers)
        self._early_rng = np.random.default_rng(seed + 1)
        self.spec = spec
        rng = np.random.default_rng(seed)
        self.layers = layer_map(self.trace.n_layers, spec.n_layers)
        self.neurons = [neuron_map(self.trace.d_ffn, spec.d_ffn, rng) for _ in range(spec.n_layers)]
        self.order = None
        if order == "coactivation":
            self._coactivation_order(window)
        elif order not in (None, "none"):
            raise ValueError(f"order {order!r}: none or coactivation")
        self.next = 0
        self.t0 = 0
        self.backend, self.rank = backend, cost_rank
        self.A, self.B, self.b = [], [], []
        if backend is not None and cost_rank > 0:
            g = np.random.default_rng(seed)
            for _ in range(spec.n_layers):
                self.A.append(backend.tensor(g.standard_normal((cost_rank, spec.d_model), np.float32) * spec.d_model ** -0.5))
                self.B.append(backend.tensor(g.standard_normal((spec.d_ffn, cost_rank), np.float32) * cost_rank ** -0.5))
                self.b.append(backend.tensor(np.zeros(spec.d_ffn, np.float32)))

    def _coactivation_order(self, window: int) -> None:
        """Replay as if ffn.bin had been rewritten in co-activation order (`flashllm predictors train --order
        coactivation`): the weights are random, so moving a neuron to another position of the file is the
        same as the replay's neuron there following another small neuron. Each small layer's order is
        computed (predictors.coactivation) on the trace's second half, with this window's loads; the replay
        starts at the first token, so the measured tokens are held out from it. The large layer is laid out
        as blocks, each block the small neurons in that order, one copy of each: copies of one small neuron
        (always active together, an artifact of the replay) stay a small layer's width apart, so what the
        order gains is the small model's own co-activation structure, not the copies' (laid side by side,
        they would turn ~11 bundles into one read and overstate the gain ~10x)."""
        from flashllm.predictors import coactivation as co

        half = self.trace.tokens // 2
        orders, info = [], []
        for small in range(self.trace.n_layers):
            counts = co.CoCounts(self.trace.d_ffn)
            counts.add(co.loads(self.trace.predicted[small][half:], window))
            order, saved = co.layer_order(counts)
            orders.append(order)
            info.append(saved)
        for j, small in enumerate(self.layers):
            copies = np.bincount(self.neurons[j], minlength=self.trace.d_ffn)  # the same neurons, moved
            self.neurons[j] = np.concatenate([orders[small][copies[orders[small]] > c] for c in range(copies.max())])
        self.order = {"method": "coactivation", "window": window, "calibration_tokens": self.trace.tokens - half,
                      "small_layers": info}

    def _mask(self, layer: int, x) -> np.ndarray:
        """The trace's sets of the forward's tokens for `layer` (and the stand-in predictor's cost)."""
        T = x.shape[0]
        if layer == 0:  # a new forward: the next T trace tokens
            self.t0, self.next = self.next, self.next + T
        if self.A:  # what LowRankPredictor.scores and predict_scored compute (result discarded)
            (self.backend.low_rank(x, self.A[layer], self.B[layer], self.b[layer]) - 0.0) > 0
        rows = (self.t0 + np.arange(T)) % self.trace.tokens
        small = self.trace.predicted[self.layers[layer]][rows]
        return small[:, self.neurons[layer]]

    def predict(self, layer: int, x) -> np.ndarray:
        scores = self.scores(layer, x)
        return self._mask(layer, x) if scores is None else scores > 0

    def scores(self, layer: int, x) -> np.ndarray | None:
        """None (a replayed set has no scores) except while the runtime's lookahead predicts with a
        `lookahead` model: then scores as imperfect as the small model's real lookahead (`_early`)."""
        return self._early(layer, self._mask(layer, x)) if self.early and self.lookahead is not None else None

    def _early(self, layer: int, mask: np.ndarray) -> np.ndarray:
        """A lookahead's scores for the sets `mask` [T, n], drawn from the small model's measured lookahead
        of the layer (bench/io/lookahead.py): each needed neuron's score from the distribution of the
        needed neurons' scores there (its quantiles), and as many other neurons above each cut of the
        measured ladder per needed neuron as there, with scores spread evenly between the cuts; all the
        rest below the ladder. Each neuron and token is drawn independently: the real lookahead's misses
        are correlated across tokens (the same neurons missed again), which this does not model."""
        quantiles, grid, others = self.lookahead[layer]
        rng = self._early_rng
        out = np.full(mask.shape, grid[0] - 1.0, dtype=np.float32)
        per_cut = np.diff(-others, append=0.0)  # others per needed neuron between cut k and k+1 (last: above it)
        top = np.append(grid[1:], grid[-1] + 2.0)
        for t, row in enumerate(mask):
            on, off = np.flatnonzero(row), np.flatnonzero(~row)
            out[t, on] = np.interp(rng.random(len(on)), np.linspace(0, 1, len(quantiles)), quantiles)
            counts = rng.poisson(np.maximum(per_cut, 0) * len(on))
            chosen = rng.choice(off, min(len(off), int(counts.sum())), replace=False)
            cut = rng.permutation(np.repeat(np.arange(len(grid)), counts))[:len(chosen)]
            out[t, chosen] = grid[cut] + rng.random(len(chosen)) * (top[cut] - grid[cut])
        return out

    def nbytes(self) -> int:
        """The stand-in predictor's weights (what real predictors of that rank would hold); the trace
        itself is a measurement instrument and is not counted, like the oracle."""
        if not self.A:
            return 0
        return sum(self.backend.nbytes_of(t) for ts in (self.A, self.B, self.b) for t in ts)

    def describe(self) -> str:
        m, s = self.trace.meta, self.trace.summary(windows=(4,)) if self.trace.tokens > 4 else {}
        return (f"active sets replayed from a {m['tokens']}-token trace of {Path(m['model']).name} "
                f"({m['n_layers']} layers, FFN {m['d_ffn']}; {m['predictor']} predictor) on held-out text "
                f"{Path(m['data']).name}; large layer j follows small layer floor(j*{m['n_layers']}/"
                f"{self.spec.n_layers}); each of the {self.spec.d_ffn} neurons follows one of the "
                f"{m['d_ffn']} small neurons (fixed random balanced assignment"
                f"{'; laid out in co-activation order computed on the trace tokens not replayed' if self.order else ''}"
                f"); mean active {s.get('mean_active', float('nan')):.1%}, new per token with window 4 "
                f"{s.get('mean_new_w4', float('nan')):.1%}; predictor cost stand-in: random rank "
                f"{self.rank if self.A else 0}")


def _early_model(lookahead: dict, small_layers: int, large_layers: int) -> list[tuple]:
    """Per large layer, (needed neurons' score quantiles, cuts, other neurons above each cut per needed
    neuron) of the lookahead, from bench/io/lookahead.py's measurement of the small model (its "ladder" of
    one source: per small layer, layer 0 without one): a large layer takes its small layer's, or the small
    layers' mean where that is layer 0."""
    grid, layers = np.asarray(lookahead["grid"], float), lookahead["layers"]
    if len(layers) != small_layers:
        raise ValueError(f"lookahead model of {len(layers)} layers for a trace of {small_layers}")
    per = [None if d is None else (np.asarray(d["needed_quantiles"], float),
                                   np.asarray(d["named_per_needed"], float) - np.asarray(d["recall"], float))
           for d in layers]
    known = [p for p in per if p is not None]
    mean = (np.mean([q for q, _ in known], axis=0), np.mean([o for _, o in known], axis=0))
    chosen = [mean if per[s] is None else per[s] for s in layer_map(small_layers, large_layers)]
    return [(quantiles, grid, others) for quantiles, others in chosen]


def trace_predictor_factory(path, seed: int = 0, cost_rank: int = 128, order: str | None = None, window: int = 4,
                            lookahead: dict | None = None):
    """`predictor=` argument for flashllm.load: a TracePredictor on the loaded model's spec and backend."""
    trace = Trace.load(path)
    return lambda ctx: TracePredictor(trace, ctx.spec, ctx.backend, seed, cost_rank, order, window, lookahead)


# -- CLI ---------------------------------------------------------------------------------------
def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a trace")
    r.add_argument("model_dir")
    r.add_argument("--data", required=True, help="held-out text (e.g. bench/models/stdlib_corpus.py --split heldout)")
    r.add_argument("--out", required=True, help="trace file to write (.npz)")
    r.add_argument("--tokens", type=int, default=2048)
    r.add_argument("--predictor", choices=["auto", "lowrank", "oracle"], default="auto",
                   help="auto: lowrank if the model directory has predictors trained on it, else oracle")
    r.add_argument("--predictors", default=None, help="directory with predictors.safetensors/.json to use")
    r.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    r.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (default 1: a small model's ops gain nothing from more, and "
                        "on a busy machine OpenMP spinning makes them many times slower)")
    r.add_argument("--json", action="store_true")
    i = sub.add_parser("info", help="summarize a trace")
    i.add_argument("trace")
    i.add_argument("--json", action="store_true")
    return p


def _print_summary(meta: dict, summary: dict) -> None:
    print(f"trace of {meta['model']} ({meta['predictor']} predictor), {meta['tokens']} tokens of {meta['data']}")
    print("| layer | active | new/token w1 | new/token w4 | held w4 | recall | predicted/true |")
    print("|---|---|---|---|---|---|---|")
    for k, a in enumerate(summary["active"]):
        rec = summary.get("recall", [None] * len(summary["active"]))[k]
        pot = summary.get("predicted_over_true", [None] * len(summary["active"]))[k]
        print(f"| {k} | {a:.3f} | {summary['new_w1'][k]:.3f} | {summary['new_w4'][k]:.3f} | "
              f"{summary['held_w4'][k]:.3f} | {rec if rec is not None else '-'} | {pot if pot is not None else '-'} |")
    print(f"mean active {summary['mean_active']:.3f}, new per token w1 {summary['mean_new_w1']:.3f}, "
          f"w4 {summary['mean_new_w4']:.3f}")


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    if args.cmd == "record":
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        meta = record(args.model_dir, args.data, args.out, args.tokens, args.predictor, args.predictors,
                      args.seq_len)
    else:
        trace = Trace.load(args.trace)
        meta = dict(trace.meta, summary=trace.summary())
    if args.json:
        print(json.dumps(meta))
    else:
        _print_summary(meta, meta["summary"])
        if args.cmd == "record":
            print(f"wrote {args.out} in {meta['seconds']:.1f} s")
    return meta


if __name__ == "__main__":
    main()
