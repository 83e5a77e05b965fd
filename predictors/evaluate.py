"""How good are the trained predictors, at the DRAM budget and dtype the user runs? Measured on
held-out text against the dense model computed in the same dtype.

- per layer, from a dense pass: recall, precision and predicted/true fraction of the predictors'
  masks against the true masks (same activation rule as training);
- per evaluated load (one, or one per budget of a sweep), the sparse model with the trained
  predictors, loaded with the user's options (dtype, window, budget, backend, device, threads):
  - perplexity, dense vs sparse: teacher-forced over the held-out tokens, each sequence decoded one
    token at a time through the KV cache after its first token, scoring every decode step;
  - greedy top-1 agreement: the dense model generates `gen_tokens` greedily from a held-out prompt
    (EOS ignored); the sparse model reads the same tokens, and its argmax is compared with the dense
    choice at every position (also: agreement on the held-out text itself, and the free-running
    sparse generation's agreement and first divergence);
  - per layer at this budget: recall and precision of what the FFN really computed, the cache's
    rows when a decode step runs, against the dense pass's true mask of that token; so neurons the
    window kept help and neurons dropped for lack of room count as misses;
  - neurons dropped per decode token, flash bytes and latency per decode token (from the stats);
  - a budget the runtime refuses is reported with its reason, not measured;
- flash bytes per decode token of naive mode (a short measured run: every layer's weights).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError

from flashllm.predictors import collect as col

NAIVE_PROMPT, NAIVE_DECODE = 4, 4


def _nll(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return lse - z[np.arange(len(targets)), targets]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` (EOS does not stop it)."""
    model.mode_impl.reset()
    logits = model.forward(prompt, 0)
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits[-1])))
        if i + 1 < n:
            logits = model.forward([out[-1]], len(prompt) + i)
    return out


class Counts:
    """Per layer true-positive / predicted / true counts of a mask against the true masks."""

    def __init__(self, n_layers: int):
        self.tp, self.pred, self.true, self.cells = (np.zeros(n_layers, np.int64) for _ in range(4))

    def add(self, layer: int, pred: np.ndarray, true: np.ndarray) -> None:
        self.tp[layer] += int((pred & true).sum())
        self.pred[layer] += int(pred.sum())
        self.true[layer] += int(true.sum())
        self.cells[layer] += true.size

    def rows(self) -> list[dict]:
        out = []
        for i in range(len(self.tp)):
            t, p, c = int(self.true[i]), int(self.pred[i]), max(int(self.cells[i]), 1)
            out.append({"layer": i, "recall": self.tp[i] / t if t else 1.0, "precision": self.tp[i] / p if p else 1.0,
                        "predicted_fraction": p / c, "true_fraction": t / c, "predicted_over_true": p / t if t else None})
        return out


@dataclass
class Reference:
    """The dense model's view of the held-out text: what every sparse load is compared with."""

    chunks: list  # token id sequences
    start: int  # rows start.. of each chunk come from decode steps and are scored
    nll: np.ndarray  # dense negative log-likelihood of every scored token
    argmax: list  # per chunk, the dense argmax of the scored rows
    true_masks: list  # per chunk, per layer: packed true masks of every position
    prompt: list
    gen: list  # the dense greedy continuation of `prompt`
    layers: list  # per-layer predictor figures from the dense pass
    rule: str
    d_ffn: int
    dtype: str
    extra: dict = field(default_factory=dict)


def _compute_options(options):
    """The options that decide the math (not the memory): the dense reference and naive runs use these."""
    from flashllm import LoadOptions

    return LoadOptions(backend=options.backend, device=options.device, dtype=options.dtype, context=options.context,
                       threads=options.threads, aio_depth=options.aio_depth)


def dense_reference(model_dir, data, options, max_tokens: int | None, gen_tokens: int, prompt_tokens: int,
                    seq_len: int | None, progress: bool | None) -> Reference:
    """One dense pass over the held-out text (in the evaluated dtype) plus the greedy continuation."""
    import flashllm
    from flashllm.modes.sparse.predictor import LowRankPredictor
    from flashllm.progress import progress_bar

    if gen_tokens < 1 or prompt_tokens < 1:
        raise FlashLLMError("--gen-tokens and the prompt length must be at least 1")
    text = col.read_data(data, max_tokens)
    dense = flashllm.load(model_dir, _compute_options(options), mode="dense")
    predictor = LowRankPredictor(dense.mode_context)
    spec = dense.spec
    saved_rule = predictor.meta.get("activation_rule")
    rule = col.ActivationRule.from_dict(saved_rule) if saved_rule else col.activation_rule(spec)
    chunks = col.chunk_text(dense, text, seq_len, max_tokens, str(data))
    del text
    start = max(len(dense.tokenizer.encode("")), 1)
    chunks = [c for c in chunks if len(c) >= start + 2] or chunks
    counts, masks = Counts(spec.n_layers), {}

    def sink(layer, x, mask):
        counts.add(layer, predictor.predict(layer, x), mask)
        masks[layer] = np.packbits(mask, axis=1)

    nll, argmax, true_masks = [], [], []
    with col.recording(dense, rule, sink), \
            progress_bar(progress, total=sum(map(len, chunks)), desc=f"dense {dense.backend.dtype}", unit="tok",
                         leave=False) as bar:
        for chunk in chunks:
            rows = dense.logits(chunk)[start:len(chunk) - 1]  # one prefill: the same math as token by token
            nll.append(_nll(rows, chunk[start + 1:]))
            argmax.append(np.argmax(rows, axis=1))
            true_masks.append([masks[i] for i in range(spec.n_layers)])
            bar.update(len(chunk))
    nd = np.concatenate(nll)
    if len(nd) == 0:
        raise FlashLLMError(f"data file {data}: too few tokens to score (sequences need at least {start + 2})")
    layers = counts.rows()
    for row, info in zip(layers, predictor.meta["layers"]):
        row.update(rank=int(info["rank"]), threshold=float(info["threshold"]))
    prompt = chunks[0][:prompt_tokens]
    n_gen = min(gen_tokens, dense.context - len(prompt))
    if n_gen < 1:
        raise FlashLLMError(f"context {dense.context} leaves no room to generate after a {len(prompt)}-token prompt")
    gen = _greedy(dense, prompt, n_gen)
    return Reference(chunks, start, nd, argmax, true_masks, prompt, gen, layers, rule.describe(spec.activation),
                     spec.d_ffn, str(dense.backend.dtype).replace("torch.", ""))


def _computed_counts(model, ref: Reference, chunk_index: list, counts: Counts):
    """An "ffn_output" observer: after each decode step, the neurons the cache computed vs the true mask."""
    plan = model.mode_impl
    position = {}

    def observe(layer: int, y):
        if layer not in position:  # a sequence's first call is its prefill (positions 0..start-1)
            position[layer] = ref.start - 1
        else:
            p = position[layer] = position[layer] + 1
            true = np.unpackbits(ref.true_masks[chunk_index[0]][layer][p], count=ref.d_ffn).astype(bool)
            cache = plan.caches[layer]
            computed = np.zeros(ref.d_ffn, bool)
            computed[cache.pointer[:cache.num_used]] = True
            counts.add(layer, computed, true)

    def next_chunk():
        position.clear()

    return observe, next_chunk


def evaluate_load(model_dir, ref: Reference, options, progress: bool | None = None, predictor: str = "lowrank") -> dict:
    """Quality, drops, bytes and latency of the sparse model loaded with `options` (one budget) and
    `predictor` (the trained ones; "auto" what the runtime picks, "oracle" or "gate" exact predictors)."""
    import flashllm
    from flashllm.progress import progress_bar

    try:
        sparse = flashllm.load(model_dir, options, mode="sparse", predictor=predictor)
    except FlashLLMError as exc:
        return {"dram_budget": options.dram_budget, "refused": exc.cli_message()}  # for `predictors eval`
    counts, chunk_index = Counts(sparse.spec.n_layers), [0]
    observe, next_chunk = _computed_counts(sparse, ref, chunk_index, counts)
    nll, agree, tokens, sums = [], [], 0, {"bytes_read": 0.0, "neurons_dropped": 0.0, "total_ms": 0.0, "io_ms": 0.0}
    with sparse.hooks.observing("ffn_output", observe), \
            progress_bar(progress, total=sum(map(len, ref.chunks)), desc=f"sparse {options.dram_budget}", unit="tok",
                         leave=False) as bar:
        for i, (chunk, d_argmax) in enumerate(zip(ref.chunks, ref.argmax)):
            chunk_index[0] = i
            next_chunk()
            rows = sparse.logits(chunk, prefill=ref.start)[ref.start:len(chunk) - 1]
            st = sparse.stats
            for k in sums:
                sums[k] += st[k] * st["decode_tokens"]
            tokens += st["decode_tokens"]
            nll.append(_nll(rows, chunk[ref.start + 1:]))
            agree.append(np.argmax(rows, axis=1) == d_argmax)
            bar.update(len(chunk))
    layers = counts.rows()
    dram = sparse.stats["dram_bytes"]
    tf = sparse.logits(ref.prompt + ref.gen[:-1], prefill=len(ref.prompt))
    follow = np.argmax(tf[len(ref.prompt) - 1:], axis=1) == np.array(ref.gen)
    free = np.array(_greedy(sparse, ref.prompt, len(ref.gen))) == np.array(ref.gen)
    ns = np.concatenate(nll)
    ppl_dense, ppl_sparse = float(math.exp(ref.nll.mean())), float(math.exp(ns.mean()))
    per = {k: v / max(tokens, 1) for k, v in sums.items()}
    return {
        "dram_budget": options.dram_budget, "budget_bytes": sparse.dram_budget, "dram_bytes": dram,
        "predictor": getattr(sparse.predictor, "kind", str(predictor)), "predictor_bytes": sparse.predictor.nbytes(),
        "model_bytes": sparse.model_bytes, "cache_capacity": list(sparse.mode_impl.capacities),
        "ppl_dense": ppl_dense, "ppl_sparse": ppl_sparse, "ppl_ratio": ppl_sparse / ppl_dense,
        "top1_agreement": float(follow.mean()), "top1_agreement_tokens": len(ref.gen),
        "top1_agreement_heldout": float(np.concatenate(agree).mean()),
        "free_run_agreement": float(free.mean()),
        "free_run_first_divergence": int(np.argmin(free)) if not free.all() else len(ref.gen),
        "neurons_dropped_per_token": per["neurons_dropped"], "bytes_per_token": per["bytes_read"],
        "latency_ms_per_token": per["total_ms"], "io_ms_per_token": per["io_ms"], "decode_tokens": tokens,
        "computed_recall": float(np.mean([r["recall"] for r in layers])),
        "computed_layers": [{"layer": r["layer"], "recall": r["recall"], "precision": r["precision"],
                             "cached_fraction": r["predicted_fraction"]} for r in layers],
    }


def naive_bytes(model_dir, ref: Reference, options) -> float | None:
    """Flash bytes per decode token of naive mode, from a short run."""
    import flashllm

    naive = flashllm.load(model_dir, _compute_options(options), mode="naive")
    chunk = ref.chunks[0]
    naive.logits(chunk[:NAIVE_PROMPT + NAIVE_DECODE] if len(chunk) > NAIVE_PROMPT else chunk,
                 prefill=min(NAIVE_PROMPT, len(chunk)))
    return naive.stats["bytes_read"] if naive.stats["decode_tokens"] else None


def evaluate(model_dir: str | Path, data: str | Path, options=None, budgets: list | None = None,
             max_tokens: int | None = 2048, gen_tokens: int = 256, prompt_tokens: int = 32,
             seq_len: int | None = None, progress: bool | None = None) -> dict:
    """Evaluate sparse mode with the trained predictors of `model_dir` on the held-out text `data`, loaded
    with `options` (a flashllm.LoadOptions; mode sparse, its predictor: auto by default) at each DRAM budget
    of `budgets` (default: the options' own). The top-level keys describe the first budget;
    `points` holds all."""
    from flashllm import LoadOptions

    options = options or LoadOptions()
    ref = dense_reference(model_dir, data, options, max_tokens, gen_tokens, prompt_tokens, seq_len, progress)
    budgets = budgets if budgets else [options.dram_budget]
    points = [evaluate_load(model_dir, ref, options.replace(dram_budget=b), progress, options.predictor) for b in budgets]
    naive = naive_bytes(model_dir, ref, options)
    for p in points:
        if "refused" not in p:
            p["naive_over_sparse"] = naive / p["bytes_per_token"] if naive and p["bytes_per_token"] else None
    ratios = [r["predicted_over_true"] for r in ref.layers if r["predicted_over_true"] is not None]
    first = points[0]
    return {
        "model_dir": str(Path(model_dir)), "data": str(data), "tokens": sum(map(len, ref.chunks)),
        "scored_tokens": int(len(ref.nll)), "dtype": ref.dtype, "window": options.window,
        "options": {k: v for k, v in dataclasses.asdict(options).items() if k not in ("dram_budget", "mode", "predictor")},
        "activation_rule": ref.rule,
        "recall": float(np.mean([r["recall"] for r in ref.layers])),
        "precision": float(np.mean([r["precision"] for r in ref.layers])),
        "predicted_over_true": float(np.mean(ratios)) if ratios else None,
        "predicted_fraction": float(np.mean([r["predicted_fraction"] for r in ref.layers])),
        "true_fraction": float(np.mean([r["true_fraction"] for r in ref.layers])),
        "ppl_dense": float(math.exp(ref.nll.mean())), "bytes_per_token_naive": naive,
        **{k: first.get(k) for k in ("dram_budget", "predictor", "refused", "ppl_sparse", "ppl_ratio", "top1_agreement",
                                     "top1_agreement_tokens", "top1_agreement_heldout", "free_run_agreement",
                                     "free_run_first_divergence", "neurons_dropped_per_token", "naive_over_sparse",
                                     "latency_ms_per_token")},
        "bytes_per_token_sparse": first.get("bytes_per_token"),
        "layers": ref.layers, "points": points,
    }
