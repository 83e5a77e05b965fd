"""No silent quality loss: overflowing caches drop the lowest-scored neurons and say so; dense
activations are not 'predicted' away; corrupt FFN layers are caught when first read in full."""

import shutil

import numpy as np
import pytest

import flashllm
from flashllm.cli.stats_text import format_stats
from flashllm.errors import DroppedNeuronsWarning

IDS = [1, 5, 9, 12, 7, 3, 20, 4, 8, 11]


class ScriptedPredictor:
    """Every neuron active, scored by its id: the highest ids are the ones to keep."""

    kind = "scripted"

    def __init__(self, model):
        self.d_ffn = model.spec.d_ffn

    def scores(self, layer, x):
        return np.tile(np.arange(1, self.d_ffn + 1, dtype=np.float32), (x.shape[0], 1))

    def predict(self, layer, x):
        return self.scores(layer, x) > 0

    def nbytes(self):
        return 0


def small_cache_model(tiny, capacity, **kw):
    full = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle")
    budget = full.backend.nbytes() + 2 * capacity * full.compute_row_bytes()
    return flashllm.load(tiny.model_dir, mode="sparse", predictor=ScriptedPredictor, dram_budget=budget, window=1, **kw)


def test_overflow_keeps_the_highest_scored_neurons(tiny_models, recwarn):
    tiny = tiny_models("opt")
    model = small_cache_model(tiny, capacity=40)
    d = model.spec.d_ffn
    recwarn.clear()
    kept = {}
    with model.hooks.observing("fit", lambda layer, ids: kept.__setitem__(layer, ids)):
        model.logits(IDS, prefill=3)
    assert sorted(kept) == list(range(model.spec.n_layers))
    for held in kept.values():  # the last token's, as its cache holds them (window 1)
        np.testing.assert_array_equal(held, np.arange(d - 40, d))  # not the lowest ids 0..39
    stats = model.stats
    assert stats["neurons_dropped"] == 2 * (d - 40)  # per decode token, both layers
    assert stats["dropped_mass_share"] == pytest.approx(2 * sum(range(1, d - 40 + 1)) / (2 * sum(range(1, d + 1))))
    warned = [str(w.message) for w in recwarn if issubclass(w.category, DroppedNeuronsWarning)]
    assert len(warned) == 1 and f"{2 * (d - 40)} dropped" in warned[0] and "% of the predicted" in warned[0]
    assert "neurons dropped per token: 176" in format_stats(stats)
    # 4 neurons dropped over 31 tokens, of little score mass: said as such, not "0 ... 0.0%"
    few = format_stats(dict(stats, neurons_dropped=4 / 31, dropped_mass_share=2e-5))
    assert "neurons dropped per token: 0.13 (caches too small for the predicted set; <0.1% of the predicted" in few
    assert "per token: 1.5 (" in format_stats(dict(stats, neurons_dropped=1.5))


def test_overflow_error_option_refuses(tiny_models):
    model = small_cache_model(tiny_models("opt"), capacity=40, on_overflow="error")
    with pytest.raises(flashllm.FlashLLMError, match="cache holds 40") as err:
        model.logits(IDS, prefill=3)
    # named as the caller passes them: Python keywords here, the CLI's flags in its one line
    assert "raise dram_budget or load with on_overflow='drop'" in str(err.value)
    assert "raise --dram-budget or load with --on-overflow drop" in err.value.cli_message()


def test_no_drop_no_mention(tiny_models, capsys, recwarn):
    model = flashllm.load(tiny_models("opt").model_dir, mode="sparse", predictor="oracle")
    capsys.readouterr()
    model.logits(IDS, prefill=3)
    assert model.stats["neurons_dropped"] == 0 and "dropped" not in format_stats(model.stats)
    assert "warning" not in capsys.readouterr().err
    assert not [w for w in recwarn if issubclass(w.category, DroppedNeuronsWarning)]


def test_oracle_on_a_dense_activation_refuses_to_drop(tiny_models):
    tiny = tiny_models("llama")  # SiLU: every neuron is active
    full = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle")  # unlimited: every neuron fits
    budget = full.backend.nbytes() + 2 * 30 * full.compute_row_bytes()
    with pytest.raises(flashllm.FlashLLMError, match="dense activation"):
        flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dram_budget=budget)


@pytest.mark.parametrize("mode", ["dense", "naive", "hybrid"])
def test_a_corrupt_ffn_layer_is_caught_on_its_first_full_read(tiny_models, tmp_path, mode):
    tiny = tiny_models("opt")
    copy = tmp_path / "m"
    shutil.copytree(tiny.model_dir, copy)
    lay = flashllm.load(copy).layout
    with open(copy / "ffn.bin", "r+b") as f:  # flip one byte inside layer 1
        f.seek(lay.layer_offsets[1] + 5 * lay.stride + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(flashllm.FlashLLMError, match="layer 1 fails its checksum"):
        flashllm.load(copy, mode=mode, verify=False, hybrid_fraction=0.5).logits(IDS, prefill=3)
    model = flashllm.load(tiny.model_dir, mode=mode, verify=False, hybrid_fraction=0.5)
    model.logits(IDS, prefill=3)
    assert model.checksums.verified == {0, 1}


def test_cli_prints_the_load_time_drop_warning_as_one_line(tmp_path):
    """The budget warning raised at load reaches a CLI user as one `flashllm: warning:` line, no source (at 45%:
    the caches hold fewer neurons than predicted; at 50% they now hold them all)."""
    import subprocess
    import sys

    from flashllm.cli import demo

    model_dir = demo.prepare(tmp_path / "tiny-opt")
    run = subprocess.run([sys.executable, "-m", "flashllm.cli.main", "generate", str(model_dir), "--prompt", "def f():",
                          "--max-new-tokens", "2", "--mode", "sparse", "--dram-budget", "45%", "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=300)
    err = run.stderr.splitlines()
    assert run.returncode == 0, run.stderr
    load_warning = [line for line in err if "layer caches hold fewer neurons" in line]
    assert len(load_warning) == 1 and load_warning[0].startswith("flashllm: warning: --dram-budget")
    assert all(line.startswith("flashllm: warning:") for line in err), err
