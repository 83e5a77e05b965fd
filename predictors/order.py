"""`flashllm predictors order`: measure which neurons the predictors select together on calibration text,
compute each layer's co-activation order (coactivation.py) and rewrite the model in it (reorder.py).

The statistic follows what the runtime reads: by default the *loads* of a sliding window of `window`
tokens (neurons predicted now and not in the previous window-1 tokens), since those are the bundles a
decode token fetches; "active" uses the predicted sets themselves. Without trained predictors the true
activations are used (the model's own activation rule, as in calibration).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError

from flashllm.predictors import coactivation as co

DEFAULT_MAX_TOKENS = 20_000
DEFAULT_WINDOW = 4


def layer_counts(masks: np.ndarray, lengths: list[int], window: int, statistic: str,
                 counts: co.CoCounts | None = None) -> co.CoCounts:
    """Co-occurrence counts of one layer's per-token masks (bool [tokens, d_ffn], sequences of `lengths`)."""
    if statistic not in co.STATISTICS:
        raise FlashLLMError(f"statistic {statistic!r}: expected one of {', '.join(co.STATISTICS)}")
    counts = counts or co.CoCounts(masks.shape[1])
    k = 0
    for n in lengths:
        seq = masks[k:k + n]
        counts.add(co.loads(seq, window) if statistic == "loads" else seq)
        k += n
    return counts


def orders_from_counts(counts: list[co.CoCounts], neighbours: int = co.DEFAULT_NEIGHBOURS):
    """Every layer's order and a summary of its expected effect on the counted data."""
    perms, layers = [], []
    for c in counts:
        perm, fig = co.layer_order(c, neighbours)
        perms.append(perm)
        layers.append(fig)
    before = sum(f["runs_per_token_before"] for f in layers)
    after = sum(f["runs_per_token_after"] for f in layers)
    return perms, {"layers": layers, "runs_per_token_before": round(before, 2), "runs_per_token_after": round(after, 2)}


def _masks_of(model, chunks, predictor, progress: bool | None) -> list[list[np.ndarray]]:
    """Per layer, per sequence: the predicted (or, with no predictor, true) masks of every token."""
    from flashllm.progress import progress_bar

    from flashllm.predictors.collect import activation_rule, recording

    per_layer: list[list[np.ndarray]] = [[] for _ in range(model.spec.n_layers)]
    if predictor is not None:
        watch = model.hooks.observing("ffn_input", lambda layer, x: per_layer[layer].append(predictor.predict(layer, x)))
    else:
        watch = recording(model, activation_rule(model.spec), lambda layer, x, mask: per_layer[layer].append(mask))
    with watch, progress_bar(progress, total=sum(map(len, chunks)), unit="tok", desc="order: collect",
                             leave=False) as bar:
        for chunk in chunks:
            model.mode_impl.reset()
            model.forward(chunk, 0)
            bar.update(len(chunk))
    return per_layer


def order_model(model_dir: str | Path, data: str | Path, max_tokens: int = DEFAULT_MAX_TOKENS,
                window: int = DEFAULT_WINDOW, statistic: str = "loads", neighbours: int = co.DEFAULT_NEIGHBOURS,
                seq_len: int | None = None, low_memory: bool = False, dtype: str | None = None,
                device: str = "cpu", progress: bool | None = None, log=None) -> dict:
    """Order every layer's neurons by co-activation on `data` and rewrite `model_dir` in that order.
    Returns the manifest's new "neuron_order" entry."""
    from flashllm.modes.sparse.predictor import PREDICTOR_META, LowRankPredictor

    from flashllm.predictors import collect as col
    from flashllm.predictors.reorder import apply_order
    from flashllm.predictors.train import check_writable

    log = log or (lambda msg: None)
    if window < 1:
        raise FlashLLMError(f"--window {window}: must be at least 1")
    if neighbours < 1:
        raise FlashLLMError(f"--neighbours {neighbours}: must be at least 1")
    if statistic not in co.STATISTICS:
        raise FlashLLMError(f"--statistic {statistic!r}: expected one of {', '.join(co.STATISTICS)}")
    check_writable(model_dir)
    t0 = time.perf_counter()
    text = col.read_data(data, max_tokens)
    model = col.open_model(model_dir, device=device, dtype=dtype, low_memory=low_memory, seq_len=seq_len)
    if model.spec.is_moe:
        raise FlashLLMError(f"{model_dir}: a mixture-of-experts model streams whole experts; neuron order does not apply")
    has_predictors = (Path(model_dir) / PREDICTOR_META).is_file()
    predictor = LowRankPredictor(model.mode_context) if has_predictors else None
    chunks = col.chunk_text(model, text, seq_len, max_tokens, str(data))
    source = "predicted (trained predictors)" if predictor else "true activations (no trained predictors)"
    log(f"collecting {source} sets over {sum(map(len, chunks))} tokens in {len(chunks)} sequences")
    per_layer = _masks_of(model, chunks, predictor, progress)
    del model, predictor
    lengths = [len(c) for c in chunks]
    counts = [layer_counts(np.concatenate(m), lengths, window, statistic) for m in per_layer]
    del per_layer
    perms, summary = orders_from_counts(counts, neighbours)
    info = {"method": "coactivation", "statistic": statistic, "window": window, "neighbours": neighbours,
            "source": source, "tokens": sum(lengths), "data": str(data), **summary,
            "seconds": round(time.perf_counter() - t0, 2)}
    log(f"expected reads per token on the calibration text (all layers, no gap filling): "
        f"{summary['runs_per_token_before']} -> {summary['runs_per_token_after']}")
    apply_order(model_dir, perms, info, progress)
    return info
