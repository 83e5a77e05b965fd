"""Per-layer thresholds that make a dense activation (SiLU, GELU) sparse: CATS thresholds on
|act(gate x)|, allocated over layers greedily as TEAL does.

A short dense pass over a sample of the calibration sequences records each layer's FFN input x.
Per layer, with the model's own FFN math (`backend.ffn`, the function sparse mode runs):
- a = act(gate x + b) (act(up x + b) for an ungated FFN); threshold t(s) = the s-quantile of |a|
  over the sample's tokens and neurons, for s on a grid of GRID_STEP;
- error e(s) = ||FFN_t(s)(x) - FFN(x)|| / ||FFN(x)|| over the error sample's tokens (relative RMS,
  down bias left out): what skipping the neurons with |a| <= t(s) does to the layer's output.

Then `--sparsity S`: every layer starts dense and the layer whose squared error grows least takes
the next grid step, until the mean sparsity reaches S (TEAL's greedy allocation; layers whose
outputs barely change go sparser). `--ffn-error E`: each layer at the largest grid sparsity with
e <= E. `--activation-threshold T`: T in every layer. The thresholds, and the sparsity and error
measured with them, go to sparsity.json (flashllm/modes/sparse/activation_sparsity.py) and label the predictors' training.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.modes.sparse.activation_sparsity import DENSE_ACTIVATIONS, SPARSITY_FILE, sparsity_document

GRID_STEP = 0.025
MAX_SPARSITY = 0.95
SAMPLE_TOKENS = 4096  # thresholds: quantiles over this many tokens x d_ffn activations
ERROR_TOKENS = 512  # errors: the FFN recomputed at every grid step for this many tokens


@dataclass(frozen=True)
class Target:
    """What to calibrate for: a mean sparsity, a per-layer FFN error bound, or one explicit threshold."""

    method: str  # "sparsity", "ffn_error" or "explicit"
    value: float

    def check(self, activation: str) -> None:
        option = {"sparsity": "--sparsity", "ffn_error": "--ffn-error", "explicit": "--activation-threshold"}[self.method]
        if activation not in DENSE_ACTIVATIONS:
            raise FlashLLMError(f"{option}: this model's {activation} FFN is sparse by itself; calibrated thresholds "
                                f"are for dense activations ({', '.join(DENSE_ACTIVATIONS)})")
        ok = {"sparsity": 0 < self.value <= MAX_SPARSITY, "ffn_error": 0 < self.value < 1,
              "explicit": self.value >= 0}[self.method]
        if not ok or not np.isfinite(self.value):
            bound = {"sparsity": f"in (0, {MAX_SPARSITY}]", "ffn_error": "in (0, 1)", "explicit": ">= 0"}[self.method]
            raise FlashLLMError(f"{option} {self.value}: must be a finite number {bound}")


@dataclass
class LayerCurve:
    """One layer's grid: sparsity -> threshold and relative FFN error."""

    sparsity: np.ndarray
    threshold: np.ndarray
    error: np.ndarray


def sample_chunks(chunks: list[list[int]], tokens: int = SAMPLE_TOKENS) -> list[list[int]]:
    """Calibration sequences spread evenly over the data, about `tokens` tokens in all."""
    mean = max(1, sum(map(len, chunks)) // len(chunks))
    n = min(len(chunks), max(1, -(-tokens // mean)))
    return [chunks[int(i)] for i in np.linspace(0, len(chunks) - 1, n).round().astype(int)]


def record_inputs(model, chunks: list[list[int]]) -> list[np.ndarray]:
    """Per layer, the FFN inputs of a dense pass over `chunks` (float32 [tokens, d_model])."""
    xs = [[] for _ in range(model.spec.n_layers)]

    def observe(layer: int, x):
        xs[layer].append(model.backend.to_host(x))

    with model.hooks.observing("ffn_input", observe):
        for chunk in chunks:
            model.mode_impl.reset()
            model.forward(chunk, 0)
    return [np.concatenate(x) for x in xs]


def layer_curve(model, layer: int, x: np.ndarray, error_tokens: int = ERROR_TOKENS):
    """The layer's grid curve, |act| of the sample and a function threshold -> relative error."""
    B, spec = model.backend, model.spec
    part = "gate" if spec.gated_ffn else "up"
    rows = getattr(model.mode_impl, "rows", None)  # resident in dense mode, else read
    ctx = model.mode_context
    rows = rows[layer] if rows is not None else ctx.bundle_rows(ctx.read_layer_block(layer))
    bias = ctx.biases(layer)
    xt = B.tensor(x)
    abs_act = np.abs(B.to_host(B.act(B.linear(xt, B.ffn_part(rows, part), bias[part]))))
    pick = np.linspace(0, len(x) - 1, min(len(x), error_tokens)).round().astype(int)
    xe = B.tensor(x[pick])
    dense = B.to_host(B.ffn(xe, rows, bias["up"], bias["gate"], None))
    norm = float(np.sqrt((dense.astype(np.float64) ** 2).sum())) or 1.0

    def error_at(t: float) -> float:
        y = B.to_host(B.ffn(xe, rows, bias["up"], bias["gate"], None, float(t)))
        return float(np.sqrt(((y.astype(np.float64) - dense) ** 2).sum())) / norm

    grid = np.round(np.arange(0, MAX_SPARSITY + 1e-9, GRID_STEP), 6)
    thresholds = np.quantile(abs_act.ravel(), grid, method="lower")
    thresholds[0] = 0.0  # sparsity 0: only exact zeros skipped
    return LayerCurve(grid, thresholds, np.array([error_at(t) for t in thresholds])), abs_act, error_at


def allocate(curves: list[LayerCurve], target: float) -> list[int]:
    """Greedy (TEAL): grid indices per layer whose mean sparsity reaches `target`, each step taken by
    the layer whose squared relative error grows least."""
    idx = [0] * len(curves)
    while np.mean([c.sparsity[i] for c, i in zip(curves, idx)]) < target - 1e-9:
        growth = [(c.error[i + 1] ** 2 - c.error[i] ** 2) if i + 1 < len(c.sparsity) else np.inf
                  for c, i in zip(curves, idx)]
        best = int(np.argmin(growth))
        if not np.isfinite(growth[best]):
            break
        idx[best] += 1
    return idx


def calibrate(model, chunks: list[list[int]], target: Target, log=lambda m: None) -> dict:
    """Thresholds for `target` from a dense pass over a sample of `chunks`: the sparsity.json document."""
    spec = model.spec
    target.check(spec.activation)
    sample = sample_chunks(chunks)
    xs = record_inputs(model, sample)
    layers = [layer_curve(model, i, x) for i, x in enumerate(xs)]
    if target.method == "sparsity":
        picks = allocate([c for c, _, _ in layers], target.value)
        chosen = [float(c.threshold[i]) for (c, _, _), i in zip(layers, picks)]
    elif target.method == "ffn_error":
        chosen = [float(c.threshold[np.flatnonzero(c.error <= target.value).max()]) for c, _, _ in layers]
    else:
        chosen = [float(target.value)] * spec.n_layers
    measured = [(float((a <= t).mean()), err(t)) for (_, a, err), t in zip(layers, chosen)]
    for i, (t, (s, e)) in enumerate(zip(chosen, measured)):
        log(f"layer {i}: threshold {t:.4g}, sparsity {s:.3f}, FFN error {e:.4f}")
    curves = [{"sparsity": c.sparsity.tolist(), "ffn_error": np.round(c.error, 5).tolist()} for c, _, _ in layers]
    extra = {"activation": spec.activation, "grid_step": GRID_STEP,
             "sample": {"sequences": len(sample), "tokens": int(len(xs[0])),
                        "error_tokens": int(min(len(xs[0]), ERROR_TOKENS))},
             "allocation": {"sparsity": "greedy over layers: the smallest growth of squared relative FFN error",
                            "ffn_error": "per layer, the largest grid sparsity within the bound",
                            "explicit": "the same threshold in every layer"}[target.method],
             "curves": curves}
    return sparsity_document(chosen, [s for s, _ in measured], [e for _, e in measured], target.method,
                             target.value, model.manifest.data["files"]["ffn"]["sha256"], extra)


def write_sparsity(model_dir: str | Path, document: dict) -> Path:
    """sparsity.json, written to a temporary name in the directory and renamed into place."""
    path = Path(model_dir) / SPARSITY_FILE
    tmp = path.with_name(f".{SPARSITY_FILE}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(document, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
