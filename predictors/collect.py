"""Calibration data: run the model densely over text and record, per layer, the FFN input x and the
true activation mask, spilled to per-layer zstandard shards on disk.

One dense pass collects every layer. The FFN input is exactly what `Model.mode_impl.ffn(layer, x, cost)`
receives (after attention and the FFN norm), so predictors see at inference what they trained on.
A shard holds, per calibration chunk, x as float16 and the mask as packed bits (np.packbits along
the neuron axis); only one chunk's activations are ever in RAM during collection, and training
later loads one layer's shard at a time.

Which neurons count as active:
- relu / relu2 / fatrelu models: the runtime's own rule, `flashllm.modes.sparse.predictor.activation_threshold`:
  pre-activation (gate for gated FFNs, up otherwise, bias included) > threshold (0 for relu);
- dense activations (silu, gelu) with per-layer thresholds t_l (calibrate.py: `--sparsity S`,
  `--ffn-error E` or `--activation-threshold T`): |act(pre)| > t_l, act being the model's
  activation on the same pre-activation (for gated FFNs the gate's activation, not the product
  with up; the CATS rule), exactly what sparse mode applies. Without thresholds such models refuse
  to train: every neuron is non-zero there, so there is no active set to predict.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.modes.sparse.predictor import activation_threshold
from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE

DEFAULT_SEQ_LEN = 256
MIN_TOKENS = 16  # fewer calibration tokens cannot be split into train and held-out parts
_RECORD = struct.Struct("<QQQ")  # tokens, compressed x bytes, compressed mask bytes
_FP16_MAX = 65504.0


# -- the calibration text ----------------------------------------------------------------------
def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    """The UTF-8 text of a data file; FlashLLMError when missing, unreadable, not text or empty."""
    p = Path(path)
    if not p.exists():
        raise FlashLLMError(f"data file {p}: does not exist")
    if not p.is_file():
        raise FlashLLMError(f"data file {p}: not a regular file")
    try:
        with open(p, "rb") as f:
            raw = f.read() if max_bytes is None else f.read(max_bytes)
    except OSError as exc:
        raise FlashLLMError(f"data file {p}: unreadable ({exc.strerror or exc})") from None
    if b"\x00" in raw[:65536]:
        raise FlashLLMError(f"data file {p}: binary data (NUL bytes); expected UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if max_bytes is not None and exc.start >= len(raw) - 4:  # a character cut by max_bytes
            text = raw[:exc.start].decode("utf-8", errors="strict")
        else:
            raise FlashLLMError(f"data file {p}: not UTF-8 text (bad byte at offset {exc.start})") from None
    if not text.strip():
        raise FlashLLMError(f"data file {p}: empty (no text to calibrate on)")
    return text


def token_chunks(tokenizer, text: str, seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """The text as sequences of at most `seq_len` ids, each starting with the tokenizer's prefix
    (e.g. BOS) as a prompt would; at most `max_tokens` ids in all."""
    if seq_len < 2:
        raise FlashLLMError(f"sequence length {seq_len}: must be at least 2")
    prefix = tokenizer.encode("")
    ids = tokenizer.encode(text)
    body = ids[len(prefix):] if ids[:len(prefix)] == prefix else ids
    step = seq_len - len(prefix)
    if step < 1:
        raise FlashLLMError(f"sequence length {seq_len}: too short for the tokenizer's prefix {prefix}")
    chunks, total = [], 0
    for k in range(0, len(body), step):
        chunk = prefix + body[k:k + step]
        if max_tokens is not None and total + len(chunk) > max_tokens:
            chunk = chunk[:max_tokens - total]
            if len(chunk) <= len(prefix):
                break
        chunks.append(chunk)
        total += len(chunk)
        if max_tokens is not None and total >= max_tokens:
            break
    return chunks


def read_data(data: str | Path, max_tokens: int | None) -> str:
    """The data file's text, checked before any model is loaded (at most what max_tokens can use)."""
    if max_tokens is not None and max_tokens < MIN_TOKENS:
        raise FlashLLMError(f"--max-tokens {max_tokens}: need at least {MIN_TOKENS}")
    # ~16 bytes per token is far more than any tokenizer needs: no need to tokenize a huge file whole
    return read_text(data, None if max_tokens is None else max(4096, 16 * max_tokens))


def sequence_length(seq_len: int | None) -> int:
    """`seq_len` (--seq-len), or the default for None; at least 2 (a token and the one it predicts)."""
    seq_len = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if seq_len < 2:
        raise FlashLLMError(f"--seq-len {seq_len}: must be at least 2")
    return seq_len


def chunk_text(model, text: str, seq_len: int | None, max_tokens: int | None, name: str = "data") -> list[list[int]]:
    """Tokenize and chunk text for `model` (sequences fit its KV cache); checks enough tokens came out."""
    seq_len = min(sequence_length(seq_len), model.context)
    chunks = token_chunks(model.tokenizer, text, seq_len, max_tokens)
    n = sum(map(len, chunks))
    if n < MIN_TOKENS:
        raise FlashLLMError(f"data file {name}: only {n} tokens; need at least {MIN_TOKENS}")
    return chunks


def tokens_of(model, data: str | Path, seq_len: int | None, max_tokens: int | None) -> list[list[int]]:
    """Read, tokenize and chunk a data file for `model`."""
    return chunk_text(model, read_data(data, max_tokens), seq_len, max_tokens, str(data))


# -- which neurons are active ------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationRule:
    """Active iff pre > threshold (the model's own sparse activation), or |act(pre)| > the layer's
    calibrated threshold (a dense activation made sparse; see calibrate.py)."""

    kind: str  # "pre" or "abs_act"
    threshold: float | tuple[float, ...]  # one for every layer, or per layer
    part: str  # "gate" or "up": whose pre-activation decides

    def at(self, layer: int) -> float:
        return self.threshold[layer] if isinstance(self.threshold, tuple) else self.threshold

    def describe(self, activation: str) -> str:
        pre = f"{self.part} pre-activation (bias included)"
        if self.kind == "pre":
            return f"{pre} > {self.threshold:g} ({activation})"
        if isinstance(self.threshold, tuple):
            return f"|{activation}({pre})| > the layer's calibrated threshold ({SPARSITY_FILE})"
        return f"|{activation}({pre})| > {self.threshold:g}"

    def to_dict(self, activation: str) -> dict:
        per_layer = isinstance(self.threshold, tuple)
        return {"kind": self.kind, "threshold": None if per_layer else self.threshold, "part": self.part,
                "activation": activation, "rule": self.describe(activation),
                **({"thresholds": list(self.threshold)} if per_layer else {})}

    @classmethod
    def from_dict(cls, saved: dict) -> "ActivationRule":
        threshold = tuple(saved["thresholds"]) if saved.get("thresholds") is not None else float(saved["threshold"])
        return cls(saved["kind"], threshold, saved["part"])


def activation_rule(spec, thresholds: list[float] | None = None) -> ActivationRule:
    """The rule for this model; dense activations need calibrated thresholds (else FlashLLMError)."""
    part = "gate" if spec.gated_ffn else "up"
    if thresholds is not None:
        return ActivationRule("abs_act", tuple(float(t) for t in thresholds), part)
    native = activation_threshold(spec)
    if native is None:
        raise FlashLLMError(
            f"activation {spec.activation!r} is dense (every FFN neuron is non-zero), so there is no active "
            f"set to predict; pass --sparsity S (e.g. 0.4) to calibrate per-layer thresholds on "
            f"|{spec.activation}(pre)| that skip that share of the FFN (or --ffn-error E, or "
            f"--activation-threshold T), or use a ReLU-family model")
    return ActivationRule("pre", float(native), part)


# -- shards ------------------------------------------------------------------------------------
class ShardWriter:
    """Appends (x float16, packed mask) records of one layer to a file, each part one zstd frame."""

    def __init__(self, path: Path, level: int = 3):
        import zstandard

        self.path = path
        self.f = open(path, "wb")
        self.zc = zstandard.ZstdCompressor(level=level)
        self.tokens = 0

    def append(self, x: np.ndarray, mask: np.ndarray) -> None:
        xb = self.zc.compress(np.ascontiguousarray(np.clip(x, -_FP16_MAX, _FP16_MAX), dtype=np.float16).tobytes())
        mb = self.zc.compress(np.packbits(mask, axis=1).tobytes())
        self.f.write(_RECORD.pack(x.shape[0], len(xb), len(mb)))
        self.f.write(xb)
        self.f.write(mb)
        self.tokens += x.shape[0]

    def close(self) -> None:
        self.f.close()


def read_shard(path: Path, d_model: int, d_ffn: int) -> tuple[np.ndarray, np.ndarray]:
    """A whole layer shard: x float16 [tokens, d_model] and packed mask uint8 [tokens, ceil(d_ffn/8)]."""
    import zstandard

    zd = zstandard.ZstdDecompressor()
    row_bytes = (d_ffn + 7) // 8
    xs, ms = [], []
    with open(path, "rb") as f:
        while head := f.read(_RECORD.size):
            n, lx, lm = _RECORD.unpack(head)
            xs.append(np.frombuffer(zd.decompress(f.read(lx)), dtype=np.float16).reshape(n, d_model))
            ms.append(np.frombuffer(zd.decompress(f.read(lm)), dtype=np.uint8).reshape(n, row_bytes))
    if not xs:
        return np.zeros((0, d_model), np.float16), np.zeros((0, row_bytes), np.uint8)
    return np.concatenate(xs), np.concatenate(ms)


def shard_bytes_bound(n_layers: int, d_model: int, d_ffn: int, tokens: int, sequences: int) -> int:
    """Bytes the shards of a collection take at most: every record uncompressed (zstd only shrinks them,
    bar a few bytes of frame header)."""
    frames = 2 * 64  # two zstd frames per record: header and block overhead, generously
    return n_layers * (tokens * (2 * d_model + (d_ffn + 7) // 8) + sequences * (_RECORD.size + frames))


def unpack_mask(packed: np.ndarray, d_ffn: int) -> np.ndarray:
    return np.unpackbits(packed, axis=1, count=d_ffn).astype(bool)


@dataclass
class Calibration:
    """What a collection pass produced: one shard per layer plus per-neuron activation counts."""

    root: Path  # the temporary directory holding the shards
    n_layers: int
    d_model: int
    d_ffn: int
    tokens: int
    chunks: int
    seq_len: int
    rule: ActivationRule
    active_counts: list[np.ndarray] = field(default_factory=list)  # per layer, int64 [d_ffn]
    lengths: list[int] = field(default_factory=list)  # tokens of each sequence, in shard order

    def shard(self, layer: int) -> Path:
        return self.root / f"layer{layer:04d}.shard"

    def load(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return read_shard(self.shard(layer), self.d_model, self.d_ffn)

    def frequencies(self, layer: int) -> np.ndarray:
        return (self.active_counts[layer] / max(self.tokens, 1)).astype(np.float32)

    def disk_bytes(self) -> int:
        return sum(self.shard(i).stat().st_size for i in range(self.n_layers))

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# -- the pass ----------------------------------------------------------------------------------
def _rule_rows(model, layer: int, part: str):
    """The rows the activation rule looks at (gate rows of a gated FFN, else up rows) as backend
    tensors: resident in dense mode, else read."""
    rows = getattr(model.mode_impl, "rows", None)
    if rows is not None:
        return model.backend.ffn_part(rows[layer], part)
    ctx = model.mode_context
    return ctx.bundle_rows(ctx.read_layer_block(layer), parts=(part,))[part]


def recording(model, rule: ActivationRule, sink):
    """A context in which each layer's FFN input first goes to `sink(layer, x, true mask)` (a hook).

    x is the backend tensor the plan receives; the mask is a bool numpy array [tokens, d_ffn].
    """
    backend = model.backend

    def observe(layer: int, x):
        pre = backend.linear(x, _rule_rows(model, layer, rule.part), backend.ffn_biases(layer)[rule.part])
        values = backend.to_host(pre if rule.kind == "pre" else backend.act(pre))
        sink(layer, x, (values if rule.kind == "pre" else np.abs(values)) > rule.at(layer))

    return model.hooks.observing("ffn_input", observe)


def collect(model, chunks: list[list[int]], rule: ActivationRule, workdir: str | Path | None = None,
            progress: bool | None = None) -> Calibration:
    """Prefill every chunk densely (from position 0), writing each layer's (x, mask) to its shard."""
    from flashllm.progress import progress_bar

    s = model.spec
    root = Path(tempfile.mkdtemp(prefix="flashllm-calib-", dir=workdir))
    cal = Calibration(root, s.n_layers, s.d_model, s.d_ffn, 0, len(chunks), max(map(len, chunks)), rule,
                      [np.zeros(s.d_ffn, np.int64) for _ in range(s.n_layers)])
    writers = [ShardWriter(cal.shard(i)) for i in range(s.n_layers)]

    def sink(layer, x, mask):
        writers[layer].append(model.backend.to_host(x), mask)
        cal.active_counts[layer] += mask.sum(axis=0)

    try:
        with recording(model, rule, sink), \
                progress_bar(progress, total=sum(map(len, chunks)), unit="tok", desc="collect", leave=False) as bar:
            for chunk in chunks:
                model.mode_impl.reset()
                model.forward(chunk, 0)
                cal.tokens += len(chunk)
                cal.lengths.append(len(chunk))
                bar.update(len(chunk))
    except BaseException:
        cal.cleanup()
        raise
    finally:
        for w in writers:
            w.close()
    return cal


def open_model(model_dir: str | Path, device: str = "cpu", dtype: str | None = None, low_memory: bool = False,
               seq_len: int | None = None, threads: int = 4):
    """The model for a calibration pass, its KV cache sized for one sequence: dense (all weights
    resident) or, with `low_memory`, naive (each layer's weights read from flash when needed; the
    mask rows are read once more per layer)."""
    import flashllm

    context = sequence_length(seq_len)
    if low_memory:
        return flashllm.load(model_dir, device=device, mode="naive", dtype=dtype, threads=threads, context=context)
    return flashllm.load(model_dir, device=device, mode="dense", dtype=dtype, context=context)


def workdir_default() -> str | None:
    """Where shards go: $FLASHLLM_TMPDIR, else the system temporary directory."""
    return os.environ.get("FLASHLLM_TMPDIR") or None
