"""Calibrated activation sparsity for dense activations (SiLU, GELU): the CATS rule, per layer.

`flashllm predictors train MODEL --sparsity S` (or `--ffn-error E`, or `--activation-threshold T`)
writes `sparsity.json` into the model directory: one threshold t per layer. In sparse mode a
neuron with |act(gate x)| <= t (act(up x) for an ungated FFN) contributes zero, and the oracle and
gate predictors select exactly the neurons above t, so sparse mode computes the *thresholded*
model. Dense, naive and hybrid modes ignore the file: they stay the unmodified model (the
reference the thresholds' quality cost is measured against).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from flashllm.errors import FlashLLMError

SPARSITY_FILE = "sparsity.json"
SPARSITY_FORMAT = "flashllm-sparsity"
SPARSITY_VERSION = 1
DENSE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@dataclass(frozen=True)
class CalibratedSparsity:
    """Per-layer thresholds on |act(pre)| and what calibration measured with them."""

    thresholds: tuple[float, ...]
    method: str  # "sparsity" (a target mean sparsity), "ffn_error" (a per-layer error bound) or "explicit"
    target: float | None  # the target sparsity, the error bound or the explicit threshold
    sparsity: tuple[float, ...]  # per layer, fraction of neurons at or below the threshold (calibration tokens)
    ffn_error: tuple[float, ...]  # per layer, relative RMS error of the FFN output it causes (calibration tokens)

    @property
    def mean_sparsity(self) -> float:
        return sum(self.sparsity) / len(self.sparsity)

    @property
    def mean_ffn_error(self) -> float:
        return sum(self.ffn_error) / len(self.ffn_error)

    def describe(self, activation: str) -> str:
        """One line: what sparse mode skips, and what calibration measured it costs."""
        how = {"sparsity": f"for a mean sparsity of {self.target:g}", "ffn_error": f"for an FFN error of at most "
               f"{self.target:g} per layer", "explicit": f"set to {self.target:g}"}.get(self.method, self.method)
        return (f"sparse mode skips FFN neurons with |{activation}(gate)| below per-layer thresholds ({SPARSITY_FILE}, "
                f"calibrated {how}): {self.mean_sparsity:.0%} of the FFN per token on calibration text, FFN output "
                f"error {self.mean_ffn_error:.1%} (relative RMS); dense mode runs the unmodified model, and "
                f"`flashllm predictors eval` measures the perplexity cost")

    def to_stats(self) -> dict:
        return {"method": self.method, "target": self.target, "sparsity": round(self.mean_sparsity, 4),
                "ffn_error": round(self.mean_ffn_error, 4)}


def sparsity_document(thresholds, sparsity, ffn_error, method: str, target: float | None, ffn_sha256: str,
                      extra: dict | None = None) -> dict:
    """The content of sparsity.json (written by `flashllm predictors train`)."""
    return {"format": SPARSITY_FORMAT, "format_version": SPARSITY_VERSION, "method": method, "target": target,
            "rule": "neuron i of layer l contributes iff |act(pre_i)| > threshold_l (pre: gate, or up if ungated)",
            "model": {"sha256": {"ffn": ffn_sha256}}, **(extra or {}),
            "layers": [{"threshold": float(t), "sparsity": float(s), "ffn_error": float(e)}
                       for t, s, e in zip(thresholds, sparsity, ffn_error)]}


def read_sparsity(manifest) -> CalibratedSparsity | None:
    """The model directory's calibrated thresholds (None without sparsity.json), checked against the model."""
    path, spec = manifest.root / SPARSITY_FILE, manifest.spec
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        layers = data["layers"]
        thresholds = tuple(float(layer["threshold"]) for layer in layers)
        sparsity = tuple(float(layer["sparsity"]) for layer in layers)
        error = tuple(float(layer["ffn_error"]) for layer in layers)
        ok = data.get("format") == SPARSITY_FORMAT and data.get("format_version") == SPARSITY_VERSION
        method, target = str(data["method"]), data.get("target")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlashLLMError(f"{path}: unreadable calibrated sparsity ({exc})") from None
    if not ok or len(thresholds) != spec.n_layers:
        raise FlashLLMError(f"{path}: not calibrated thresholds for this model (format/version or layer count)")
    if not all(math.isfinite(t) and t >= 0 for t in thresholds):
        raise FlashLLMError(f"{path}: thresholds must be finite and >= 0")
    if spec.activation not in DENSE_ACTIVATIONS:
        raise FlashLLMError(f"{path}: calibrated thresholds are for dense activations ({', '.join(DENSE_ACTIVATIONS)}); "
                            f"this model's {spec.activation} FFN is sparse by itself: remove the file")
    trained_for = (data.get("model") or {}).get("sha256", {}).get("ffn")
    if trained_for and trained_for != manifest.data["files"]["ffn"]["sha256"]:
        raise FlashLLMError(f"{path}: calibrated for different weights (ffn.bin sha256 {trained_for[:12]}...); "
                            f"calibrate again with `flashllm predictors train {manifest.root} --data TEXT --sparsity S`")
    return CalibratedSparsity(thresholds, method, None if target is None else float(target), sparsity, error)
