"""The tuned forward path (fused q/k/v, packed resident FFNs, per-dtype down kernel) computes the
same math as the plain one, in every family and compute dtype; the part timer accounts compute."""

from __future__ import annotations

import numpy as np
import pytest

import flashllm
from flashllm.stats import PartTimer

rng = np.random.default_rng(3)
IDS = [int(t) for t in rng.integers(3, 96, size=14)]  # a 6-token prompt, then 8 decode steps
PREFILL = 6
# reduced precision: the kernels round differently (e.g. float32 accumulation in mv), so logits
# agree to the dtype's resolution at these logit magnitudes, not bit for bit
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.1, "float16": 0.02}


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
def test_tuned_kernels_match_plain(tiny, dtype):
    plain = flashllm.load(tiny.model_dir, mode="dense", dtype=dtype, kernels="plain").logits(IDS, prefill=PREFILL)
    for mode, kw in (("dense", {}), ("sparse", dict(predictor="oracle", window=2, threads=2))):
        tuned = flashllm.load(tiny.model_dir, mode=mode, dtype=dtype, **kw).logits(IDS, prefill=PREFILL)
        np.testing.assert_allclose(tuned, plain, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype], err_msg=mode)


def test_fused_at_load_holds_the_same_bytes(tiny_models):
    tiny = tiny_models("llama")
    plain = flashllm.load(tiny.model_dir, mode="dense", kernels="plain")
    tuned = flashllm.load(tiny.model_dir, mode="dense")
    assert "layers.0.qkv.weight" in tuned.backend.w and "layers.0.q.weight" not in tuned.backend.w
    assert "layers.0.q.weight" in plain.backend.w and "layers.0.qkv.weight" not in plain.backend.w
    assert set(tuned.plan.rows[0]) == {"up_gate", "down_t"}
    assert tuned.dram_bytes() == plain.dram_bytes()


def test_part_timer_splits_compute(tiny_models):
    model = flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="oracle", threads=2)
    model.forward(IDS[:4], 0)
    timer = PartTimer(model.backend.sync)
    model.backend.parts = timer
    model.forward(IDS[4:5], 4)
    model.backend.parts = None
    cost = model._costs[-1]
    assert all(timer.ms[p] > 0 for p in ("embed", "norms", "attn_proj", "attention", "ffn", "logits"))
    assert timer.calls["attn_proj"] == 2 * model.spec.n_layers  # fused q/k/v, then o
    assert sum(timer.ms.values()) <= cost.compute_ms
    timer.reset()
    model.forward(IDS[5:6], 5)  # no timer set: nothing is charged
    assert sum(timer.ms.values()) == 0
