"""The tuned forward path (fused q/k/v, packed resident FFNs, per-dtype down kernel) holds the same bytes
as the plain one (that it computes the same math in every family and compute dtype: tests/test_parity.py);
the part timer accounts compute."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flashllm
from flashllm.stats import PartTimer

rng = np.random.default_rng(3)
IDS = [int(t) for t in rng.integers(3, 96, size=14)]  # a 6-token prompt, then 8 decode steps
PREFILL = 6


def test_fused_at_load_holds_the_same_bytes(tiny_models):
    tiny = tiny_models("llama")
    plain = flashllm.load(tiny.model_dir, mode="dense", kernels="plain")
    tuned = flashllm.load(tiny.model_dir, mode="dense")
    assert "layers.0.qkv.weight" in tuned.backend.w and "layers.0.q.weight" not in tuned.backend.w
    assert "layers.0.q.weight" in plain.backend.w and "layers.0.qkv.weight" not in plain.backend.w
    assert tuned.stats["ffn_rows"] == ["down_t", "up_gate"] and plain.stats["ffn_rows"] != tuned.stats["ffn_rows"]
    assert tuned.dram_bytes() == plain.dram_bytes()


def test_part_timer_splits_compute(tiny_models):
    model = flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="oracle", threads=2, read_ahead=True)
    model.forward(IDS[:4], 0)
    timer = PartTimer(model.backend.sync)
    model.backend.parts = timer
    model.forward(IDS[4:5], 4)
    model.backend.parts = None
    compute_ms = model.token_stats[-1]["compute_ms"]
    assert all(timer.ms[p] > 0 for p in ("embed", "norms", "attn_proj", "attention", "ffn", "logits"))
    assert timer.calls["attn_proj"] == 2 * model.spec.n_layers  # fused q/k/v, then o
    assert timer.calls["norms"] == 2 * model.spec.n_layers + 1  # not the read-ahead's (predictor time)
    assert sum(timer.ms.values()) <= compute_ms
    timer.reset()
    model.forward(IDS[5:6], 5)  # no timer set: nothing is charged
    assert sum(timer.ms.values()) == 0


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_decode_attention_over_the_head_major_cache_is_attention(kv_heads):
    """One token's batched products over head-major keys and values: SDPA's result (every
    query head reading kv head i // group), to float32 accuracy."""
    import torch
    import torch.nn.functional as F

    from flashllm.backends.torch.backend import TorchBackend

    g = torch.Generator().manual_seed(0)
    q, keys, vals = (torch.randn(shape, generator=g) for shape in ((4, 16), (kv_heads, 9, 16), (kv_heads, 9, 16)))
    want = F.scaled_dot_product_attention(q[:, None], keys, vals, scale=0.3, enable_gqa=kv_heads < 4)
    got = TorchBackend._decode_attention(q, keys, vals, 0.3)
    torch.testing.assert_close(got, want.reshape(1, -1), atol=1e-6, rtol=1e-5)


def test_compute_threads_requested_or_every_core(tiny_models, monkeypatch):
    import torch

    from flashllm.backends import base
    from flashllm.backends.torch import backend as torch_backend

    before = torch.get_num_threads()
    try:
        flashllm.load(tiny_models("llama").model_dir, compute_threads=1)
        assert torch.get_num_threads() == 1
        flashllm.load(tiny_models("llama").model_dir)  # a later load is not held to an earlier one's count
        assert torch.get_num_threads() == min(len(base.os.sched_getaffinity(0)), torch_backend.INITIAL_THREADS)
        assert base.compute_threads(3, 1) == 3  # a requested count is taken as it is
        monkeypatch.setattr(base.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert base.compute_threads(None, 8) == 4  # every core the process may run on
        assert base.compute_threads(None, 1) == 1  # never above the process's own setting
    finally:
        torch.set_num_threads(before)


def test_openmp_workers_sleep_unless_the_user_chose():
    """Importing flashllm (before torch) makes OpenMP workers sleep at barriers; a user's setting wins."""
    import os
    import subprocess
    import sys

    code = "import os, flashllm; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for extra, want in (({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "1000"}, "None")):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, extra


def test_compute_roofline_bench_reports_every_part(tiny_models, tmp_path):
    from bench.compute import roofline

    out = tmp_path / "roof.md"
    roofline.main([str(tiny_models("llama").model_dir), "--mode", "sparse", "--configs", "plain-2t-spin", "1t",
                                    "--rounds", "1", "--tokens", "2", "--warmup", "1", "--backends", "torch",
                                    "--roofline-dtypes", "float32", "--roofline-rounds", "1", "--out", str(out)])
    text = out.read_text()
    for part in PartTimer.PARTS + ("python/other", "compute (all parts)"):
        assert f"| 1t | torch float32 1 | {part} |" in text
    assert "| plain-2t-spin | torch float32 2 spin | ffn |" in text and "process CPU" in text
    assert "| float32, S=256 | " in text and "| float32 | " in text  # the attention and down-projection surveys


def test_compute_roofline_sets_each_run_against_the_roofline_beside_its_tokens(tiny_models, tmp_path, capsys):
    from bench.compute import roofline

    from flashllm.backends import native
    if native.library() is None:
        pytest.skip(f"no native kernels: {native.describe()}")
    out = tmp_path / "roof.md"
    roofline.main([str(tiny_models("llama").model_dir), "--mode", "sparse", "--dtype", "float16",
                                    "--configs", "1t", "--rounds", "1", "--tokens", "2", "--warmup", "1",
                                    "--backends", "native", "--roofline-dtypes", "float16", "--roofline-rounds", "0",
                                    "--out", str(out), "--json"])
    run = json.loads(capsys.readouterr().out)["runs"][0]  # each measured token on its own too
    assert [t["step"] for t in run["per_token"]] == [3, 4] and len(run["paired_ratio"]) == 2
    assert all(t["bytes"] > 0 and t["compute_ms"] >= t["parts"]["ffn"] > 0 for t in run["per_token"])
    row = next(line for line in out.read_text().splitlines() if "roofline beside the tokens" in line)
    ratio, rate = row.split("|")[4].split("x (roofline ")
    assert float(ratio) > 0 and float(rate.split()[0]) > 0
    # and each token against the mat-vec pass over the model's own q/k/v/o just before and after it
    row = next(line for line in out.read_text().splitlines() if "roofline paired with each token" in line)
    assert " of 2 tokens (roofline " in row
    low = float(row.split("|")[4].split("x")[0].split("–")[0])
    assert low > 0 and float(row.split("(roofline ")[1].split()[0].split("–")[0]) > 0
