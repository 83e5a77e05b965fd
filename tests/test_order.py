"""Co-activation ordering: the greedy path puts neurons loaded together next to each other, and a
reordered model (ffn.bin, biases, predictors rewritten) computes exactly what it computed before."""

import json
import shutil

import numpy as np
import pytest

import flashllm
from flashllm.format import manifest as fmt
from flashllm.cli.main import main as cli_main
from flashllm.errors import FlashLLMError
from flashllm.predictors import coactivation as co
from flashllm.predictors.order import layer_counts
from flashllm.predictors.reorder import apply_order
from tiny import TEXT, write_random_predictors

IDS = [1, 5, 17, 33, 8, 60, 2, 41, 9, 12, 70, 3]


def test_greedy_path_makes_co_loaded_groups_contiguous():
    """Neurons in 8 shuffled groups of 6 are always loaded as a group: ordered, each group is one run."""
    rng = np.random.default_rng(0)
    n, groups = 48, rng.permutation(48).reshape(8, 6)
    masks = np.zeros((400, n), bool)
    for t in range(400):
        for g in rng.choice(8, 3, replace=False):
            masks[t, groups[g]] = True
    counts = layer_counts(masks, [400], window=1, statistic="active")
    order, fig = co.layer_order(counts)
    assert sorted(order) == list(range(n))
    position = np.argsort(order)
    for g in groups:
        assert np.ptp(position[g]) == len(g) - 1  # the group's neurons occupy consecutive positions
    assert fig["runs_per_token_after"] <= 3.0  # at most one read per loaded group
    assert fig["runs_per_token_before"] > 10


def test_loads_are_what_the_window_does_not_hold():
    pred = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1]], bool)
    expected = np.array([[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0]], bool)
    assert np.array_equal(co.loads(pred, window=3), expected)


def _model_copy(tiny_models, family, tmp_path, **convert_kw):
    if convert_kw:
        from flashllm.converters import convert

        out = convert(tiny_models(family).ckpt, tmp_path / family, dtype="float32", progress=False, **convert_kw)
    else:
        out = shutil.copytree(tiny_models(family).model_dir, tmp_path / family)
    sha = fmt.read_manifest(out).data["files"]["ffn"]["sha256"]
    write_random_predictors(out, trained_for=sha)
    return out


def _observe(model_dir, mode, predictor="oracle"):
    """Logits of IDS (prompt then decode) and, in sparse mode, the predicted masks per layer."""
    model = flashllm.load(model_dir, mode=mode, predictor=predictor, dtype="float32")
    masks = []
    with model.hooks.observing("predict", lambda layer, m: masks.append((layer, m.copy()))):
        logits = model.logits(IDS, prefill=4)
    return logits, masks


@pytest.mark.parametrize("family,convert_kw", [("opt", {}), ("llama-relu", {}), ("llama", {}),
                                               ("opt", {"quantize": "int8"}), ("opt", {"bundled": False})],
                         ids=["opt", "llama-relu", "llama-silu", "opt-int8", "opt-unbundled"])
def test_reordered_model_computes_the_same(tiny_models, tmp_path, family, convert_kw):
    model_dir = _model_copy(tiny_models, family, tmp_path, **convert_kw)
    spec = fmt.read_manifest(model_dir).spec
    dense_before, _ = _observe(model_dir, "dense")
    sparse_before, _ = _observe(model_dir, "sparse", "oracle") if spec.activation != "silu" else (None, None)
    _, pred_before = _observe(model_dir, "sparse", "lowrank")
    rng = np.random.default_rng(1)
    perms = [rng.permutation(spec.d_ffn) for _ in range(spec.n_layers)]
    apply_order(model_dir, perms, {"method": "test"}, progress=False)

    manifest = fmt.read_manifest(model_dir, verify=True)  # every checksum matches the rewritten files
    assert manifest.data["neuron_order"]["method"] == "test"
    dense_after, _ = _observe(model_dir, "dense")
    np.testing.assert_allclose(dense_after, dense_before, rtol=1e-5, atol=1e-5)
    if sparse_before is not None:
        np.testing.assert_allclose(_observe(model_dir, "sparse", "oracle")[0], sparse_before, rtol=1e-5, atol=1e-5)
    _, pred_after = _observe(model_dir, "sparse", "lowrank")  # loads: the predictors match the new weights
    assert len(pred_after) == len(pred_before)
    for (layer, before), (layer_after, after) in zip(pred_before, pred_after):
        assert layer == layer_after
        assert np.array_equal(after, before[:, perms[layer]])  # the same neurons, at their new positions


def test_reordering_twice_composes_the_stored_permutation(tiny_models, tmp_path):
    model_dir = _model_copy(tiny_models, "opt", tmp_path)
    spec = fmt.read_manifest(model_dir).spec
    rng = np.random.default_rng(2)
    first = [rng.permutation(spec.d_ffn) for _ in range(spec.n_layers)]
    second = [rng.permutation(spec.d_ffn) for _ in range(spec.n_layers)]
    apply_order(model_dir, first, {"method": "a"}, progress=False)
    apply_order(model_dir, second, {"method": "b"}, progress=False)
    from flashllm.predictors.reorder import current_order

    stored = current_order(fmt.read_manifest(model_dir))
    for p1, p2, got in zip(first, second, stored):
        assert np.array_equal(got, p1[p2])


def test_predictors_order_cli(tiny_models, tmp_path, capsys):
    model_dir = _model_copy(tiny_models, "opt", tmp_path)
    data = tmp_path / "cal.txt"
    data.write_text(TEXT * 3)
    before, _ = _observe(model_dir, "dense")
    capsys.readouterr()
    assert cli_main(["inspect", str(model_dir)]) == 0  # inspect says the order, and how to make one
    assert f"FFN neuron order: as converted (`flashllm predictors order {model_dir} --data TEXT`" in \
        capsys.readouterr().out
    code = cli_main(["predictors", "order", str(model_dir), "--data", str(data), "--json", "--max-tokens", "400"])
    out, err = capsys.readouterr()
    assert code == 0, err
    info = json.loads(out)
    assert info["method"] == "coactivation" and info["statistic"] == "loads"
    assert info["runs_per_token_after"] <= info["runs_per_token_before"]
    assert info["tokens"] > 100
    np.testing.assert_allclose(_observe(model_dir, "dense")[0], before, rtol=1e-5, atol=1e-5)
    manifest = json.loads((model_dir / fmt.MANIFEST).read_text())
    assert manifest["neuron_order"]["runs_per_token_after"] == info["runs_per_token_after"]
    assert cli_main(["inspect", str(model_dir)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("FFN neuron order: "))
    assert line == (f"FFN neuron order: coactivation ({info['tokens']} tokens of {data}, {info['source']}; reads per "
                    f"token there {info['runs_per_token_before']} -> {info['runs_per_token_after']} (no gap filling))")
    assert cli_main(["inspect", str(model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["neuron_order"]["method"] == "coactivation"


def test_bad_order_and_interrupted_rewrite_are_refused(tiny_models, tmp_path, capsys):
    model_dir = _model_copy(tiny_models, "opt", tmp_path)
    spec = fmt.read_manifest(model_dir).spec
    bad = [np.zeros(spec.d_ffn, int) for _ in range(spec.n_layers)]
    with pytest.raises(FlashLLMError, match="not a permutation"):
        apply_order(model_dir, bad, {"method": "x"}, progress=False)
    fmt.read_manifest(model_dir, verify=True)  # nothing was changed
    data = json.loads((model_dir / fmt.MANIFEST).read_text())
    (model_dir / fmt.MANIFEST).write_text(json.dumps({**data, "rewrite_pending": "predictors order was interrupted"}))
    with pytest.raises(FlashLLMError, match="interrupted"):
        fmt.read_manifest(model_dir)
    code = cli_main(["predictors", "order", str(tmp_path / "missing"), "--data", str(tmp_path / "none.txt")])
    assert code != 0
    assert "does not exist" in capsys.readouterr().err
