"""The predictors' behaviour on sample text, for `flashllm plan`: per layer, the predicted set of every
token, replayed through the runtime's own NeuronCache at a window k and capacity c to count bundles
loaded, reads issued (runs of adjacent ids, as the engine coalesces them), rows held and neurons
dropped per token."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WINDOWS = (1, 2, 3, 4, 6, 8)
CAPACITY_POINTS = 8


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
    ids = sample_ids(model_dir, data, tokens)
    per_layer = [[] for _ in range(model.spec.n_layers)]
    with model.hooks.observing("ffn_input", lambda layer, x: per_layer[layer][-1].append(predictor.predict(layer, x))):
        for k in range(0, len(ids), seq_len):
            for lst in per_layer:
                lst.append([])
            model.plan.reset()
            model.forward([int(i) for i in ids[k:k + seq_len]], 0)
    return [[np.concatenate(s) for s in lst if s] for lst in per_layer]


def sample_ids(model_dir, data: str | None, tokens: int) -> list[int]:
    """`tokens` token ids of sample text (the file `data`, or this Python's standard library sources);
    random ids for a model without a tokenizer."""
    from . import format as fmt
    from .tokenizer import Tokenizer

    m = fmt.read_manifest(model_dir, verify=False)
    if not m.has("tokenizer.json"):
        return [int(i) for i in np.random.default_rng(0).integers(3, m.spec.vocab_size, tokens)]
    text = Path(data).read_text(errors="replace") if data else _stdlib_text(tokens * 8)
    return Tokenizer(m.root, m.spec.bos_token_id).encode(text)[:tokens]


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
