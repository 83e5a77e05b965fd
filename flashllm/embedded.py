"""The small models embedded in flashllm/data (for the demo, the planner's calibration and tests), converted
once into flashllm's cache with the predictors, thresholds and neuron order shipped beside them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from flashllm.errors import FlashLLMError
from flashllm.format import manifest as fmt
from flashllm.paths import cache_home

DATA = Path(__file__).resolve().parent / "data"  # flashllm/data: the embedded models
EMBEDDED = DATA / "tiny-opt"
EMBEDDED_PREDICTORS = DATA / "tiny-opt-predictors"
EMBEDDED_MOE = DATA / "tiny-moe"
# The embedded SwiGLU model and what `flashllm predictors train --sparsity 0.4` wrote for it: calibrated
# thresholds (sparsity.json) and low-rank predictors. It is sparse only through those thresholds.
EMBEDDED_SWIGLU = DATA / "tiny-swiglu"
EMBEDDED_SWIGLU_SPARSITY = DATA / "tiny-swiglu-sparsity"


# Each layer's neurons in co-activation order (`flashllm predictors order` on the stdlib corpus' train split):
# neurons the predictors select together are adjacent on flash, so a token's missing bundles take fewer reads.
# A permutation: the model's function is unchanged.
ORDER_FILE = "neuron_order.safetensors"


def prepare(out: Path | None = None, embedded: Path = EMBEDDED, extras: Path = EMBEDDED_PREDICTORS,
            order: bool = True) -> Path:
    """The converted embedded model with its shipped predictors (and thresholds, if any: every file of
    `extras`) and, with `order`, in the neuron order `extras` ships, if any; converted once, then reused
    (again when the shipped order differs from the directory's)."""
    from flashllm.converters import convert
    from flashllm.modes.sparse.predictor import PREDICTOR_META

    out = out or cache_home() / embedded.name
    if not (embedded / "config.json").is_file():
        raise FlashLLMError(f"{embedded}: the embedded model is missing from this installation")
    shipped = extras / ORDER_FILE if order and (extras / ORDER_FILE).is_file() else None
    want = hashlib.sha256(shipped.read_bytes()).hexdigest() if shipped else None
    try:
        have = fmt.read_manifest(out).data.get("neuron_order", {}).get("shipped_sha256")
        ready = (out / PREDICTOR_META).is_file() and have == want
    except FlashLLMError:
        ready = False
    if not ready:
        convert(embedded, out, dtype="float32", force=True)
        names = sorted(f.name for f in extras.iterdir() if f.name not in (PREDICTOR_META, ORDER_FILE))
        for name in names + [PREDICTOR_META]:  # the file that marks the directory ready comes last
            shutil.copyfile(extras / name, out / name)
        if shipped:
            from flashllm.predictors.reorder import apply_order
            from flashllm.format.safetensors_io import SafetensorsFile

            st = SafetensorsFile(shipped)
            perms = [st.read(f"layers.{i}.perm") for i in range(len(st.entries))]
            apply_order(out, perms, {"method": "coactivation", "shipped_sha256": want,
                                     "source": f"{shipped.name} shipped with the embedded model"}, progress=False)
    return out


def prepare_moe(out: Path | None = None) -> Path:
    """The converted embedded MoE model (converted once per checkpoint, then reused: the cache directory
    is named by the checkpoint's hash, so a newer embedded model is converted again)."""
    from flashllm.converters import convert

    weights = EMBEDDED_MOE / "model.safetensors"
    if not (EMBEDDED_MOE / "config.json").is_file() or not weights.is_file():
        raise FlashLLMError(f"{EMBEDDED_MOE}: the embedded MoE model is missing from this installation")
    out = out or cache_home() / f"tiny-moe-{hashlib.sha256(weights.read_bytes()).hexdigest()[:12]}"
    try:
        fmt.read_manifest(out)
    except FlashLLMError:
        convert(EMBEDDED_MOE, out, dtype="float16", force=True)
    return out
