"""The predictors' behaviour on sample text, for `flashllm plan`: per layer, the predicted set of every
token, replayed through the runtime's own NeuronCache at a window k and capacity c, with the runtime's
hot-neuron pinning, to count what a decode token costs there: bundles loaded, the engine's reads and
bytes (read_plan.Reads, as the reader plans them per staging chunk), rows held and neurons dropped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

WINDOWS = (1, 2, 3, 4, 6, 8)
CAPACITY_POINTS = 8
MAX_CHUNK = 1 << 20  # the FFN reader's engine: FlashReader's default max_chunk_bytes


class _NoStore:
    """NeuronCache bookkeeping without rows: what the replay needs."""

    def move(self, dst, src):
        pass


@dataclass(frozen=True)
class ReadGeometry:
    """How the runtime turns a layer's missing neurons into reads: the read layout's segments (a resident
    gate leaves up and down, one read per neuron), the gap read through, and the rows per engine call
    (the staging buffer's; None when reads land in the cache rows, one call per token and layer)."""

    layout: object  # format.FFNLayout the sparse plan reads (FFNLayout.only for a resident part)
    gap_bytes: int = 0
    chunk_rows: int | None = None
    alignment: int = 1  # direct I/O reads whole aligned blocks (FlashReader.alignment): bytes transferred
    max_chunk: int = MAX_CHUNK

    def reads(self, layer: int, ids: np.ndarray) -> tuple[int, int, int]:
        """(reads, bytes transferred, engine calls) the engine issues for sorted neuron `ids` of `layer`."""
        from flashllm.io.read_list import Reads

        if not len(ids):
            return 0, 0, 0
        step = self.chunk_rows or len(ids)
        reads = nbytes = calls = 0
        for k in range(0, len(ids), step):
            chunk = ids[k:k + step]
            calls += 1  # a chunk's segments (up, down) are in flight together: one wait
            for base, stride, row, _ in self.layout.segments(layer):
                offs = base + chunk.astype(np.int64) * stride
                doffs = np.arange(len(chunk), dtype=np.int64) * row
                if self.max_chunk < 2 * row:  # FlashReader: rows alone, cut into max_chunk pieces
                    pieces = -(-row // self.max_chunk)
                    off = np.repeat(offs, pieces) + np.tile(np.arange(pieces) * self.max_chunk, len(offs))
                    n = np.minimum(row - np.tile(np.arange(pieces) * self.max_chunk, len(offs)), self.max_chunk)
                else:
                    r = Reads.plan(offs, doffs, row, min(self.gap_bytes, self.max_chunk), self.max_chunk, gather=True)
                    off, n = r.off, r.len
                a = self.alignment
                reads, nbytes = reads + len(off), nbytes + int((-(-(off + n) // a) * a - off // a * a).sum())
        return reads, nbytes, calls


def _fit_pinned(cache, active: np.ndarray) -> bool:
    """flashllm.modes.sparse.mode.SparseMode._fit's pinning rule: release the least frequent pinned neurons until the token's
    other neurons fit the rest of the cache. True when they fit (no capacity cut applies then)."""
    while cache.pinned:
        rows = cache.row_of[active]
        over = int(((rows < 0) | (rows >= cache.pinned)).sum()) - (cache.capacity - cache.pinned)
        if over <= 0:
            return True
        cache.unpin(over)
    return False


def replay(masks: list[np.ndarray], window: int, capacity: int, d_ffn: int, geometry: ReadGeometry | None = None,
           layer: int = 0, hot: np.ndarray | None = None) -> dict:
    """One layer's predicted sets (bool [tokens, d_ffn] per sequence) through a NeuronCache as the sparse
    plan drives it: per token means of bundles loaded, reads, bytes and engine calls the engine issues for them, rows
    held; the share of predicted neurons dropped for lack of rows; and the rows pinned. `hot`: the layer's
    activation frequencies (pinning as the runtime's `pin_hot`; None: no pinning)."""
    from flashllm.modes.sparse.neuron_cache import NeuronCache, pinned_rows

    cache = NeuronCache(capacity, d_ffn, _NoStore())
    pinned = pinned_rows(hot, capacity, window) if hot is not None else 0
    if pinned:
        cache.append(np.argsort(-hot, kind="stable")[:pinned])  # read once at load, not per token
        cache.pinned = pinned
    loaded = nbytes = reads = calls = held = dropped = predicted = tokens = 0
    for seq in masks:
        cache.reset()
        for row in seq:
            active = np.flatnonzero(row)
            predicted += len(active)
            if not _fit_pinned(cache, active) and len(active) > capacity:
                active, dropped = active[:capacity], dropped + len(active) - capacity
            missing, _, cut = cache.evict(active, window)
            missing, dropped = missing[:len(missing) - cut] if cut else missing, dropped + cut
            cache.append(missing)
            r, b, c = geometry.reads(layer, missing) if geometry is not None else (_runs(missing), 0, int(len(missing) > 0))
            loaded, nbytes, reads, calls = loaded + len(missing), nbytes + b, reads + r, calls + c
            held, tokens = held + cache.num_used, tokens + 1
    n = max(tokens, 1)
    return {"loaded": loaded / n, "bytes": nbytes / n, "reads": reads / n, "calls": calls / n, "held": held / n,
            "drop_share": dropped / max(predicted, 1), "pinned": pinned}


def _runs(ids: np.ndarray) -> int:
    """Runs of adjacent ids (reads of a bundled layout without gaps or chunks)."""
    return int(len(ids) and 1 + np.count_nonzero(np.diff(ids) > 1))


def sample_masks(model_dir, data: str | None, tokens: int, predictor: str = "lowrank",
                 seq_len: int = 128) -> list[list[np.ndarray]]:
    """Per layer, per sequence: the sets `predictor` (a predictor.PREDICTORS name: the trained low-rank
    predictors, or the resident gate's calibrated thresholds) selects on `tokens` tokens of sample text
    (the file `data`, or this Python's standard library sources when None)."""
    from flashllm import load
    from flashllm.modes.sparse.predictor import make_predictor

    model = load(model_dir, mode="dense", context=seq_len) if _fits_dense(model_dir) else \
        load(model_dir, mode="naive", context=seq_len)
    chosen = make_predictor(predictor, model.mode_context)
    model.mode_context.close()
    seq_len = min(seq_len, model.context)
    ids = sample_ids(model_dir, data, tokens)
    per_layer = [[] for _ in range(model.spec.n_layers)]
    with model.hooks.observing("ffn_input", lambda layer, x: per_layer[layer][-1].append(chosen.predict(layer, x))):
        for k in range(0, len(ids), seq_len):
            for lst in per_layer:
                lst.append([])
            model.mode_impl.reset()
            model.forward([int(i) for i in ids[k:k + seq_len]], 0)
    return [[np.concatenate(s) for s in lst if s] for lst in per_layer]


def sample_ids(model_dir, data: str | None, tokens: int) -> list[int]:
    """`tokens` token ids of sample text (the file `data`, or this Python's standard library sources);
    random ids for a model without a tokenizer."""
    from flashllm.format import manifest as fmt
    from flashllm.text.tokenizer import Tokenizer

    m = fmt.read_manifest(model_dir, verify=False)
    if not m.has("tokenizer.json"):
        return [int(i) for i in np.random.default_rng(0).integers(3, m.spec.vocab_size, tokens)]
    text = Path(data).read_text(errors="replace") if data else _stdlib_text(tokens * 8)
    return Tokenizer(m.root, m.spec.bos_token_id).encode(text)[:tokens]


def _fits_dense(model_dir) -> bool:
    from flashllm.format import manifest as fmt

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

    def __init__(self, masks_per_layer, d_ffn: int, geometry: ReadGeometry | None = None, hot=None):
        """`hot`: per layer, the activation frequencies the runtime pins by (None: no pinning)."""
        self.masks, self.d_ffn, self.geometry, self.hot, self._memo = masks_per_layer, d_ffn, geometry, hot, {}
        self.sizes = [np.concatenate([m.sum(axis=1) for m in masks]) for masks in masks_per_layer]

    def at(self, layer: int, window: int, capacity: int) -> dict:
        key = (layer, window, min(capacity, self.d_ffn))
        if key not in self._memo:
            self._memo[key] = {"capacity": key[2], **replay(self.masks[layer], window, key[2], self.d_ffn,
                                                            self.geometry, layer,
                                                            None if self.hot is None else self.hot[layer])}
        return self._memo[key]

    def curves(self, extra: list[int] | None = None, windows=WINDOWS, points: int = CAPACITY_POINTS) -> list[dict]:
        """Per layer, per window: replays at a ladder of capacities from the median set per token to the
        window's largest union (with pinning, on to every neuron: rows beyond the window's need pin more hot
        neurons), plus `extra[layer]` (e.g. what the runtime would size by default)."""
        out = []
        for layer, masks in enumerate(self.masks):
            low = max(int(np.percentile(self.sizes[layer], 50)), 1)
            curve = {}
            for k in windows:
                top = max(_max_union(masks, k), low)
                caps = {int(c) for c in np.linspace(low, top, points)}
                if self.hot is not None:
                    caps |= {int(c) for c in np.linspace(top, self.d_ffn, points // 2)}
                if extra:
                    caps.add(min(extra[layer], self.d_ffn if self.hot is not None else top))
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
