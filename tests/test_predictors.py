"""Predictor collection, training and evaluation: a planted low-rank rule is recovered, the files
round-trip into the runtime, and bad inputs give one-line errors."""

import json

import numpy as np
import pytest
import torch

import flashllm
from flashllm.cli.main import main as cli_main
from flashllm.predictors import collect as col
from flashllm.predictors import train as tr
from tiny import TEXT, make_hf_model, save_checkpoint, write_random_predictors

WORDS = TEXT.split()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one torch thread is faster (and kinder to a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_words(path, n, seed):
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, n)) + "\n")
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return {"train": write_words(root / "train.txt", 2500, 1), "heldout": write_words(root / "heldout.txt", 600, 2)}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny OPT whose fc1 is rank 4 (fc1.weight = U @ V): activation is a low-rank rule of x."""
    from flashllm.converters import convert

    root = tmp_path_factory.mktemp("planted")
    hf = make_hf_model("opt")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in hf.model.decoder.layers:
            d_ffn, d = layer.fc1.weight.shape
            U, V = torch.randn(d_ffn, 4, generator=gen), torch.randn(4, d, generator=gen) / d ** 0.5
            layer.fc1.weight.copy_(U @ V)
            layer.fc1.bias.copy_(0.3 * torch.randn(d_ffn, generator=gen))
    return convert(save_checkpoint(hf, "opt", root / "hf"), root / "flash", dtype="float32", progress=False)


def own_copy(tiny_models, family, tmp_path):
    """A private copy of a shared converted tiny model, so that written predictors stay in this test."""
    import shutil

    return shutil.copytree(tiny_models(family).model_dir, tmp_path / family)


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what building the fixtures printed
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_training_recovers_planted_low_rank_rule(planted, texts, capsys):
    code, out, err = run_cli(capsys, "predictors", "train", planted, "--data", texts["train"], "--rank", 8,
                             "--max-tokens", 2000, "--recall-target", 0.99, "--quiet", "--json")
    assert code == 0, err
    meta = json.loads(out)
    assert [layer["rank"] for layer in meta["layers"]] == [8, 8]
    for layer in meta["layers"]:
        assert layer["recall"] >= 0.99
        assert layer["precision"] >= 0.9  # the rule itself, not "predict everything"
    # on other text, through the runtime's own predictor
    code, out, err = run_cli(capsys, "predictors", "eval", planted, "--data", texts["heldout"], "--max-tokens", 300,
                             "--gen-tokens", 8, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["recall"] >= 0.98 and result["precision"] >= 0.9  # other text: near the 0.99 target


def test_predictor_files_round_trip_into_the_runtime(tiny_models, texts, tmp_path):
    model_dir = own_copy(tiny_models, "opt", tmp_path)
    model = col.open_model(model_dir, seq_len=64)
    rule = col.activation_rule(model.spec)
    cal = col.collect(model, col.tokens_of(model, texts["train"], 64, 600), rule, progress=False)
    try:
        settings = tr.TrainSettings(rank=4, epochs=2, seed=3)
        results = [tr.train_layer(*cal.load(i), cal.d_ffn, settings, i) for i in range(cal.n_layers)]
        freqs = [cal.frequencies(i) for i in range(cal.n_layers)]
        x, packed = cal.load(1)
        true = col.unpack_mask(packed, cal.d_ffn)
    finally:
        cal.cleanup()
    assert x.shape == (600, model.spec.d_model) and true.mean() == pytest.approx(freqs[1].mean(), abs=1e-6)
    tr.write_predictors(model_dir, results, freqs, {"seed": 3})
    meta = json.loads((model_dir / "predictors.json").read_text())
    assert meta["format"] == "flashllm-predictors" and meta["format_version"] == 1
    assert meta["sha256"] == tr.sha256_of(model_dir / "predictors.safetensors")
    sparse = flashllm.load(model_dir, mode="sparse", predictor="lowrank")
    xt = torch.from_numpy(x.astype(np.float32))
    for i, r in enumerate(results):
        assert meta["layers"][i]["rank"] == 4 and meta["layers"][i]["threshold"] == r.threshold
        np.testing.assert_array_equal(sparse.predictor.predict(i, xt), tr.predict(r, xt))
    # and the file carries the activation frequencies for hot-neuron pinning
    from safetensors.numpy import load_file

    st = load_file(model_dir / "predictors.safetensors")
    np.testing.assert_allclose(st["layers.1.freq"], freqs[1])
    sparse.logits([1, 5, 9, 12, 7, 3], prefill=2)  # runs end to end


def test_low_memory_collection_matches_dense(tiny_models, texts):
    model_dir = tiny_models("llama-relu").model_dir
    shards = []
    for low in (False, True):
        model = col.open_model(model_dir, low_memory=low, seq_len=32)
        cal = col.collect(model, col.tokens_of(model, texts["train"], 32, 100), col.activation_rule(model.spec),
                          progress=False)
        shards.append([cal.load(i) for i in range(cal.n_layers)])
        cal.cleanup()
    for (xd, md), (xn, mn) in zip(*shards):
        np.testing.assert_allclose(xd.astype(np.float32), xn.astype(np.float32), atol=2e-3)
        assert (md != mn).mean() < 0.01  # bits may only flip for pre-activations within rounding of 0


def test_training_is_deterministic_with_a_seed(tiny_models, texts, capsys, tmp_path):
    model_dir = own_copy(tiny_models, "llama-fatrelu", tmp_path)
    digests = []
    for _ in range(2):
        code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--rank", 4,
                               "--max-tokens", 300, "--epochs", 2, "--seed", 5, "--quiet")
        assert code == 0, err
        meta = json.loads((model_dir / "predictors.json").read_text())
        digests.append(meta["sha256"])
        assert meta["activation_rule"]["kind"] == "pre" and meta["activation_rule"]["threshold"] > 0
    assert digests[0] == digests[1]


@pytest.mark.parametrize("problem", ["missing", "empty", "blank", "binary", "not-utf8", "directory"])
def test_bad_data_file_is_a_one_line_error(tiny_models, tmp_path, capsys, problem):
    path = tmp_path / "data.txt"
    if problem == "empty":
        path.write_text("")
    elif problem == "blank":
        path.write_text(" \n\n  \n")
    elif problem == "binary":
        path.write_bytes(b"abc\x00\x01\x02")
    elif problem == "not-utf8":
        path.write_bytes(b"caf\xe9 au lait " * 10)
    elif problem == "directory":
        path.mkdir()
    for command in ("train", "eval"):
        code, out, err = run_cli(capsys, "predictors", command, tiny_models("opt").model_dir, "--data", path)
        assert code == 1 and out == ""
        assert err.startswith("flashllm: error: data file") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["train", "order", "eval"])
def test_bad_sequence_length_is_a_one_line_error(tiny_models, texts, tmp_path, capsys, command):
    """--seq-len 0 is refused before any work (it used to mean the default of 256)."""
    model_dir = own_copy(tiny_models, "opt", tmp_path)
    write_random_predictors(model_dir)  # eval needs some
    code, out, err = run_cli(capsys, "predictors", command, model_dir, "--data", texts["train"], "--seq-len", 0)
    assert code == 1 and out == "" and err == "flashllm: error: --seq-len 0: must be at least 2\n", err


def test_invalid_model_dir_is_a_one_line_error(tmp_path, texts, capsys):
    code, _, err = run_cli(capsys, "predictors", "train", tmp_path / "nope", "--data", texts["train"])
    assert code == 1 and err.startswith("flashllm: error:") and err.count("\n") == 1


def test_eval_without_trained_predictors_says_how_to_train(tiny_models, texts, capsys):
    model_dir = tiny_models("falcon-seq").model_dir
    code, _, err = run_cli(capsys, "predictors", "eval", model_dir, "--data", texts["heldout"])
    assert code == 1 and "predictors train" in err


def test_silu_model_needs_an_explicit_threshold_rule(tiny_models, texts, capsys, tmp_path):
    model_dir = own_copy(tiny_models, "llama", tmp_path)
    code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--max-tokens", 200)
    assert code == 1 and "silu" in err and "--sparsity" in err and err.count("\n") == 1
    assert not (model_dir / "predictors.json").exists()
    code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--max-tokens", 300,
                           "--activation-threshold", 0.05, "--epochs", 2, "--quiet")
    assert code == 0, err
    meta = json.loads((model_dir / "predictors.json").read_text())
    assert meta["activation_rule"]["kind"] == "abs_act" and meta["activation_rule"]["thresholds"] == [0.05, 0.05]
    assert 0 < meta["layers"][0]["true_fraction"] < 1
    # the runtime applies the same threshold (sparsity.json), and says so at load
    assert [la["threshold"] for la in json.loads((model_dir / "sparsity.json").read_text())["layers"]] == [0.05, 0.05]
    with pytest.warns(RuntimeWarning, match="set to 0.05"):
        model = flashllm.load(model_dir, mode="sparse", predictor="lowrank")
    assert model.logits([1, 4, 8, 15, 16, 23, 42], prefill=3).shape == (7, 96)


def test_eval_json_has_the_documented_keys(tiny_models, texts, capsys, tmp_path):
    model_dir = own_copy(tiny_models, "opt", tmp_path)
    code, _, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--max-tokens", 400,
                           "--epochs", 2, "--quiet")
    assert code == 0, err
    code, out, err = run_cli(capsys, "predictors", "eval", model_dir, "--data", texts["heldout"], "--max-tokens", 200,
                             "--gen-tokens", 12, "--json")
    assert code == 0, err
    r = json.loads(out)
    for key in ("recall", "predicted_over_true", "ppl_dense", "ppl_sparse", "top1_agreement",
                "bytes_per_token_sparse", "bytes_per_token_naive", "layers"):
        assert key in r
    assert len(r["layers"]) == 2 and {"recall", "precision", "predicted_fraction"} <= set(r["layers"][0])
    assert r["top1_agreement_tokens"] == 12 and 0 <= r["top1_agreement"] <= 1
    assert r["bytes_per_token_sparse"] < r["bytes_per_token_naive"]
    assert r["ppl_dense"] > 1 and r["ppl_sparse"] > 1
    code, out, _ = run_cli(capsys, "predictors", "eval", model_dir, "--data", texts["heldout"], "--max-tokens", 100,
                           "--gen-tokens", 4)
    assert code == 0 and "perplexity: dense" in out and "pred/true" in out


def test_memory_estimate_fits_a_7b_model_in_24_gib():
    e = tr.memory_estimate(n_layers=32, d_model=4096, d_ffn=11008, tokens=100_000)
    assert e["shard_bytes_per_layer"] == 100_000 * (4096 * 2 + 11008 // 8)
    assert e["train_peak_bytes"] < 24 * tr.GiB and e["collect_low_memory_peak_bytes_excl_embeddings"] < 8 * tr.GiB


def test_heldout_split_keeps_whole_sequences():
    lengths = [5, 7, 3, 9, 4, 6]
    train, held, ranges = tr.split_tokens(lengths, 0.34, seed=1)
    assert len(np.intersect1d(train, held)) == 0 and len(train) + len(held) == sum(lengths)
    starts = np.cumsum([0] + lengths[:-1])
    seqs = [set(range(s, s + n)) for s, n in zip(starts, lengths)]
    held_set = set(held.tolist())
    assert len(ranges) == 2 and all(set(r.tolist()) in seqs for r in ranges)  # whole sequences only
    assert held_set == set().union(*(set(r.tolist()) for r in ranges))


def test_window_union_counts_rows_within_each_sequence():
    pred = np.zeros((5, 4), bool)
    pred[0, 0] = pred[1, 1] = pred[2, 2] = True  # sequence 1: tokens 0-2
    pred[3, 3] = pred[4, 3] = True  # sequence 2: tokens 3-4 (its union never sees sequence 1)
    rows = tr.window_union_rows(pred, [np.arange(3), np.arange(3, 5)], window=2)
    assert rows == pytest.approx((1 + 2 + 2 + 1 + 1) / 5)


def test_rank_is_chosen_by_total_cost(planted, texts):
    model = col.open_model(planted, seq_len=64)
    cal = col.collect(model, col.tokens_of(model, texts["train"], 64, 1500), col.activation_rule(model.spec),
                      progress=False)
    try:
        x, packed = cal.load(0)
        s = tr.TrainSettings(rank_ladder=(1, 4, 64), recall_target=0.98, epochs=3)
        r = tr.train_layer(x, packed, cal.d_ffn, s, 0, cal.lengths)
    finally:
        cal.cleanup()
    costs = {t["rank"]: t["cost_bytes"] for t in r.tried}
    assert r.rank == 4 and r.cost_bytes == min(costs.values()) == costs[4]  # the planted rule's rank wins
    assert costs[1] > costs[4] and r.recall >= 0.98


def test_train_caps_calibration_tokens_by_default(tiny_models, texts, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tr, "DEFAULT_MAX_TOKENS", 300)  # the parser reads the default when it is built
    model_dir = own_copy(tiny_models, "opt", tmp_path)
    code, out, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--rank", 4,
                             "--epochs", 1, "--quiet", "--json")
    assert code == 0, err
    assert 16 <= json.loads(out)["calibration"]["tokens"] <= 300  # the text holds about 2,500 words


def test_train_refuses_when_the_disk_cannot_hold_the_shards(tiny_models, texts, capsys, tmp_path, monkeypatch):
    from collections import namedtuple

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(tr.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    code, out, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--max-tokens", 500,
                             "--workdir", work, "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "0.00 GiB free" in err and "500 tokens" in err and "--workdir" in err and "--max-tokens" in err
    assert list(work.iterdir()) == [] and not (model_dir / "predictors.json").exists()
    need = col.shard_bytes_bound(2, 64, 128, 500, 2)
    assert need >= 2 * 500 * (2 * 64 + 128 // 8)  # x float16 + mask bits, every layer


def test_train_refuses_an_unwritable_model_dir_before_any_work(tiny_models, texts, capsys, tmp_path, monkeypatch):
    import os

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    real_open = os.open

    def read_only(path, *args, **kw):
        if ".flashllm-write-test" in str(path):
            raise OSError(30, "Read-only file system")
        return real_open(path, *args, **kw)

    monkeypatch.setattr(tr.os, "open", read_only)
    monkeypatch.setattr(col, "read_data", lambda *a: pytest.fail("read the data before checking the model dir"))
    code, out, err = run_cli(capsys, "predictors", "train", model_dir, "--data", texts["train"], "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "not writable" in err and "Read-only file system" in err and str(model_dir) in err


def test_budget_below_the_predicted_sets_warns_at_load_with_the_numbers(tiny_models, tmp_path):
    import re
    import warnings

    from tiny import write_random_predictors

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    write_random_predictors(model_dir)
    meta = json.loads((model_dir / "predictors.json").read_text())
    for layer in meta["layers"]:
        layer["predicted_fraction"] = 0.75  # 96 of 128 neurons per token, as trained predictors would record
    (model_dir / "predictors.json").write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match=r"2 of 2 layer caches hold fewer neurons .* \(layer \d: \d+ for 96\)") as w:
        model = flashllm.load(model_dir, mode="sparse", dram_budget=1.0)  # the resident part is most of it
    assert all(c < 96 for c in model.stats["cache_capacity"]) and "will be dropped" in str(w[0].message)
    assert w[0].category is flashllm.DroppedNeuronsWarning
    for kw, then in ((dict(on_overflow="error"), "are refused"), (dict(batch_size=2, dram_budget="330KiB"),
                                                                  "(exact, slower)")):
        with pytest.warns(RuntimeWarning, match="hold fewer neurons") as w2:  # said as it will happen
            flashllm.load(model_dir, mode="sparse", **{"dram_budget": 1.0, **kw})
        assert then in str(w2[0].message) and "dropped" not in str(w2[0].message)
        # nothing is dropped: not the class users filter drops on, but the options warning it derives from
        assert w2[0].category is flashllm.OptionsWarning, (kw, w2[0].category)
    # named as flashllm.load takes it (the CLI's one line says --dram-budget: test_quality_guards)
    enough = re.search(r"dram_budget='(\S+)' avoids it", str(w[0].message)).group(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the suggested budget holds every layer's mean predicted set
        model = flashllm.load(model_dir, mode="sparse", dram_budget=enough)
        assert all(c >= 96 for c in model.stats["cache_capacity"])
        flashllm.load(model_dir, mode="sparse")  # unlimited: no warning either


def test_eval_sweep_reports_refusals_drops_and_writes_the_curve(tiny_models, texts, capsys, tmp_path):
    import importlib.util

    from tiny import write_random_predictors

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    write_random_predictors(model_dir)
    meta = json.loads((model_dir / "predictors.json").read_text())
    for layer in meta["layers"]:
        layer["threshold"] = 0.05  # most of the FFN predicted: more than the caches at an 83% budget hold
    (model_dir / "predictors.json").write_text(json.dumps(meta))
    code, out, err = run_cli(capsys, "predictors", "eval", model_dir, "--data", texts["heldout"], "--max-tokens", 60,
                             "--gen-tokens", 4, "--threads", 2, "--sweep-budget", "0.3,83%,unlimited",
                             "--sweep-dtype", "float32,bfloat16", "--out", tmp_path / "curve", "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert [r["dtype"] for r in results] == ["float32", "bfloat16"]
    for r in results:
        refused, tight, unlimited = r["points"]
        assert refused["dram_budget"] == 0.3 and "too small" in refused["refused"]
        assert tight["dram_bytes"] <= tight["budget_bytes"] and max(tight["cache_capacity"]) < 128
        assert tight["neurons_dropped_per_token"] > 0 and unlimited["neurons_dropped_per_token"] == 0
        assert tight["computed_recall"] < unlimited["computed_recall"]  # dropped neurons are misses
        assert unlimited["budget_bytes"] is None and unlimited["ppl_dense"] == tight["ppl_dense"]
    md = (tmp_path / "curve.md").read_text()
    assert md.count("refused: ") == 2 and md.count("| float32 |") == 3 and md.count("| bfloat16 |") == 3
    saved = json.loads((tmp_path / "curve.json").read_text())
    assert saved["results"][1]["points"][1]["ppl_ratio"] == results[1]["points"][1]["ppl_ratio"]
    assert (tmp_path / "curve.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    if (tmp_path / "curve.png").exists():
        assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_low_rank_predictor_through_the_native_mat_vec_equals_the_torch_path(tiny_models, tmp_path, monkeypatch):
    """A float16 model's low-rank predictor computes one token's logits by the native mat-vec (two kernel calls)
    where the kernels are present, equal to torch's products within float16 rounding; the same predicted sets."""
    from flashllm.backends import native
    from flashllm.converters import convert
    from tiny import write_random_predictors

    if native.library() is None:
        pytest.skip(f"no native kernels here: {native.describe()}")
    out = convert(tiny_models("llama").ckpt, tmp_path / "f16", dtype="float16", progress=False)
    write_random_predictors(out, rank=16)
    fast = flashllm.load(out, mode="sparse", predictor="lowrank")
    monkeypatch.setenv("FLASHLLM_NATIVE", "0")
    slow = flashllm.load(out, mode="sparse", predictor="lowrank")
    assert fast.backend.native is not None and slow.backend.native is None
    x = torch.randn(1, fast.spec.d_model, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    for layer in range(fast.spec.n_layers):
        calls = fast.backend.native.calls["linear"]
        got, ref = fast.predictor.scores(layer, x), slow.predictor.scores(layer, x)
        assert fast.backend.native.calls["linear"] == calls + 2 and got.dtype == ref.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=2e-3 * float(np.abs(ref).max()))
        close = np.abs(ref) < 2e-3 * float(np.abs(ref).max())  # a rounding apart from the threshold
        np.testing.assert_array_equal((got > 0)[~close], (ref > 0)[~close])


def test_eval_report_shows_small_flash_reads_in_their_unit_and_no_ratio_at_an_unlimited_budget():
    """A warm unlimited cache reads a few bytes per token: not '0.000 MiB (11892x fewer)' but the bytes, and
    why there is no steady-state ratio; a finite budget keeps its ratio against naive mode."""
    from predictors.report import format_point

    base = {"predictor": "lowrank", "dram_bytes": 3 * 2**20, "cache_capacity": [128, 128], "ppl_dense": 9.0,
            "ppl_sparse": 9.0, "ppl_ratio": 1.0, "top1_agreement": 1.0, "top1_agreement_tokens": 4,
            "top1_agreement_heldout": 1.0, "free_run_agreement": 1.0, "free_run_first_divergence": 4,
            "neurons_dropped_per_token": 0.0, "latency_ms_per_token": 1.0, "io_ms_per_token": 0.5,
            "computed_layers": []}
    naive = 18.08 * 2**20
    unlimited = format_point({**base, "dram_budget": None, "budget_bytes": None, "bytes_per_token": 1594.0,
                              "naive_over_sparse": naive / 1594})[3]
    assert "1.56 KiB" in unlimited and "fewer" not in unlimited and "first use" in unlimited
    half = format_point({**base, "dram_budget": 0.5, "budget_bytes": 2**22, "bytes_per_token": 256 * 1024.0,
                         "naive_over_sparse": naive / (256 * 1024)})[3]
    assert "256.00 KiB (72.3x fewer than naive)" in half


def test_eval_checks_its_out_directory_before_evaluating(tiny_models, texts, tmp_path, capsys, monkeypatch):
    """A sweep takes minutes to hours: a missing --out directory is refused before it, not after."""
    import predictors.evaluate

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    write_random_predictors(model_dir)
    monkeypatch.setattr(predictors.evaluate, "evaluate", lambda *a, **k: pytest.fail("evaluated before --out"))
    out = tmp_path / "nope" / "q"
    code, _, err = run_cli(capsys, "predictors", "eval", model_dir, "--data", texts["heldout"], "--out", out)
    assert code == 1 and err == f"flashllm: error: --out {out}: directory {out.parent} does not exist\n", err


def test_inspect_lists_trained_predictors_and_checks_them_as_load_does(tiny_models, tmp_path, capsys):
    """`inspect` checks the trained predictors beside the model as a sparse load with them does (their sha256
    in full, with or without --verify): it never passes predictors that load refuses."""
    from flashllm.format import manifest as fmt
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_META

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    write_random_predictors(model_dir)
    meta = json.loads((model_dir / PREDICTOR_META).read_text())
    meta["sha256"] = fmt.sha256_file(model_dir / PREDICTOR_FILE)
    (model_dir / PREDICTOR_META).write_text(json.dumps(meta))
    code, out, _ = run_cli(capsys, "inspect", model_dir, "--verify")
    assert code == 0 and PREDICTOR_FILE in out and PREDICTOR_META in out and "checksums verified: all" in out
    code, out, _ = run_cli(capsys, "inspect", model_dir)
    assert code == 0 and f"checksums verified: files up to 256 MiB, {PREDICTOR_FILE}" in out
    raw = bytearray((model_dir / PREDICTOR_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (model_dir / PREDICTOR_FILE).write_bytes(bytes(raw))
    with pytest.raises(flashllm.FlashLLMError, match="checksum mismatch") as refused:
        flashllm.load(model_dir, mode="sparse")  # the trained predictors are the default where they are
    for verify in ([], ["--verify"]):
        code, out, err = run_cli(capsys, "inspect", model_dir, *verify)
        assert code == 1 and err == f"flashllm: error: {refused.value}\n", (verify, err)
    assert str(refused.value) == f"{model_dir / PREDICTOR_FILE}: checksum mismatch (train the predictors again)"


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_bars_only_on_a_terminal(tiny_models, texts, capsys, tmp_path, monkeypatch, terminal):
    """`2>log`: the commands log their steps in lines, without tqdm's carriage-return updates; on a
    terminal the bars show (convert, predictors train with --order coactivation, predictors eval)."""
    import sys

    model_dir = own_copy(tiny_models, "opt", tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)  # capsys's stderr is not a terminal
    errs = []
    for argv in (["convert", tiny_models("opt").ckpt, tmp_path / "converted"],
                 ["predictors", "train", model_dir, "--data", texts["train"], "--rank", 4, "--max-tokens", 300,
                  "--epochs", 1, "--order", "coactivation"],
                 ["predictors", "eval", model_dir, "--data", texts["heldout"], "--max-tokens", 60, "--gen-tokens", 2]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        errs.append(err)
    if terminal:
        assert all("\r" in err for err in errs), errs
        logged = [line for line in errs[1].split("\n") if "layer 0: rank 4" in line]
        # written above the live train bar, not onto its line: nothing of the bar before it after the last \r
        assert logged and all(line.split("\r")[-1].startswith("layer 0: rank 4") for line in logged), logged
    else:
        assert not any("\r" in err for err in errs), errs
        assert "layer 0: rank 4" in errs[1]  # the log lines stay
