"""Calibrated sparsity for dense activations (SiLU, GeGLU): sparse mode with the oracle equals
transformers' model with the thresholded FFN; `predictors train --sparsity/--ffn-error` calibrates,
writes sparsity.json and trains on the thresholded labels; every drop is stated."""

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch

import flashllm
from flashllm.cli.stats_text import format_stats
from flashllm.cli.main import main as cli_main
from flashllm.predictors import calibrate as calib
from flashllm.predictors import collect as col
from flashllm.modes.sparse.activation_sparsity import sparsity_document
from tiny import TEXT, hf_logits

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.skipif(importlib.util.find_spec("mlx") is None,
                                                                    reason="mlx is not installed"))]
IDS = [1, 5, 9, 12, 7, 3, 20, 4, 8, 11, 30, 41, 17, 6]
PREFILL = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(" ".join(rng.choice(TEXT.split(), 1500)) + "\n")
    return path


def own_copy(tiny_models, family, tmp_path):
    return shutil.copytree(tiny_models(family).model_dir, tmp_path / family)


def calibrated(tiny_models, family, tmp_path, data, target=calib.Target("sparsity", 0.4)):
    """A private copy of the tiny model with thresholds calibrated for `target` (no predictors)."""
    model_dir = own_copy(tiny_models, family, tmp_path)
    model = col.open_model(model_dir, seq_len=32)
    document = calib.calibrate(model, col.tokens_of(model, data, 32, 600), target)
    calib.write_sparsity(model_dir, document)
    return model_dir, document


def thresholded_hf(hf, thresholds):
    """transformers' own model with each layer's FFN activation zeroed where |act| <= its threshold."""
    import copy

    class Thresholded(torch.nn.Module):
        def __init__(self, act, t):
            super().__init__()
            self.act, self.t = act, t

        def forward(self, g):
            a = self.act(g)
            return a * (a.abs() > self.t)

    ref = copy.deepcopy(hf)
    for layer, t in zip(ref.model.layers, thresholds):
        layer.mlp.act_fn = Thresholded(layer.mlp.act_fn, t)
    return ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # SiLU (SwiGLU), gelu_tanh (GeGLU)
def test_sparse_oracle_equals_the_thresholded_ffn(tiny_models, tmp_path, data, family, backend):
    model_dir, doc = calibrated(tiny_models, family, tmp_path, data)
    thresholds = [layer["threshold"] for layer in doc["layers"]]
    assert all(t > 0 for t in thresholds)
    hf = tiny_models(family).hf
    ref = hf_logits(thresholded_hf(hf, thresholds), IDS)
    dense_ref = hf_logits(hf, IDS)
    assert np.abs(ref - dense_ref).max() > 1e-2  # the thresholds change the result: this test can fail
    full = flashllm.load(model_dir, mode="sparse", predictor="oracle", backend=backend)
    most = [0]  # the largest active set of any layer and token
    with full.hooks.observing("predict", lambda layer, mask: most.append(int(mask.sum(axis=1).max()))):
        np.testing.assert_allclose(full.logits(IDS, prefill=PREFILL), ref, atol=2e-4, rtol=1e-4)
    # caches that hold just the largest active set, window 1: still exact (only active neurons count)
    d_ffn, B = full.spec.d_ffn, full.backend
    budget = B.nbytes() + B.staging_bytes(full.layout.stride) + max(most) * full.spec.n_layers * full.compute_row_bytes()
    small = flashllm.load(model_dir, mode="sparse", predictor="oracle", backend=backend, dram_budget=budget, window=1)
    assert max(small.stats["cache_capacity"]) < d_ffn
    np.testing.assert_allclose(small.logits(IDS, prefill=PREFILL), ref, atol=2e-4, rtol=1e-4)
    assert small.stats["neurons_dropped"] == 0
    # dense mode ignores the thresholds: the unmodified model
    dense = flashllm.load(model_dir, mode="dense", backend=backend)
    np.testing.assert_allclose(dense.logits(IDS, prefill=PREFILL), dense_ref, atol=2e-4, rtol=1e-4)


def test_a_dense_activation_is_dropped_only_by_stated_thresholds(tiny_models, tmp_path, data):
    """The oracle on SiLU refuses to drop neurons at a small budget; with
    calibrated thresholds the same load works, and the drop is stated (warning, stats)."""
    full = flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="oracle")
    budget = full.backend.nbytes() + full.spec.n_layers * 80 * full.compute_row_bytes()
    with pytest.raises(flashllm.FlashLLMError, match="silently drop most of the FFN.*--sparsity 0.4"):
        flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="oracle", dram_budget=budget)
    model_dir, doc = calibrated(tiny_models, "llama", tmp_path, data)
    with pytest.warns(RuntimeWarning, match="40% of the FFN per token") as record:
        model = flashllm.load(model_dir, mode="sparse", predictor="oracle", dram_budget=budget)
    assert len(record) == 1
    model.logits(IDS, prefill=PREFILL)
    assert model.stats["activation_sparsity"]["sparsity"] == pytest.approx(
        np.mean([layer["sparsity"] for layer in doc["layers"]]), abs=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gate_predictor_is_exact_reads_no_gate_rows_and_counts_them(tiny_models, tmp_path, data, family, backend):
    """The resident gate rows decide and compute the gate: each neuron read from flash (and cached) is
    its up and down rows only, so the bytes per token are 2/3 of whole bundles for the same neurons."""
    model_dir, _ = calibrated(tiny_models, family, tmp_path, data)
    oracle = flashllm.load(model_dir, mode="sparse", predictor="oracle", backend=backend)
    gate = flashllm.load(model_dir, mode="sparse", predictor="gate", backend=backend)
    np.testing.assert_allclose(gate.logits(IDS, prefill=PREFILL), oracle.logits(IDS, prefill=PREFILL),
                               atol=1e-5, rtol=1e-5)
    spec, lay = gate.spec, gate.layout
    assert gate.predictor.nbytes() == spec.n_layers * spec.d_ffn * spec.d_model * 4
    assert gate.stats["neurons_loaded_per_layer"] == oracle.stats["neurons_loaded_per_layer"]
    assert sum(gate.stats["neurons_loaded_per_layer"]) > 0
    asked = {m: m.stats["bytes_read"] - m.stats["bytes_wasted"] for m in (gate, oracle)}  # without alignment waste
    assert asked[gate] == pytest.approx(asked[oracle] * 2 * lay.part_bytes / lay.stride)
    held = {m: m.memory()[1] - m.backend.nbytes() for m in (gate, oracle)}  # caches and predictor beside the weights
    assert held[gate] - gate.predictor.nbytes() < held[oracle] * 0.7
    # without calibrated thresholds a SiLU gate selects nothing: refused, saying what to do
    with pytest.raises(flashllm.FlashLLMError, match="--sparsity"):
        flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="gate")


def test_calibration_reaches_the_target(tiny_models, tmp_path, data):
    _, doc = calibrated(tiny_models, "llama", tmp_path, data, calib.Target("sparsity", 0.5))
    sparsity = [layer["sparsity"] for layer in doc["layers"]]
    assert np.mean(sparsity) == pytest.approx(0.5, abs=calib.GRID_STEP)
    for layer, curve in zip(doc["layers"], doc["curves"]):
        assert curve["ffn_error"] == sorted(curve["ffn_error"])  # more skipped, more error
        assert 0 < layer["ffn_error"] < 1


def test_greedy_allocation_minimises_the_summed_squared_error():
    """Against brute force over every allocation reaching the target on convex error curves."""
    import itertools

    rng = np.random.default_rng(0)
    grid = np.arange(0, 0.95 + 1e-9, calib.GRID_STEP)
    curves = []
    for scale in (0.2, 1.0, 3.0):
        err = np.sqrt(scale * grid ** (2 + rng.random()))  # squared errors convex in sparsity
        curves.append(calib.LayerCurve(grid, grid, err))
    picks = calib.allocate(curves, 0.3)
    assert np.mean(grid[picks]) == pytest.approx(0.3, abs=1e-9)
    cost = sum(c.error[i] ** 2 for c, i in zip(curves, picks))
    steps = int(round(0.3 * 3 / calib.GRID_STEP))
    best = min(sum(c.error[i] ** 2 for c, i in zip(curves, combo))
               for combo in itertools.product(range(len(grid)), repeat=3) if sum(combo) == steps)
    assert cost == pytest.approx(best, rel=1e-9)
    assert picks[0] > picks[1] > picks[2]  # the layer whose output barely changes goes sparsest


def test_ffn_error_bound_holds_per_layer(tiny_models, tmp_path, data):
    _, doc = calibrated(tiny_models, "gemma2", tmp_path, data, calib.Target("ffn_error", 0.05))
    for layer in doc["layers"]:
        assert layer["ffn_error"] <= 0.05 + 1e-9 and layer["sparsity"] > 0


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = cli_main([str(a) for a in argv])
    return (code, *capsys.readouterr())


def test_train_with_sparsity_writes_thresholds_and_trains_on_them(tiny_models, tmp_path, data, capsys):
    model_dir = own_copy(tiny_models, "llama", tmp_path)
    code, out, err = run_cli(capsys, "predictors", "train", model_dir, "--data", data, "--max-tokens", 600,
                             "--sparsity", 0.4, "--rank", 8, "--epochs", 2, "--quiet")
    assert code == 0, err
    sparsity = json.loads((model_dir / "sparsity.json").read_text())
    meta = json.loads((model_dir / "predictors.json").read_text())
    thresholds = [layer["threshold"] for layer in sparsity["layers"]]
    assert meta["activation_rule"]["thresholds"] == thresholds and meta["sparsity"]["target"] == 0.4
    assert "sparsity.json" in out and "skips 40% of the FFN" in out
    # labels are the thresholded activations: their active fraction is 1 - the calibrated sparsity
    for info, layer in zip(meta["layers"], sparsity["layers"]):
        assert info["true_fraction"] == pytest.approx(1 - layer["sparsity"], abs=0.08)
    with pytest.warns(RuntimeWarning, match=r"skips FFN neurons with \|silu\(gate\)\| below per-layer thresholds"):
        model = flashllm.load(model_dir, mode="sparse", predictor="lowrank")
    model.logits(IDS, prefill=PREFILL)
    stats = model.stats
    assert stats["activation_sparsity"]["method"] == "sparsity" and stats["activation_sparsity"]["target"] == 0.4
    assert "calibrated activation sparsity" in format_stats(stats)
    # generate warns at load (the CLI prints warnings as one line) and --stats shows it
    with pytest.warns(RuntimeWarning, match="40% of the FFN per token on calibration text, FFN output error"):
        code, out, err = run_cli(capsys, "generate", model_dir, "--prompt", "the quick", "--max-new-tokens", 3,
                                 "--mode", "sparse", "--stats")
    assert code == 0 and "calibrated activation sparsity: 40% of FFN neurons skipped" in err
    assert "mode sparse  predictor gate" in err  # the default ("auto") with unlimited DRAM
    code, out, _ = run_cli(capsys, "inspect", model_dir)
    assert code == 0 and "sparse mode skips FFN neurons with |silu(gate)|" in out
    # predictors trained for other thresholds, or thresholds gone: refused, saying what to do
    sparsity["layers"][0]["threshold"] *= 1.5
    # the default predictor ("auto"): the resident gate rows whenever the budget holds them, else lowrank
    assert flashllm.load(model_dir, mode="sparse").predictor.kind == "gate"
    B, spec, lay = model.backend, model.spec, model.layout
    base = B.nbytes() + B.staging_bytes(lay.stride)
    gate_bytes, gate_row = spec.n_layers * spec.d_ffn * spec.d_model * B.itemsize, 2 * lay.part_bytes + 2 * B.itemsize
    for extra, kind in ((spec.n_layers * gate_row - 1, "lowrank"), (spec.n_layers * gate_row, "gate")):
        assert flashllm.load(model_dir, mode="sparse", dram_budget=base + gate_bytes + extra).predictor.kind == kind
    with pytest.raises(flashllm.FlashLLMError, match="predictors train"):  # a ReLU model: auto is lowrank, untrained here
        flashllm.load(tiny_models("opt").model_dir, mode="sparse")
    (model_dir / "sparsity.json").write_text(json.dumps(sparsity))
    with pytest.raises(flashllm.FlashLLMError, match="other calibrated thresholds"):
        flashllm.load(model_dir, mode="sparse", predictor="lowrank")
    (model_dir / "sparsity.json").unlink()
    with pytest.raises(flashllm.FlashLLMError, match="missing"):
        flashllm.load(model_dir, mode="sparse", predictor="lowrank")


@pytest.mark.parametrize("argv, message", [
    (("--sparsity", 1.5), "--sparsity 1.5: must be a finite number in (0, 0.95]"),
    (("--ffn-error", 0), "--ffn-error 0.0: must be a finite number in (0, 1)"),
    ((), "pass --sparsity S"),
])
def test_bad_targets_are_one_line_errors(tiny_models, tmp_path, data, capsys, argv, message):
    model_dir = own_copy(tiny_models, "llama", tmp_path)
    code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", data, "--max-tokens", 200, *argv)
    assert code == 1 and message in err and err.count("\n") == 1
    assert not (model_dir / "sparsity.json").exists() and not (model_dir / "predictors.json").exists()


def test_relu_models_refuse_calibrated_thresholds(tiny_models, tmp_path, data, capsys):
    model_dir = own_copy(tiny_models, "opt", tmp_path)
    code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", data, "--sparsity", 0.4)
    assert code == 1 and "relu FFN is sparse by itself" in err
    # a sparsity.json put beside a ReLU model is refused at load, too
    (model_dir / "sparsity.json").write_text(json.dumps(sparsity_document(
        [0.1, 0.1], [0.4, 0.4], [0.1, 0.1], "explicit", 0.1, "0" * 64)))
    with pytest.raises(flashllm.FlashLLMError, match="sparse by itself"):
        flashllm.load(model_dir, mode="dense")


def test_neuron_reordering_keeps_the_thresholds_valid(tiny_models, tmp_path, data):
    """Thresholds are per layer: `predictors order` rewrites ffn.bin and sparsity.json follows its checksum."""
    from flashllm.predictors.reorder import apply_order

    model_dir, _ = calibrated(tiny_models, "llama", tmp_path, data)
    before = flashllm.load(model_dir, mode="sparse", predictor="oracle").logits(IDS, prefill=PREFILL)
    d_ffn = flashllm.load(model_dir, mode="dense").spec.d_ffn
    rng = np.random.default_rng(0)
    apply_order(model_dir, [rng.permutation(d_ffn) for _ in range(2)], {"method": "random"}, progress=False)
    after = flashllm.load(model_dir, mode="sparse", predictor="oracle").logits(IDS, prefill=PREFILL)
    np.testing.assert_allclose(after, before, atol=2e-4, rtol=1e-4)
