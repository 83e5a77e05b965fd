"""Active-neuron predictors: which FFN neurons a token needs, from the FFN input of that layer.

`lowrank` reads the trained predictors (written by `flashllm predictors train`) from the model
directory; `oracle` computes the true activation from the real weights (tests, upper bound);
`gate` uses a ReLU-gated model's own gate projection, kept resident.
"""

from __future__ import annotations

import json

import numpy as np

from . import format as fmt
from .errors import FlashLLMError
from .st_io import SafetensorsFile

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


class OraclePredictor:
    """The true active set, from the real up (or gate) rows kept in memory for this purpose only."""

    kind = "oracle"

    def __init__(self, ctx):
        self.spec, self.backend = ctx.spec, ctx.backend
        self.threshold = activation_threshold(self.spec)
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

    def scores(self, layer: int, x) -> np.ndarray | None:
        """Pre-activation minus the activation threshold [tokens, d_ffn] (> 0: active; its size is the
        neuron's activation for ReLU); None for a dense activation."""
        if self.threshold is None:
            return None
        return self.backend.to_host(self.backend.linear(x, self.rows[layer], self.bias[layer])) - self.threshold

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
    """ReLU-gated FFNs: the gate projection itself, kept resident, decides (paper App. C.5).

    Exact like the oracle, but its gate rows are counted against the DRAM budget.
    """

    kind = "gate"

    def __init__(self, ctx):
        if not ctx.spec.gated_ffn or activation_threshold(ctx.spec) is None:
            raise FlashLLMError(f"predictor 'gate' needs a gated FFN with a sparse activation (relu, fatrelu); "
                                f"this model has {'a gated' if ctx.spec.gated_ffn else 'an ungated'} "
                                f"{ctx.spec.activation} FFN")
        super().__init__(ctx)

    def nbytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for t in self.rows)


class LowRankPredictor:
    """sigmoid(B (A x) + b) > threshold per layer, with weights and thresholds from the model dir."""

    kind = "lowrank"

    def __init__(self, ctx):
        root, spec, self.backend = ctx.manifest.root, ctx.spec, ctx.backend
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
        if not ok or len(layers) != spec.n_layers:
            raise FlashLLMError(f"{meta_path}: not predictors for this model (format/version or layer count)")
        trained_for = (meta.get("model") or {}).get("sha256", {}).get("ffn")
        if trained_for and trained_for != ctx.manifest.data["files"]["ffn"]["sha256"]:
            raise FlashLLMError(f"{meta_path}: these predictors were trained for different weights "
                                f"(ffn.bin sha256 {trained_for[:12]}...); train them again for this model")
        if meta.get("sha256") and fmt.sha256_file(st_path) != meta["sha256"]:
            raise FlashLLMError(f"{st_path}: checksum mismatch (train the predictors again)")
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
        backend = self.backend
        hidden = backend.linear(x, self.proj_in[layer], None)
        return backend.to_host(backend.linear(hidden, self.proj_out[layer], self.bias[layer])) - self.threshold[layer]

    def predict(self, layer: int, x) -> np.ndarray:
        return self.scores(layer, x) > 0

    def nbytes(self) -> int:
        return sum(self.backend.nbytes_of(t) for ts in (self.proj_in, self.proj_out, self.bias) for t in ts)


def predict_scored(predictor, layer: int, x) -> tuple[np.ndarray, np.ndarray | None]:
    """(mask, scores) of a predictor: scores rank the predicted neurons (higher: keep first) when a
    cache cannot hold them all; None when the predictor has none (e.g. a replayed trace)."""
    scores = predictor.scores(layer, x) if hasattr(predictor, "scores") else None
    return (predictor.predict(layer, x), None) if scores is None else (scores > 0, scores)


# Every predictor, by the name the API and the CLI use.
PREDICTORS = {"lowrank": LowRankPredictor, "oracle": OraclePredictor, "gate": GatePredictor}


def make_predictor(kind, ctx):
    """A predictor by name, or built by `kind(ctx)` when kind is a callable (benchmarks' traces); `ctx`
    is the plan's PlanContext (spec, backend, manifest, read_layer_block, bundle_rows, biases)."""
    if callable(kind):
        return kind(ctx)
    if kind not in PREDICTORS:
        raise FlashLLMError(f"predictor {kind!r}: expected one of {', '.join(PREDICTORS)}")
    return PREDICTORS[kind](ctx)
