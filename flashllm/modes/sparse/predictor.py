"""Active-neuron predictors: which FFN neurons a token needs, from the FFN input of that layer.

`lowrank` reads the trained predictors (written by `flashllm predictors train`) from the model
directory; `oracle` computes the true activation from the real weights (tests, upper bound);
`gate` uses a gated model's own gate projection, kept resident. For a dense activation (SiLU,
GELU) "active" means above the calibrated thresholds of sparsity.json (flashllm/modes/sparse/activation_sparsity.py).
"""

from __future__ import annotations

import json

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.options import PREDICTORS as NAMES_WITH_AUTO
from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE
from flashllm.format.safetensors_io import SafetensorsFile

PREDICTOR_FILE = "predictors.safetensors"
PREDICTOR_META = "predictors.json"
PREDICTOR_FORMAT = "flashllm-predictors"
PREDICTOR_VERSION = 1
SPARSE_ACTIVATIONS = ("relu", "relu2", "fatrelu")


def activation_threshold(spec) -> float | None:
    """Activation is non-zero iff the pre-activation (gate for gated FFNs) exceeds this; None: always."""
    if spec.activation == "fatrelu":
        return spec.activation_threshold
    return 0.0 if spec.activation in ("relu", "relu2") else None


def neuron_thresholds(ctx) -> tuple[list[float] | None, bool]:
    """(per-layer threshold, magnitude): a neuron is active iff pre > threshold (magnitude False: the
    model's own sparse activation) or |act(pre)| > threshold (magnitude True: calibrated thresholds of
    a dense activation); (None, False) for a dense activation without them: every neuron is active."""
    native = activation_threshold(ctx.spec)
    if native is not None:
        return [native] * ctx.spec.n_layers, False
    if ctx.sparsity is not None:
        return list(ctx.sparsity.thresholds), True
    return None, False


class OraclePredictor:
    """The true active set, from the real up (or gate) rows kept in memory for this purpose only."""

    kind = "oracle"

    def __init__(self, ctx):
        self.spec, self.backend = ctx.spec, ctx.backend
        self.threshold, self.magnitude = neuron_thresholds(ctx)
        part = "gate" if self.spec.gated_ffn else "up"
        self.rows, self.bias = [], []
        for layer in range(self.spec.n_layers):
            block = ctx.read_layer_block(layer)
            self.rows.append(ctx.bundle_rows(block, parts=(part,))[part])
            self.bias.append(ctx.biases(layer)[part])

    @property
    def selective(self) -> bool:
        """False for a dense activation (SiLU, GELU): every neuron is active, nothing to select."""
        return self.threshold is not None

    def pre(self, layer: int, x):
        """The pre-activations of the up (or gate) rows [tokens, d_ffn], a backend tensor."""
        return self.backend.linear(x, self.rows[layer], self.bias[layer])

    def scores(self, layer: int, x, pre=None) -> np.ndarray | None:
        """Pre-activation (|act(pre)| with calibrated thresholds) minus the layer's threshold [tokens,
        d_ffn] (> 0: active; its size ranks neurons by activation); None for a dense activation.
        `pre`: `self.pre(layer, x)` when the caller has it already."""
        if self.threshold is None:
            return None
        pre = self.pre(layer, x) if pre is None else pre
        if self.magnitude:
            return np.abs(self.backend.to_host(self.backend.act(pre))) - self.threshold[layer]
        return self.backend.to_host(pre) - self.threshold[layer]

    def predict(self, layer: int, x) -> np.ndarray:
        """Boolean mask [tokens, d_ffn] of neurons whose activation is non-zero."""
        if self.threshold is None:
            return np.ones((x.shape[0], self.spec.d_ffn), dtype=bool)
        return self.scores(layer, x) > 0

    def nbytes(self) -> int:
        return 0  # a test instrument: not counted against the DRAM budget

    def expected_fraction(self) -> list[float] | None:
        """Per layer, the fraction of neurons expected active per token (None: unknown)."""
        return None


class GatePredictor(OraclePredictor):
    """Gated FFNs: the gate projection itself, kept resident, decides (paper App. C.5) — for ReLU
    gates, or SiLU/GELU gates with calibrated thresholds.

    Exact like the oracle, but its gate rows are counted against the DRAM budget; sparse mode then
    reads and caches only the up and down rows of each neuron, and reuses the gate pre-activations
    the prediction computed (`resident_part`).
    """

    kind = "gate"
    resident_part = "gate"

    def __init__(self, ctx):
        if not ctx.spec.gated_ffn or neuron_thresholds(ctx)[0] is None:
            raise FlashLLMError(f"predictor 'gate' needs a gated FFN with a sparse activation (relu, fatrelu) or "
                                f"calibrated thresholds (flashllm predictors train --sparsity S); this model has "
                                f"{'a gated' if ctx.spec.gated_ffn else 'an ungated'} {ctx.spec.activation} FFN")
        super().__init__(ctx)

    def nbytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for t in self.rows)


def verify_predictor_files(manifest) -> dict:
    """The trained predictors' metadata, once their files are there, readable, for this model's layers and
    weights, and the weights file matches its sha256 (at load, and in `flashllm inspect --verify`)."""
    root = manifest.root
    meta_path, st_path = root / PREDICTOR_META, root / PREDICTOR_FILE
    if not meta_path.is_file() or not st_path.is_file():
        missing = meta_path if not meta_path.is_file() else st_path
        raise FlashLLMError(f"{missing}: missing (no trained predictors); train them with `flashllm predictors "
                            f"train {root} --data TEXT`, or pass --predictor oracle")
    try:
        meta = json.loads(meta_path.read_text())
        layers = meta["layers"]
        ok = meta.get("format") == PREDICTOR_FORMAT and meta.get("format_version") == PREDICTOR_VERSION
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlashLLMError(f"{meta_path}: unreadable predictor metadata ({exc})") from None
    if not ok or len(layers) != manifest.spec.n_layers:
        raise FlashLLMError(f"{meta_path}: not predictors for this model (format/version or layer count)")
    trained_for = (meta.get("model") or {}).get("sha256", {}).get("ffn")
    if trained_for and trained_for != manifest.data["files"]["ffn"]["sha256"]:
        raise FlashLLMError(f"{meta_path}: these predictors were trained for different weights "
                            f"(ffn.bin sha256 {trained_for[:12]}...); train them again for this model")
    if meta.get("sha256") and fmt.sha256_file(st_path) != meta["sha256"]:
        raise FlashLLMError(f"{st_path}: checksum mismatch (train the predictors again)")
    return meta


class LowRankPredictor:
    """sigmoid(B (A x) + b) > threshold per layer, with weights and thresholds from the model dir."""

    kind = "lowrank"

    def __init__(self, ctx):
        root, spec, self.backend = ctx.manifest.root, ctx.spec, ctx.backend
        meta_path, st_path = root / PREDICTOR_META, root / PREDICTOR_FILE
        meta = verify_predictor_files(ctx.manifest)
        layers = meta["layers"]
        trained = (meta.get("activation_rule") or {}).get("thresholds")
        have = None if ctx.sparsity is None else list(ctx.sparsity.thresholds)
        if (trained is not None or have is not None) and (trained is None or have is None or trained != have):
            raise FlashLLMError(f"{meta_path}: these predictors were trained for {'other' if trained else 'no'} "
                                f"calibrated thresholds than {SPARSITY_FILE} holds{'' if have else ' (missing)'}; "
                                f"train them again (`flashllm predictors train {root} --data TEXT --sparsity S`)")
        st = SafetensorsFile(st_path)
        backend = self.backend
        self.proj_in, self.proj_out, self.bias, self.threshold = [], [], [], []  # A, B, b of each layer
        for i, info in enumerate(layers):
            r = int(info["rank"])
            for name, shape in ((f"layers.{i}.A", (r, spec.d_model)), (f"layers.{i}.B", (spec.d_ffn, r)),
                                (f"layers.{i}.b", (spec.d_ffn,))):
                if name not in st.entries or st.shape(name) != shape:
                    raise FlashLLMError(f"{st_path}: tensor {name!r} is missing or not of shape {shape}")
            self.proj_in.append(backend.read_tensor(st, f"layers.{i}.A"))
            self.proj_out.append(backend.read_tensor(st, f"layers.{i}.B"))
            self.bias.append(backend.read_tensor(st, f"layers.{i}.b"))
            # sigmoid(z) > t  <=>  z > logit(t): compare logits, skip the sigmoid
            t = float(info["threshold"])
            self.threshold.append(float(np.log(t / (1 - t))))
        self.meta = meta

    def expected_fraction(self) -> list[float] | None:
        """The predicted-active fraction measured per layer at training (sizes the caches)."""
        fractions = [layer.get("predicted_fraction") for layer in self.meta["layers"]]
        return fractions if all(isinstance(f, (int, float)) and f > 0 for f in fractions) else None

    def scores(self, layer: int, x) -> np.ndarray:
        """The predictor's logit minus its threshold's logit [tokens, d_ffn] (> 0: predicted active)."""
        return self.backend.low_rank(x, self.proj_in[layer], self.proj_out[layer], self.bias[layer]) - self.threshold[layer]

    def predict(self, layer: int, x) -> np.ndarray:
        return self.scores(layer, x) > 0

    def nbytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for ts in (self.proj_in, self.proj_out, self.bias) for t in ts)


def predict_scored(predictor, layer: int, x, pre=None) -> tuple[np.ndarray, np.ndarray | None]:
    """(mask, scores) of a predictor: scores rank the predicted neurons (higher: keep first) when a
    cache cannot hold them all; None when the predictor has none (e.g. a replayed trace). `pre`: the
    gate predictor's pre-activations, when the caller computed them."""
    if pre is not None:
        scores = predictor.scores(layer, x, pre)
    else:
        scores = predictor.scores(layer, x) if hasattr(predictor, "scores") else None
    return (predictor.predict(layer, x), None) if scores is None else (scores > 0, scores)


def union(mask: np.ndarray, scores: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The neurons predicted for any of the tokens of a decode step ([tokens, n] -> [n]) and, to rank
    them, each one's highest score (one token: its own mask and scores, as views)."""
    if len(mask) == 1:
        return mask[0], None if scores is None else scores[0]
    return mask.any(axis=0), None if scores is None else scores.max(axis=0)


def auto_predictor(ctx) -> str:
    """`auto`: for a gated FFN made sparse by calibrated thresholds (SiLU/GELU), the resident gate rows
    (exact, and a neuron read is 2/3 of a bundle) whenever the budget holds them and a cache row per
    layer: measured better than the low-rank predictors at every budget, even where it leaves half the
    cache rows (docs/sparsity.md); else, and for every other model, lowrank."""
    spec = ctx.spec
    if not spec.gated_ffn or ctx.sparsity is None:
        return "lowrank"
    if ctx.budget is None or not (ctx.manifest.root / PREDICTOR_META).is_file():
        return "gate"
    B = ctx.backend
    avail = ctx.budget - ctx.charged(B.staging_bytes(ctx.layout.stride), B.nbytes())  # left for predictor and caches
    gate_bytes = spec.n_layers * spec.d_ffn * spec.d_model * B.itemsize
    fits = avail - gate_bytes >= spec.n_layers * ctx.row_bytes(ctx.layout.only(("up", "down")))
    return "gate" if fits else "lowrank"


# Every predictor, by the name the API and the CLI use; "auto" picks one of them per model and budget.
PREDICTORS = {"lowrank": LowRankPredictor, "oracle": OraclePredictor, "gate": GatePredictor}


def make_predictor(kind, ctx):
    """A predictor by name, or built by `kind(ctx)` when kind is a callable (benchmarks' traces); `ctx`
    is the mode's ModeContext (spec, backend, manifest, read_layer_block, bundle_rows, biases)."""
    if kind == "auto":
        kind = auto_predictor(ctx)
    if callable(kind):
        return kind(ctx)
    if kind not in PREDICTORS:
        raise FlashLLMError(f"predictor {kind!r}: expected one of {', '.join(NAMES_WITH_AUTO)}")
    return PREDICTORS[kind](ctx)
