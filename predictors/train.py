"""Train the per-layer low-rank activation predictors `sigmoid(B (A x) + b)` (paper §3.1, App. B).

Per layer, from that layer's calibration shard only (see collect.py):
- whole calibration sequences are split at random (seeded) into train and held-out parts
  (`heldout_fraction`): thresholds and ranks are chosen on text the predictor never saw, not on
  tokens taken from the same sequences it trained on (those overstate recall);
- loss: binary cross-entropy with each neuron's positives weighted by its inverse class
  frequency, n_inactive / n_active on the train tokens (capped at `max_pos_weight`), so rarely
  active neurons are not simply predicted off; Adam with a cosine learning-rate decay;
- threshold: the largest one that still reaches the recall target on the held-out sequences;
- rank: the one of the ladder (16, 32, 64, 128, 256; capped by d_model) with the lowest total
  DRAM cost at that recall: the predictor's own weights plus the cache rows its predictions need
  (the union of the predicted sets of `window` consecutive held-out tokens, as the runtime's
  sliding window holds them). A more precise predictor needs fewer rows and reads fewer bundles
  per token, but costs more weights; ranks whose weights alone cost more than the best total so
  far are not trained. `--rank N` forces one rank.

Memory: one layer's shard in RAM at a time; see `memory_estimate` for a 7B-class model.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_FORMAT, PREDICTOR_META, PREDICTOR_VERSION

from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE

from flashllm.predictors.calibrate import Target, calibrate, write_sparsity
from flashllm.predictors import collect as col

RANK_LADDER = (16, 32, 64, 128, 256)
# Calibration tokens by default. Collection time and temporary disk grow linearly with tokens
# (a 7B model: 29 GiB of shards at 100k tokens, see memory_estimate) while the predictors gain
# little beyond: a rank-256 predictor of a 7B layer (3.9M weights) trains against 100k x 11008
# labels; the embedded model's predictors are trained on this many (see README).
DEFAULT_MAX_TOKENS = 100_000
LOGIT_LIMIT = 30.0  # thresholds are stored as probabilities; keep logit(t) representable
GiB = 1 << 30
SMALL_STEP_FLOPS = 2e8


@dataclass(frozen=True)
class TrainSettings:
    rank: int | None = None  # None: adaptive, from rank_ladder
    rank_ladder: tuple[int, ...] = RANK_LADDER
    recall_target: float = 0.97  # on held-out calibration sequences
    window: int = 4  # the runtime's default window: rank cost counts the rows of this many tokens' union
    epochs: int = 6
    min_steps: int = 400  # small calibration sets: more epochs, at least this many Adam steps
    batch_size: int = 512
    lr: float = 1e-2
    max_pos_weight: float = 4.0
    heldout_fraction: float = 0.1
    seed: int = 0
    device: str = "cpu"

    def check(self) -> None:
        if self.rank is not None and self.rank < 1:
            raise FlashLLMError(f"--rank {self.rank}: must be at least 1")
        if not 0 < self.recall_target < 1:
            raise FlashLLMError(f"--recall-target {self.recall_target}: must be between 0 and 1 (exclusive)")
        if self.window < 1:
            raise FlashLLMError(f"window {self.window}: must be at least 1")
        if not 0 < self.heldout_fraction < 1:
            raise FlashLLMError(f"held-out fraction {self.heldout_fraction}: must be between 0 and 1")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise FlashLLMError("epochs, batch size and learning rate must be positive")


@dataclass
class LayerResult:
    rank: int
    threshold: float  # probability; predicted iff sigmoid(z) > threshold
    recall: float
    precision: float
    predicted_fraction: float
    true_fraction: float
    A: np.ndarray = field(repr=False)  # [rank, d_model] float32
    B: np.ndarray = field(repr=False)  # [d_ffn, rank]
    b: np.ndarray = field(repr=False)  # [d_ffn]
    tried: list = field(default_factory=list)  # per rank trained: {rank, predicted_over_true, union_rows, cost}
    train_tokens: int = 0
    heldout_tokens: int = 0
    union_rows: float = 0.0  # mean cache rows the window's union of predicted sets needs
    cost_bytes: int = 0  # predictor weights + those rows, float32

    @property
    def predicted_over_true(self) -> float:
        return self.predicted_fraction / self.true_fraction if self.true_fraction > 0 else float("inf")

    def info(self) -> dict:
        return {"rank": self.rank, "threshold": self.threshold, "recall": self.recall, "precision": self.precision,
                "predicted_fraction": self.predicted_fraction, "true_fraction": self.true_fraction,
                "predicted_over_true": _finite(self.predicted_over_true), "ranks_tried": self.tried,
                "train_tokens": self.train_tokens, "heldout_tokens": self.heldout_tokens,
                "union_rows": self.union_rows, "cost_bytes": self.cost_bytes}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


# -- one layer ---------------------------------------------------------------------------------
class LayerData:
    """One layer's calibration tokens: x float16 and packed masks, batches made on demand."""

    def __init__(self, x: np.ndarray, packed: np.ndarray, d_ffn: int, device):
        self.x, self.packed, self.d_ffn, self.device = x, packed, d_ffn, device

    def __len__(self) -> int:
        return self.x.shape[0]

    def batch(self, idx: np.ndarray):
        import torch

        # converted by torch, so the batch is in torch's (aligned) memory: MKL results can depend on alignment
        x = torch.from_numpy(self.x[idx]).to(device=self.device, dtype=torch.float32)
        y = torch.from_numpy(np.unpackbits(self.packed[idx], axis=1, count=self.d_ffn)).to(self.device)
        return x, y

    def active_counts(self, idx: np.ndarray, step: int = 8192) -> np.ndarray:
        counts = np.zeros(self.d_ffn, np.int64)
        for k in range(0, len(idx), step):
            counts += np.unpackbits(self.packed[idx[k:k + step]], axis=1, count=self.d_ffn).sum(axis=0, dtype=np.int64)
        return counts


def split_tokens(lengths: list[int], heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Sorted train and held-out token indices, and the held-out sequences as index ranges.

    Whole sequences are held out when there are at least 4 (so the threshold is tuned on text the
    predictor did not train on); otherwise single tokens at random. At least one token in each part.
    """
    n, rng = sum(lengths), np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if len(lengths) >= 4:
        h = min(len(lengths) - 1, max(1, int(round(len(lengths) * heldout_fraction))))
        held_seqs = np.sort(rng.permutation(len(lengths))[:h])
        ranges = [np.arange(starts[i], starts[i] + lengths[i]) for i in held_seqs]
        held = np.concatenate(ranges)
    else:
        perm = rng.permutation(n)
        held = np.sort(perm[:min(n - 1, max(1, int(round(n * heldout_fraction))))])
        ranges = [held]  # scattered tokens: the window's union is counted over neighbours in this list
    train = np.setdiff1d(np.arange(n), held, assume_unique=True)
    return train, held, ranges


@contextmanager
def few_threads(step_flops: float, device):
    """Tiny problems run faster on one CPU thread (no spin-waiting, no oversubscription)."""
    import torch

    before = torch.get_num_threads()
    if device.type == "cpu" and step_flops < SMALL_STEP_FLOPS:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit(data: LayerData, idx: np.ndarray, rank: int, s: TrainSettings, seed: int):
    """Adam on the class-balanced BCE; returns (A, B, b) torch tensors."""
    with few_threads(6 * s.batch_size * rank * (data.x.shape[1] + data.d_ffn), data.device):
        return _fit(data, idx, rank, s, seed)


def _fit(data: LayerData, idx: np.ndarray, rank: int, s: TrainSettings, seed: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    d, n_ffn = data.x.shape[1], data.d_ffn
    counts = data.active_counts(idx)
    freq = np.clip(counts / len(idx), 1.0 / (len(idx) + 2), 1 - 1.0 / (len(idx) + 2))
    pos_weight = torch.tensor(np.clip((len(idx) - counts) / np.maximum(counts, 1), 1.0 / s.max_pos_weight,
                                      s.max_pos_weight), dtype=torch.float32, device=data.device)
    A = (torch.randn(rank, d, generator=gen) / math.sqrt(d)).to(data.device).requires_grad_()
    B = (torch.randn(n_ffn, rank, generator=gen) / math.sqrt(rank)).to(data.device).requires_grad_()
    b = torch.tensor(np.log(freq / (1 - freq)), dtype=torch.float32, device=data.device).requires_grad_()
    opt = torch.optim.Adam([A, B, b], lr=s.lr)
    steps_per_epoch = max(1, math.ceil(len(idx) / s.batch_size))
    epochs = max(s.epochs, math.ceil(s.min_steps / steps_per_epoch))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / total)))
    for _ in range(epochs):
        order = idx[torch.randperm(len(idx), generator=gen).numpy()]
        for k in range(0, len(order), s.batch_size):
            x, y = data.batch(np.sort(order[k:k + s.batch_size]))
            z = F.linear(F.linear(x, A), B, b)
            loss = F.binary_cross_entropy_with_logits(z, y.float(), pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return A.detach(), B.detach(), b.detach()


def logits(params, x):
    """z = B (A x) + b, computed exactly as the runtime's torch backend does."""
    import torch.nn.functional as F

    A, B, b = params
    return F.linear(F.linear(x, A), B, b)


def heldout_scores(data: LayerData, idx: np.ndarray, params, step: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """Held-out logits float32 [n, d_ffn] and the true mask (bool) of the same tokens."""
    import torch

    zs, ys = [], []
    with torch.no_grad():
        for k in range(0, len(idx), step):
            x, y = data.batch(idx[k:k + step])
            zs.append(logits(params, x).float().cpu().numpy())
            ys.append(y.cpu().numpy().astype(bool))
    return np.concatenate(zs), np.concatenate(ys)


def tune_threshold(z: np.ndarray, y: np.ndarray, recall_target: float) -> dict:
    """The largest logit threshold with recall >= target, and the figures it gives on (z, y)."""
    pos = np.sort(z[y])
    if len(pos) == 0:  # nothing active in these tokens: predict (almost) nothing
        t = float(min(LOGIT_LIMIT, z.max() + 1e-3))
    else:
        miss = int(math.floor((1 - recall_target) * len(pos) + 1e-9))  # positives we may lose
        t = float(pos[0] - 1e-3) if miss == 0 else float((pos[miss - 1] + pos[miss]) / 2)
        t = float(np.clip(t, -LOGIT_LIMIT, LOGIT_LIMIT))
    return {"logit": t, **mask_figures(z > np.float32(t), y)}


def mask_figures(pred: np.ndarray, y: np.ndarray) -> dict:
    """recall, precision, predicted and true fraction of a predicted mask against the true one."""
    tp, n_pred, n_true = int((pred & y).sum()), int(pred.sum()), int(y.sum())
    return {"recall": tp / n_true if n_true else 1.0, "precision": tp / n_pred if n_pred else 1.0,
            "predicted_fraction": n_pred / pred.size, "true_fraction": n_true / y.size}


def window_union_rows(pred: np.ndarray, ranges: list, window: int) -> float:
    """Mean over tokens of |union of the predicted sets of this token and the window-1 before it|
    within its sequence: the cache rows the runtime's sliding window holds. `pred` is [tokens, d_ffn]
    bool in the order of the concatenated `ranges`."""
    total, k = 0, 0
    for r in ranges:
        seq = pred[k:k + len(r)]
        k += len(r)
        union = seq.copy()
        for j in range(1, window):
            union[j:] |= seq[:-j]
        total += int(union.sum())
    return total / max(len(pred), 1)


def _sigmoid(t: float) -> float:
    return 1.0 / (1.0 + math.exp(-t))


def train_layer(x: np.ndarray, packed: np.ndarray, d_ffn: int, s: TrainSettings, layer: int = 0,
                lengths: list[int] | None = None, row_elems: int | None = None) -> LayerResult:
    """Train one layer's predictor, tune its threshold on held-out sequences and pick its rank by
    total cost (unless s.rank). `lengths`: the calibration sequences' token counts (default: one
    sequence); `row_elems`: elements of one cached neuron (default: up row + down column)."""
    import torch

    data = LayerData(x, packed, d_ffn, torch.device(s.device))
    d = x.shape[1]
    row_elems = row_elems or 2 * d
    train_idx, held_idx, ranges = split_tokens(lengths or [len(data)], s.heldout_fraction, s.seed + 7919 * layer)
    cap = min(d, d_ffn)
    ladder = [s.rank] if s.rank is not None else sorted({min(r, cap) for r in s.rank_ladder})
    best, tried = None, []
    for rank in ladder:
        weights = 4 * (rank * (d + d_ffn) + d_ffn)
        if best is not None and weights >= best[0]:
            break  # its weights alone cost more than the best total: larger ranks cannot win
        params = fit(data, train_idx, rank, s, seed=s.seed * 1_000_003 + 7919 * layer + rank)
        z, y = heldout_scores(data, held_idx, params)
        fig = tune_threshold(z, y, s.recall_target)
        union = window_union_rows(z > np.float32(fig["logit"]), ranges, s.window)
        cost = weights + int(4 * row_elems * union)
        ratio = fig["predicted_fraction"] / fig["true_fraction"] if fig["true_fraction"] else float("inf")
        tried.append({"rank": rank, "predicted_over_true": _finite(ratio), "union_rows": round(union, 1),
                      "cost_bytes": cost})
        if best is None or cost < best[0]:
            best = (cost, rank, params, fig, union)
    cost, rank, (A, B, b), fig, union = best
    return LayerResult(rank, _sigmoid(fig["logit"]), fig["recall"], fig["precision"], fig["predicted_fraction"],
                       fig["true_fraction"], A.cpu().numpy().astype(np.float32), B.cpu().numpy().astype(np.float32),
                       b.cpu().numpy().astype(np.float32), tried, len(train_idx), len(held_idx), union, cost)


def predict(result: LayerResult, x) -> np.ndarray:
    """The trained predictor's decision for FFN inputs x (torch [tokens, d_model]): bool numpy mask."""
    import torch

    t = result.threshold
    params = tuple(torch.from_numpy(a).to(dtype=x.dtype, device=x.device) for a in (result.A, result.B, result.b))
    with torch.no_grad():
        return (logits(params, x) > math.log(t / (1 - t))).cpu().numpy()


# -- the whole model ---------------------------------------------------------------------------
def check_writable(model_dir: str | Path) -> None:
    """The predictors are written into the model directory: make sure that can work before any work."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FlashLLMError(f"model directory {root}: does not exist or is not a directory")
    probe = root / f".flashllm-write-test-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise FlashLLMError(f"model directory {root}: not writable ({exc.strerror or exc}); the predictors are "
                            f"written into it: copy the model somewhere writable or fix its permissions") from None


def check_disk(workdir: str | Path | None, spec, chunks: list[list[int]]) -> int:
    """The temporary shards' size bound (bytes); FlashLLMError with the numbers if `workdir` cannot hold it."""
    where = Path(workdir or tempfile.gettempdir())
    if not where.is_dir():
        raise FlashLLMError(f"--workdir {where}: does not exist or is not a directory")
    need = col.shard_bytes_bound(spec.n_layers, spec.d_model, spec.d_ffn, sum(map(len, chunks)), len(chunks))
    free = shutil.disk_usage(where).free
    if need > free:
        raise FlashLLMError(f"{where}: {free / GiB:.2f} GiB free, but the calibration shards of "
                            f"{sum(map(len, chunks)):,} tokens need up to {need / GiB:.2f} GiB ({spec.n_layers} "
                            f"layers x (x float16 + mask bits) per token, before compression); pass --workdir on a "
                            f"larger disk or lower --max-tokens")
    return need


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_predictors(model_dir: str | Path, results: list[LayerResult], freqs: list[np.ndarray], meta: dict) -> Path:
    """predictors.safetensors (A, B, b and activation frequencies per layer), then predictors.json;
    each written to a temporary file in the directory and renamed into place, the JSON last."""
    from safetensors.numpy import save_file

    root = Path(model_dir)
    tensors = {}
    for i, (r, f) in enumerate(zip(results, freqs)):
        tensors.update({f"layers.{i}.A": r.A, f"layers.{i}.B": r.B, f"layers.{i}.b": r.b, f"layers.{i}.freq": f})
    st_path, meta_path = root / PREDICTOR_FILE, root / PREDICTOR_META
    st_tmp, meta_tmp = root / f".{PREDICTOR_FILE}.tmp-{os.getpid()}", root / f".{PREDICTOR_META}.tmp-{os.getpid()}"
    try:
        # one metadata key: safetensors writes a metadata map in hash order, which would vary the bytes
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(st_tmp),
                  metadata={"format": f"{PREDICTOR_FORMAT}/{PREDICTOR_VERSION}"})
        meta = {"format": PREDICTOR_FORMAT, "format_version": PREDICTOR_VERSION, "sha256": sha256_of(st_tmp),
                **meta, "layers": [r.info() for r in results]}
        meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(st_tmp, stat.S_IMODE(meta_tmp.stat().st_mode))  # safetensors creates files 0600
        os.replace(st_tmp, st_path)
        os.replace(meta_tmp, meta_path)
    finally:
        for p in (st_tmp, meta_tmp):
            p.unlink(missing_ok=True)
    return meta_path


def train_predictors(model_dir: str | Path, data: str | Path, settings: TrainSettings = TrainSettings(),
                     max_tokens: int | None = DEFAULT_MAX_TOKENS, seq_len: int | None = None,
                     target: Target | None = None, low_memory: bool = False, dtype: str | None = None,
                     workdir: str | Path | None = None, progress: bool | None = None, log=None) -> dict:
    """Collect calibration data over `data`, train every layer's predictor, write them into
    `model_dir`; for a dense activation, first calibrate per-layer thresholds for `target` (a
    calibrate.Target) and write them too (sparsity.json). Returns the metadata written to predictors.json."""
    from flashllm.progress import progress_bar

    settings.check()
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    check_writable(model_dir)
    text = col.read_data(data, max_tokens)
    model = col.open_model(model_dir, device=settings.device, dtype=dtype, low_memory=low_memory, seq_len=seq_len)
    spec, root = model.spec, model.manifest.root
    files = model.manifest.data["files"]
    model_id = {"family": spec.family, "n_layers": spec.n_layers, "d_model": spec.d_model, "d_ffn": spec.d_ffn,
                "activation": spec.activation, "dtype": model.manifest.data["dtype"],
                "sha256": {k: files[k]["sha256"] for k in ("resident", "ffn") if k in files}}
    if target is not None:
        target.check(spec.activation)
    else:
        col.activation_rule(spec)  # a dense activation without a target: the error says what to pass
    row_elems = (3 if spec.gated_ffn else 2) * spec.d_model
    chunks = col.chunk_text(model, text, seq_len, max_tokens, str(data))
    del text
    workdir = workdir or col.workdir_default()
    need = check_disk(workdir, spec, chunks)
    sparsity = None
    if target is not None:
        log(f"calibrating per-layer thresholds on |{spec.activation}(pre)| ({target.method} {target.value:g})")
        sparsity = calibrate(model, chunks, target, log)
        sparsity["data"] = {"file": str(data), "sha256": sha256_of(Path(data))}
    rule = col.activation_rule(spec, sparsity and [layer["threshold"] for layer in sparsity["layers"]])
    log(f"temporary shards: at most {need / 2**20:.1f} MiB in {workdir or tempfile.gettempdir()}")
    log(f"collecting {sum(map(len, chunks))} tokens in {len(chunks)} sequences over {spec.n_layers} layers "
        f"({'naive, one layer resident' if low_memory else 'dense'}); active iff {rule.describe(spec.activation)}")
    cal = col.collect(model, chunks, rule, workdir, progress)
    del model
    gc.collect()
    try:
        t1 = time.perf_counter()
        log(f"collected in {t1 - t0:.1f} s; shards {cal.disk_bytes() / 2**20:.1f} MiB on disk; training "
            f"{'rank ' + str(settings.rank) if settings.rank else 'ranks from ' + str(list(settings.rank_ladder))}")
        results, freqs = [], []
        bar = progress_bar(progress, iterable=range(spec.n_layers), desc="train", unit="layer", leave=False)
        for layer in bar:
            x, packed = cal.load(layer)
            r = train_layer(x, packed, spec.d_ffn, settings, layer, cal.lengths, row_elems)
            del x, packed
            results.append(r)
            freqs.append(cal.frequencies(layer))
            bar.set_postfix(rank=r.rank, recall=f"{r.recall:.3f}", ratio=f"{r.predicted_over_true:.2f}")
            log(f"layer {layer}: rank {r.rank}, recall {r.recall:.3f}, precision {r.precision:.3f}, "
                f"predicted {r.predicted_fraction:.3f} vs true {r.true_fraction:.3f}")
        data_path = Path(data)
        meta = {
            "created_by": "flashllm predictors train",
            "model": model_id,  # which conversion these were trained against
            "recall_target": settings.recall_target,
            "window": settings.window,
            "rank_ladder": None if settings.rank else list(settings.rank_ladder),
            "forced_rank": settings.rank,
            "seed": settings.seed,
            "training": {"loss": "BCE, positives weighted by n_inactive/n_active per neuron (capped)",
                         "max_pos_weight": settings.max_pos_weight, "optimizer": "Adam, cosine decay to 0.1x",
                         "epochs": settings.epochs, "batch_size": settings.batch_size, "lr": settings.lr,
                         "heldout_fraction": settings.heldout_fraction,
                         "threshold": "largest reaching recall_target on the held-out sequences",
                         "rank": "lowest cost_bytes: predictor weights + rows of the window's union (float32)"},
            "data": {"file": str(data_path), "bytes": data_path.stat().st_size,
                     "sha256": sha256_of(data_path), "max_tokens": max_tokens},
            "calibration": {"tokens": cal.tokens, "sequences": cal.chunks, "seq_len": cal.seq_len,
                            "collect_mode": "naive" if low_memory else "dense", "shard_bytes": cal.disk_bytes()},
            "activation_rule": rule.to_dict(spec.activation),
            **({"sparsity": {"file": SPARSITY_FILE, "method": sparsity["method"], "target": sparsity["target"],
                             "mean_sparsity": float(np.mean([la["sparsity"] for la in sparsity["layers"]])),
                             "mean_ffn_error": float(np.mean([la["ffn_error"] for la in sparsity["layers"]]))}}
               if sparsity else {}),
            "activation_freq": {"file": PREDICTOR_FILE, "tensor": "layers.{i}.freq", "tokens": cal.tokens,
                                "meaning": "fraction of calibration tokens on which each neuron is active"},
            "summary": summary(results),
            "train_seconds": round(time.perf_counter() - t1, 2),
            "collect_seconds": round(t1 - t0, 2),
        }
    finally:
        cal.cleanup()
    if sparsity:  # first: the predictors' check names what they were trained for
        write_sparsity(root, sparsity)
    write_predictors(root, results, freqs, meta)
    return json.loads((root / PREDICTOR_META).read_text())


def summary(results: list[LayerResult]) -> dict:
    ratios = [r.predicted_over_true for r in results if math.isfinite(r.predicted_over_true)]
    return {"recall": float(np.mean([r.recall for r in results])),
            "precision": float(np.mean([r.precision for r in results])),
            "predicted_over_true": float(np.mean(ratios)) if ratios else None,
            "predicted_fraction": float(np.mean([r.predicted_fraction for r in results])),
            "true_fraction": float(np.mean([r.true_fraction for r in results])),
            "ranks": [r.rank for r in results]}


# -- the memory a large model needs ------------------------------------------------------------
def memory_estimate(n_layers: int = 32, d_model: int = 4096, d_ffn: int = 11008, tokens: int = 100_000,
                    rank: int = 256, batch: int = 512, heldout_fraction: float = 0.1,
                    layer_weight_bytes: int | None = None, context: int = 256) -> dict:
    """Peak RAM (bytes) of training one layer, and what collection holds, for a model of this shape.

    Training holds one layer's shard (x float16 + packed mask bits; twice while it is read), the
    predictor being trained and the best one so far, Adam state, one batch (x float32, unpacked
    mask, logits and their gradients) and the held-out logits and masks used to tune the threshold. Collection with low_memory holds one layer's weights (float32
    compute), the read buffers, a KV cache and one sequence's activations, never the shards.
    """
    held = int(tokens * heldout_fraction)
    shard = tokens * d_model * 2 + tokens * ((d_ffn + 7) // 8)
    params = (rank * d_model + d_ffn * rank + d_ffn) * 4
    adam = 3 * params  # grads + two moments
    batch_bytes = batch * d_model * 4 + batch * d_ffn * (1 + 4 * 4)  # x, y, z, dz, sigmoid, loss terms
    threshold = held * d_ffn * (4 + 1 + 1 + 1 + 2)  # logits, mask, prediction, tp, positives' logits (~50%)
    # reading the shard briefly holds its records and their concatenation; then training works on it
    # +25% for temporaries and the allocator: measured 2.18 GiB over the process baseline for this
    # 7B layer shape at 100k tokens, rank 256 (synthetic shard), against 1.98 GiB counted here
    train_peak = int(1.25 * (shard + max(shard, 2 * params + adam + batch_bytes + threshold)))
    if layer_weight_bytes is None:  # attention (4 d^2) + FFN (3 d d_ffn for gated) in float32
        layer_weight_bytes = (4 * d_model * d_model + 3 * d_model * d_ffn) * 4
    kv = 2 * n_layers * context * d_model * 4
    collect_peak = 2 * layer_weight_bytes + kv + context * (d_model * 4 * 4 + d_ffn * 4 * 3)
    return {"tokens": tokens, "shard_bytes_per_layer": shard, "shards_on_disk_uncompressed": shard * n_layers,
            "train_peak_bytes": train_peak, "collect_low_memory_peak_bytes_excl_embeddings": collect_peak}


def describe_estimate(e: dict | None = None) -> str:
    e = e or memory_estimate()
    return (f"7B-class estimate (32 layers, d_model 4096, FFN 11008, {e['tokens']:,} calibration tokens, rank 256): "
            f"one layer's shard {e['shard_bytes_per_layer'] / GiB:.2f} GiB in RAM (x float16 + mask bits), training "
            f"peak {e['train_peak_bytes'] / GiB:.2f} GiB; --low-memory collection holds about "
            f"{e['collect_low_memory_peak_bytes_excl_embeddings'] / GiB:.2f} GiB plus embeddings/head "
            f"(~1 GiB float32); shards on disk at most {e['shards_on_disk_uncompressed'] / GiB:.0f} GiB before "
            f"zstd; so it fits a 24 GiB machine.")
