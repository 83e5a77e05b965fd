"""How good are the trained predictors? Measured on held-out text against the dense model.

- per layer: recall, precision and predicted/true fraction of the predictors' masks against the
  true masks (same activation rule as training), on the FFN inputs of a dense pass;
- perplexity, dense vs sparse(lowrank, window): teacher-forced over the held-out tokens, each
  sequence decoded one token at a time through the KV cache (sparse mode differs from dense only
  on that decode path), scoring every token predicted by a decode step;
- greedy top-1 agreement: the dense model generates `gen_tokens` greedily from a held-out prompt
  (EOS ignored); the sparse model reads the same tokens and predicts each next one; agreement is the
  fraction of positions where its argmax equals the dense choice (also reported: the free-running
  sparse generation's positionwise agreement and its first divergence);
- flash bytes read per decode token: sparse (measured over the perplexity run) vs naive (a short
  measured naive run: every layer's weights per token).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError

from . import collect as col

NAIVE_PROMPT, NAIVE_DECODE = 4, 4


def _nll(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return lse - z[np.arange(len(targets)), targets]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` (EOS does not stop it)."""
    model.plan.reset()
    logits = model.forward(prompt, 0)
    out = []
    for i in range(n):
        out.append(int(np.argmax(logits[-1])))
        if i + 1 < n:
            logits = model.forward([out[-1]], len(prompt) + i)
    return out


class MaskCounter:
    """Accumulates, per layer, true-positive / predicted / true counts of predictor vs true masks."""

    def __init__(self, n_layers: int, predictor):
        self.predictor = predictor
        self.tp, self.pred, self.true = (np.zeros(n_layers, np.int64) for _ in range(3))
        self.cells = np.zeros(n_layers, np.int64)

    def __call__(self, layer: int, x, mask: np.ndarray) -> None:
        pred = self.predictor.predict(layer, x)
        self.tp[layer] += int((pred & mask).sum())
        self.pred[layer] += int(pred.sum())
        self.true[layer] += int(mask.sum())
        self.cells[layer] += mask.size

    def layers(self, meta_layers: list[dict]) -> list[dict]:
        rows = []
        for i, info in enumerate(meta_layers):
            t, p = int(self.true[i]), int(self.pred[i])
            rows.append({"layer": i, "rank": int(info["rank"]), "threshold": float(info["threshold"]),
                         "recall": self.tp[i] / t if t else 1.0, "precision": self.tp[i] / p if p else 1.0,
                         "predicted_fraction": p / max(int(self.cells[i]), 1),
                         "true_fraction": t / max(int(self.cells[i]), 1),
                         "predicted_over_true": p / t if t else None})
        return rows


def evaluate(model_dir: str | Path, data: str | Path, max_tokens: int | None = 2048, window: int = 4,
             gen_tokens: int = 256, prompt_tokens: int = 32, seq_len: int | None = None,
             dram_budget: float | None = None, threads: int = 4, device: str = "cpu", progress: bool = True) -> dict:
    """Evaluate the trained predictors of `model_dir` on the held-out text file `data`."""
    import flashllm
    from flashllm.predictor import LowRankPredictor
    from tqdm import tqdm

    if window < 1:
        raise FlashLLMError(f"--window {window}: must be at least 1")
    if gen_tokens < 1 or prompt_tokens < 1:
        raise FlashLLMError("--gen-tokens and the prompt length must be at least 1")
    text = col.read_data(data, max_tokens)
    dense = flashllm.load(model_dir, mode="dense", device=device)
    predictor = LowRankPredictor(dense)
    spec = dense.spec
    saved_rule = predictor.meta.get("activation_rule")
    rule = col.ActivationRule(saved_rule["kind"], float(saved_rule["threshold"]), saved_rule["part"]) \
        if saved_rule else col.activation_rule(spec)
    chunks = col.chunk_text(dense, text, seq_len, max_tokens, str(data))
    del text
    prefix = len(dense.tokenizer.encode(""))
    start = max(prefix, 1)  # rows start.. come from decode steps and are scored
    chunks = [c for c in chunks if len(c) >= start + 2] or chunks
    total = sum(map(len, chunks))
    counter = MaskCounter(spec.n_layers, predictor)
    nll_dense, nll_sparse, argmax_dense, agree_heldout = [], [], [], []
    with col.recording(dense, rule, counter), \
            tqdm(total=total, desc="dense", unit="tok", disable=not progress, leave=False) as bar:
        for chunk in chunks:
            rows = dense.logits(chunk)[start:len(chunk) - 1]  # one prefill: the same math as token by token
            nll_dense.append(_nll(rows, chunk[start + 1:]))
            argmax_dense.append(np.argmax(rows, axis=1))
            bar.update(len(chunk))
    layers = counter.layers(predictor.meta["layers"])
    del predictor

    sparse = flashllm.load(model_dir, mode="sparse", predictor="lowrank", window=window, dram_budget=dram_budget,
                           threads=threads, device=device)
    bytes_read, decode_tokens, dropped = 0.0, 0, 0.0
    with tqdm(total=total, desc="sparse", unit="tok", disable=not progress, leave=False) as bar:
        for chunk, d_argmax in zip(chunks, argmax_dense):
            rows = sparse.logits(chunk, prefill=start)[start:len(chunk) - 1]
            st = sparse.stats
            bytes_read += st["bytes_read"] * st["decode_tokens"]
            dropped += st["neurons_dropped"] * st["decode_tokens"]
            decode_tokens += st["decode_tokens"]
            nll_sparse.append(_nll(rows, chunk[start + 1:]))
            agree_heldout.append(np.argmax(rows, axis=1) == d_argmax)
            bar.update(len(chunk))
    nd, ns = np.concatenate(nll_dense), np.concatenate(nll_sparse)
    if len(nd) == 0:
        raise FlashLLMError(f"data file {data}: too few tokens to score (sequences need at least {start + 2})")

    # greedy generation: dense picks, sparse follows (teacher-forced) and runs free
    prompt = chunks[0][:prompt_tokens]
    n_gen = min(gen_tokens, dense.context - len(prompt), sparse.context - len(prompt))
    if n_gen < 1:
        raise FlashLLMError(f"context {dense.context} leaves no room to generate after a {len(prompt)}-token prompt")
    gen = _greedy(dense, prompt, n_gen)
    del dense
    tf = sparse.logits(prompt + gen[:-1], prefill=len(prompt))
    follow = np.argmax(tf[len(prompt) - 1:], axis=1) == np.array(gen)
    free = _greedy(sparse, prompt, n_gen)
    free_match = np.array(free) == np.array(gen)
    first_diff = int(np.argmin(free_match)) if not free_match.all() else n_gen
    del sparse

    naive = flashllm.load(model_dir, mode="naive", threads=threads, device=device)
    naive.logits(chunks[0][:NAIVE_PROMPT + NAIVE_DECODE] if len(chunks[0]) > NAIVE_PROMPT else chunks[0],
                 prefill=min(NAIVE_PROMPT, len(chunks[0])))
    naive_bytes = naive.stats["bytes_read"] if naive.stats["decode_tokens"] else None
    del naive

    ratios = [r["predicted_over_true"] for r in layers if r["predicted_over_true"] is not None]
    sparse_bytes = bytes_read / max(decode_tokens, 1)
    ppl_dense, ppl_sparse = float(math.exp(nd.mean())), float(math.exp(ns.mean()))
    return {
        "model_dir": str(Path(model_dir)), "data": str(data), "tokens": total, "scored_tokens": int(len(nd)),
        "window": window, "dram_budget": dram_budget, "activation_rule": rule.describe(spec.activation),
        "recall": float(np.mean([r["recall"] for r in layers])),
        "precision": float(np.mean([r["precision"] for r in layers])),
        "predicted_over_true": float(np.mean(ratios)) if ratios else None,
        "predicted_fraction": float(np.mean([r["predicted_fraction"] for r in layers])),
        "true_fraction": float(np.mean([r["true_fraction"] for r in layers])),
        "ppl_dense": ppl_dense, "ppl_sparse": ppl_sparse, "ppl_ratio": ppl_sparse / ppl_dense,
        "top1_agreement": float(follow.mean()), "top1_agreement_tokens": int(n_gen),
        "top1_agreement_heldout": float(np.concatenate(agree_heldout).mean()),
        "free_run_agreement": float(free_match.mean()), "free_run_first_divergence": first_diff,
        "bytes_per_token_sparse": sparse_bytes, "bytes_per_token_naive": naive_bytes,
        "naive_over_sparse": naive_bytes / sparse_bytes if naive_bytes and sparse_bytes else None,
        "neurons_dropped_per_token": dropped / max(decode_tokens, 1),
        "layers": layers,
    }


def format_report(r: dict) -> str:
    """The evaluation as a few lines and a per-layer table."""
    def mib(b):
        return "n/a" if b is None else f"{b / 2**20:.3f} MiB"

    ratio = "n/a" if r["naive_over_sparse"] is None else f"{r['naive_over_sparse']:.1f}x fewer"
    lines = [
        f"{r['model_dir']} on {r['data']}: {r['tokens']} tokens, {r['scored_tokens']} scored; window {r['window']}",
        f"active iff {r['activation_rule']}",
        f"predictors: recall {r['recall']:.4f}  precision {r['precision']:.4f}  predicted/true "
        f"{r['predicted_over_true'] if r['predicted_over_true'] is None else round(r['predicted_over_true'], 3)}  "
        f"(predicted {r['predicted_fraction']:.3f} of neurons, true {r['true_fraction']:.3f})",
        f"perplexity: dense {r['ppl_dense']:.4f}  sparse {r['ppl_sparse']:.4f}  ({(r['ppl_ratio'] - 1) * 100:+.2f}%)",
        f"greedy top-1 agreement: {r['top1_agreement'] * 100:.1f}% over {r['top1_agreement_tokens']} tokens "
        f"(held-out text {r['top1_agreement_heldout'] * 100:.1f}%; free-running {r['free_run_agreement'] * 100:.1f}%, "
        f"first divergence at {r['free_run_first_divergence']})",
        f"flash read per decode token: sparse {mib(r['bytes_per_token_sparse'])}  naive "
        f"{mib(r['bytes_per_token_naive'])}  ({ratio})",
        "",
        f"{'layer':>5} {'rank':>5} {'threshold':>10} {'recall':>7} {'precision':>9} {'predicted':>9} {'true':>6} "
        f"{'pred/true':>9}",
    ]
    for x in r["layers"]:
        pt = "n/a" if x["predicted_over_true"] is None else f"{x['predicted_over_true']:.2f}"
        lines.append(f"{x['layer']:>5} {x['rank']:>5} {x['threshold']:>10.3g} {x['recall']:>7.4f} "
                     f"{x['precision']:>9.4f} {x['predicted_fraction']:>9.4f} {x['true_fraction']:>6.3f} {pt:>9}")
    return "\n".join(lines)
