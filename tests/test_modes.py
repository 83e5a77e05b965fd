"""The modes beyond the parity runner (tests/test_parity.py: every mode reproduces dense in every family):
read-ahead, budgets and cache sizes, pinned neurons, predictor choices; bytes read per token follow each
mode's rule."""

import numpy as np
import pytest

import flashllm
from flashllm.format import manifest as fmt

rng = np.random.default_rng(0)
IDS = [int(t) for t in rng.integers(3, 96, size=40)]  # an 8-token prompt, then 32 decode steps
PREFILL = 8


@pytest.fixture(scope="module")
def dense_logits():
    cache = {}

    def get(tiny):
        if tiny.family not in cache:
            cache[tiny.family] = flashllm.load(tiny.model_dir, mode="dense").logits(IDS, prefill=PREFILL)
        return cache[tiny.family]

    return get


def test_read_ahead_pauses_for_layers_whose_lookahead_misses(tiny_models, dense_logits):
    """A layer reads ahead only the neurons above the lowest cut whose running precision clears
    `read_ahead_precision`; with none, the lookahead is still predicted and measured, and nothing changes the result."""
    tiny = tiny_models("opt")
    kw = dict(mode="sparse", predictor="oracle", window=2, threads=2, read_ahead=True)
    model = flashllm.load(tiny.model_dir, **kw, read_ahead_precision=1.01)  # no cut is precise enough: all paused
    np.testing.assert_allclose(model.logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4, rtol=1e-4)
    stats = model.stats
    assert stats["neurons_read_ahead"] == 0 and stats["read_ahead_recall"] is not None
    assert stats["read_ahead_paused"] == list(range(model.spec.n_layers))  # (layer 0 has no lookahead: never measured)
    model = flashllm.load(tiny.model_dir, **kw, read_ahead_precision=0.0)  # any lookahead will do: the lowest cut
    np.testing.assert_allclose(model.logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4, rtol=1e-4)
    assert (model.stats["neurons_read_ahead"] > 0) == model.predictor.selective and not model.stats["read_ahead_paused"]
    assert model.stats["read_ahead_cut"] == [0] * model.spec.n_layers
    precision = model.stats["read_ahead_precision_per_layer"]  # of the lookahead's named neurons, the right ones
    assert precision[0] is None and all(0 <= p <= 1 for p in precision[1:])


def test_a_missing_lookahead_costs_reads_and_the_cut_bounds_them(tiny_models):
    """Read ahead into cache rows, a wrong guess evicts rows the layer then needs and names neurons it
    does not: they are read again or for nothing (more loads and bytes, never a different result); the
    precision cut reads ahead only the part of a layer's lookahead that keeps being right."""
    tiny = tiny_models("opt")
    runs = {}
    for name, kw in (("off", dict(read_ahead=False)), ("cut", {}), ("always", dict(read_ahead_precision=0.0))):
        model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=8, threads=2,
                              cache_rows=(80, 80), **kw)
        runs[name] = (model.logits(IDS, prefill=PREFILL), model.stats)
    off, cut, always = (runs[k][1] for k in ("off", "cut", "always"))
    for logits, _ in runs.values():
        np.testing.assert_allclose(logits, runs["off"][0], atol=1e-4, rtol=1e-4)
    assert always["read_ahead_recall"] < 0.9 and always["read_ahead_unused"] > 0  # the oracle's guess from layer 0
    assert always["read_ahead_unused"] / always["neurons_read_ahead"] > cut["read_ahead_unused"] / max(cut["neurons_read_ahead"], 1)
    assert sum(always["neurons_loaded_per_layer"]) > sum(cut["neurons_loaded_per_layer"])
    assert always["bytes_read"] > cut["bytes_read"] and always["bytes_read"] > off["bytes_read"]


def test_submitting_the_read_ahead_counts_as_io_not_compute(tiny_models, monkeypatch):
    """Building and submitting reads is I/O (an io_submit sleeps while the disk's queue is full): every
    FFN read submitted during a forward, the read-ahead's included, is inside the forward's io_ms."""
    import time

    from flashllm.io.ffn_reader import FFNReader

    tiny = tiny_models("opt")
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=2, threads=2, read_ahead=True)
    calls, real = [], FFNReader.submit

    def slow_submit(self, *a, **k):
        calls.append(1)
        time.sleep(0.01)
        return real(self, *a, **k)

    monkeypatch.setattr(FFNReader, "submit", slow_submit)
    model.logits(IDS[:PREFILL + 6], prefill=PREFILL)
    assert model.stats["neurons_read_ahead"] > 0
    io_ms = sum(c["io_ms"] for c in model.token_stats)
    assert io_ms >= 10.0 * len(calls) > 0


def test_reaping_the_read_ahead_counts_as_io_not_compute(tiny_models, monkeypatch):
    """The read-ahead's completions reaped at sublayer boundaries (without waiting) are I/O: each such poll is
    inside the forward's io_ms."""
    import time

    from flashllm.io.ffn_reader import PendingNeurons

    tiny = tiny_models("opt")
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=2, threads=2, read_ahead=True)
    calls, real = [], PendingNeurons.done

    def slow_done(self):
        calls.append(1)
        time.sleep(0.01)
        return real(self)

    monkeypatch.setattr(PendingNeurons, "done", slow_done)
    model.logits(IDS[:PREFILL + 6], prefill=PREFILL)
    assert model.stats["neurons_read_ahead"] > 0
    io_ms = sum(c["io_ms"] for c in model.token_stats)
    assert io_ms >= 10.0 * len(calls) > 0


def test_read_ahead_through_a_buffer_matches_reading_when_known(tiny_models):
    """Where reads cannot land in cache rows (compute dtype != storage), read-ahead goes through a buffer."""
    tiny = tiny_models("opt")
    ref = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dtype="bfloat16", threads=2,
                        read_ahead=False).logits(IDS, prefill=PREFILL)
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dtype="bfloat16", threads=2, read_ahead=True)
    np.testing.assert_allclose(model.logits(IDS, prefill=PREFILL), ref, atol=2e-2, rtol=2e-2)
    assert model.stats["read_ahead"] == "via a buffer" and model.stats["neurons_read_ahead"] > 0


def test_read_ahead_reads_no_more_than_the_cache_keeps(tiny_models):
    """A lookahead set larger than the layer's cache is cut as `_fit` cuts the layer's own set: neurons
    that would be dropped are not read ahead for nothing."""
    tiny = tiny_models("opt")
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", window=2, threads=2, read_ahead=True,
                          cache_rows=(8, 8))
    model.logits(IDS, prefill=PREFILL)
    stats = model.stats
    assert stats["neurons_dropped"] > 0  # the oracle's sets overflow 8 rows
    assert 0 < stats["neurons_read_ahead"] <= 8  # per token: layer 1 only (layer 0 has none), at most its cache


def test_bytes_per_token_by_mode(tiny_models):
    tiny = tiny_models("opt")
    m = fmt.read_manifest(tiny.model_dir)
    lay, files = m.layout, m.data["files"]
    naive = flashllm.load(tiny.model_dir, mode="naive", threads=2)
    naive.logits(IDS[:12], prefill=4)
    layer_resident = sum(int(np.prod(s)) * 4 for n, s in fmt.resident_shapes(m.spec).items() if n.startswith("layers."))
    assert naive.stats["bytes_read"] - naive.stats["bytes_wasted"] == lay.file_size + layer_resident
    hybrid = flashllm.load(tiny.model_dir, mode="hybrid", hybrid_fraction=0.25, threads=2)
    hybrid.logits(IDS[:12], prefill=4)
    streamed = lay.d_ffn - int(0.25 * lay.d_ffn)
    assert hybrid.stats["bytes_read"] - hybrid.stats["bytes_wasted"] == m.spec.n_layers * streamed * lay.stride
    sparse = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", threads=2)
    sparse.logits(IDS[:12], prefill=4)
    assert sparse.stats["bytes_read"] < hybrid.stats["bytes_read"] < naive.stats["bytes_read"]
    assert files["ffn"]["size"] == lay.file_size


def test_budget_sizes_the_caches_and_is_reported(tiny_models):
    tiny = tiny_models("opt")
    full = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle")
    budget = full.backend.nbytes() + 2 * 40 * full.compute_row_bytes()  # 40 rows per layer
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dram_budget=budget, window=8,
                          read_ahead=False)
    assert model.stats["cache_capacity"] == [40, 40]
    ahead = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dram_budget=budget, window=8,
                          read_ahead=True)
    assert ahead.stats["cache_capacity"] == [40, 40] and ahead.stats["read_ahead_rows"] == 0  # into the rows the caches free
    ahead.logits(IDS, prefill=PREFILL)
    assert ahead.stats["dram_bytes"] <= budget and ahead.stats["read_ahead_recall"] > 0
    assert ahead.stats["neurons_read_ahead"] > 0 and ahead.stats["read_ahead"] == "into cache rows"
    # rows that cannot take reads directly (a compute dtype other than the storage's): a buffer of its own
    full = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dtype="bfloat16")
    budget16 = full.backend.nbytes() + 2 * 40 * full.compute_row_bytes() + full.memory()[0]
    with_buffer = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", dram_budget=budget16, window=8,
                                read_ahead=True, dtype="bfloat16")
    assert 0 < with_buffer.stats["read_ahead_rows"] and max(with_buffer.stats["cache_capacity"]) < 40  # the read-ahead buffer
    with_buffer.logits(IDS, prefill=PREFILL)  # counts against the same budget
    assert with_buffer.stats["dram_bytes"] <= budget16 and with_buffer.stats["read_ahead_recall"] > 0
    assert with_buffer.stats["read_ahead"] == "via a buffer"
    model.logits(IDS, prefill=PREFILL)
    stats = model.stats
    assert stats["dram_bytes"] <= budget
    assert max(stats["neurons_cached_per_layer"]) <= 40


def test_budget_too_small(tiny_models):
    tiny = tiny_models("llama")
    for mode in ("sparse", "hybrid", "naive"):
        with pytest.raises(flashllm.FlashLLMError, match="too small"):
            flashllm.load(tiny.model_dir, mode=mode, predictor="oracle", dram_budget=0.01)


def test_window_must_be_positive(tiny_models):
    with pytest.raises(flashllm.FlashLLMError, match="window"):
        flashllm.load(tiny_models("opt").model_dir, mode="sparse", predictor="oracle", window=0)


def test_lowrank_without_predictors(tiny_models):
    with pytest.raises(flashllm.FlashLLMError, match="predictors train"):
        flashllm.load(tiny_models("opt").model_dir, mode="sparse", predictor="lowrank")


def test_unbundled_layout_reads_each_part_separately(tiny_models, tmp_path, dense_logits):
    from flashllm.converters import convert

    tiny = tiny_models("llama-relu")
    out = convert(tiny.ckpt, tmp_path / "unbundled", dtype="float32", bundled=False, progress=False)
    assert not fmt.read_manifest(out).layout.bundled
    np.testing.assert_allclose(flashllm.load(out).logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4)
    bundled = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", threads=2)
    split = flashllm.load(out, mode="sparse", predictor="oracle", threads=2)
    np.testing.assert_allclose(split.logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4, rtol=1e-4)
    bundled.logits(IDS, prefill=PREFILL)
    assert split.stats["reads"] > bundled.stats["reads"]  # three parts, three reads per neuron


def test_gate_predictor_for_relu_gated_models(tiny_models, dense_logits):
    tiny = tiny_models("llama-fatrelu")
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="gate", threads=2)
    np.testing.assert_allclose(model.logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4, rtol=1e-4)
    assert model.stats["predictor"] == "gate" and model.predictor.nbytes() > 0
    with pytest.raises(flashllm.FlashLLMError, match="gated FFN with a sparse activation"):
        flashllm.load(tiny_models("llama").model_dir, mode="sparse", predictor="gate")


def test_lowrank_predictors_of_other_weights_are_refused(tiny_models, tmp_path):
    import shutil

    from tiny import write_random_predictors

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models("opt").model_dir, model_dir)
    write_random_predictors(model_dir, trained_for="0" * 64)
    with pytest.raises(flashllm.FlashLLMError, match="trained for different weights"):
        flashllm.load(model_dir, mode="sparse", predictor="lowrank")
    own = fmt.read_manifest(model_dir).data["files"]["ffn"]["sha256"]
    write_random_predictors(model_dir, trained_for=own)
    assert flashllm.load(model_dir, mode="sparse", predictor="lowrank").predictor.kind == "lowrank"


def test_cache_rows_follow_each_layers_need():
    from flashllm.budget import split_rows

    assert split_rows(100, [1.0, 1.0], 80) == [50, 50]
    assert split_rows(100, [3.0, 1.0], 60) == [60, 40]  # the capped layer's share goes to the other
    assert split_rows(50, [0.7, 0.1, 0.2], 1000) == [35, 5, 10]
    assert split_rows(500, [1.0, 1.0], 100) == [100, 100]
    assert sum(split_rows(97, [0.3, 0.3, 0.4], 1000)) == 97


def test_pinned_hot_neurons_keep_the_result_and_save_reads(tiny_models, dense_logits, tmp_path):
    """Frequencies measured on the run itself, pinned at a budget that holds part of each FFN: the same
    logits as dense (pinned rows are computed like cached ones), fewer bytes than without pinning."""
    import shutil

    from flashllm.modes.sparse.predictor import PREDICTOR_FILE
    from flashllm.format.safetensors_io import write_safetensors

    tiny = tiny_models("opt")
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model_dir)
    counts, tokens = {}, [0]
    ref = flashllm.load(model_dir, mode="sparse", predictor="oracle")

    def count(layer, mask):
        counts[layer] = counts.get(layer, 0) + mask.sum(axis=0)
        tokens[0] += len(mask) * (layer == 0)

    with ref.hooks.observing("predict", count):
        ref.logits(IDS, prefill=PREFILL)
    freqs = {f"layers.{i}.freq": (c / tokens[0]).astype(np.float32) for i, c in counts.items()}
    write_safetensors(model_dir / PREDICTOR_FILE, [(n, "float32", f.shape) for n, f in freqs.items()], freqs.__getitem__)
    spec = fmt.read_manifest(model_dir).spec
    runs = {pin: flashllm.load(model_dir, mode="sparse", predictor="oracle", cache_rows=(spec.d_ffn * 3 // 4,) * spec.n_layers,
                               window=2, threads=2, pin_hot=pin) for pin in (True, False)}
    for pin, model in runs.items():
        np.testing.assert_allclose(model.logits(IDS, prefill=PREFILL), dense_logits(tiny), atol=1e-4, rtol=1e-4)
        pinned = model.stats["pinned_neurons"]
        assert (min(pinned) > 0) if pin else not any(pinned)
    assert runs[True].stats["bytes_read"] < runs[False].stats["bytes_read"]


@pytest.mark.parametrize("family, predictor", [("opt", "oracle"), ("llama-fatrelu", "oracle"), ("llama-fatrelu", "gate")])
def test_overlap_inside_a_layer_changes_only_the_summation_order(tiny_models, tmp_path, family, predictor):
    """float16 files in float16 with the native kernels: a decode layer's held rows are computed while its
    missing rows are read into the others, then the new rows, summed in float32 (`_compute_split`). The
    logits equal the unsplit run's up to float32 summation order, and the oracle's equal dense's."""
    from flashllm.backends import native
    from flashllm.converters import convert

    if native.library() is None:
        pytest.skip("no native kernels (no C compiler)")
    tiny = tiny_models(family)
    out = convert(tiny.ckpt, tmp_path / "f16", dtype="float16", progress=False)
    dense = flashllm.load(out, mode="dense").logits(IDS, prefill=PREFILL)
    runs = {}
    for split in (True, False):  # read_ahead=False turns the overlap off (read-ahead itself never changes a result)
        model = flashllm.load(out, mode="sparse", predictor=predictor, window=2, threads=2, cache_rows=(90, 90),
                              **({} if split else dict(read_ahead=False)))
        assert model.stats["ffn_overlap"] == split
        runs[split] = (model.logits(IDS, prefill=PREFILL), model.backend.native.calls["ffn"], model.stats)
    (a, calls_split, stats), (b, calls_one, _) = runs[True], runs[False]
    assert calls_split > calls_one  # two kernel calls for a layer with reads
    assert stats["neurons_dropped"] == 0 and sum(stats["neurons_loaded_per_layer"]) > 0
    # each layer's float32 sum is rounded to float16: an order difference may flip its last bit, and
    # 40 tokens of layers carry that on (the two-call sum itself: tests/test_native.py)
    np.testing.assert_allclose(a, b, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(a, dense, atol=2e-2, rtol=2e-2)
    assert not flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle").stats["ffn_overlap"]  # float32: copies


def test_sampling_does_not_depend_on_earlier_requests(tiny_models, tmp_path):
    """The same prompt and seed give the same tokens (and logits, bit for bit) whatever ran before: each token's
    FFN is over its predicted neurons only, never over what earlier tokens or requests left in the cache, and a
    prompt's sum does not depend on how many pinned neurons earlier tokens released."""
    import shutil

    from tiny import write_random_predictors

    tiny = tiny_models("opt")
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model_dir)
    write_random_predictors(model_dir, frequencies=True)  # a predictor that misses neurons, and pinned hot ones
    kw = dict(mode="sparse", predictor="lowrank", window=4, threads=2, cache_rows=(100, 100))
    prompt, others = IDS[:PREFILL], [IDS[8:20], IDS[20:26], IDS[26:40]]
    sample = dict(max_new_tokens=16, temperature=1.0, seed=11)

    fresh = flashllm.load(model_dir, **kw)
    want_ids, want_logits = list(fresh.generate_ids(prompt, **sample)), fresh.logits(IDS, prefill=PREFILL)
    model = flashllm.load(model_dir, **kw)
    for other in others:
        list(model.generate_ids(other, **dict(sample, seed=len(other))))
        assert list(model.generate_ids(prompt, **sample)) == want_ids
        assert np.array_equal(model.logits(IDS, prefill=PREFILL), want_logits)
    assert min(model.stats["pinned_neurons"]) > 0


def test_rows_held_are_computed_while_the_read_ahead_lands(tiny_models, tmp_path, monkeypatch):
    """float16 with the native kernels: a layer whose read-ahead is still in flight computes the rows it holds
    first, then the rows read ahead, then its missing rows as they land: the oracle's logits equal dense's
    and the run's without that step up to float32 summation order, and each such layer makes one more call."""
    from flashllm.backends import native
    from flashllm.converters import convert
    from flashllm.modes.sparse.read_ahead import ReadAhead

    if native.library() is None:
        pytest.skip("no native kernels (no C compiler)")
    out = convert(tiny_models("opt").ckpt, tmp_path / "f16", dtype="float16", progress=False)
    dense = flashllm.load(out, mode="dense").logits(IDS, prefill=PREFILL)
    real = ReadAhead.landing
    landing = []

    def always(self, layer, cost):  # as if every read ahead were slower than the layer before it
        ok = self.pending is not None and self.pending.layer == layer and self.pending.read is not None
        landing.append(ok)
        real(self, layer, cost)
        return ok

    monkeypatch.setattr(ReadAhead, "landing", always)
    runs = {}
    for early in (True, False):
        model = flashllm.load(out, mode="sparse", predictor="oracle", window=2, threads=2, cache_rows=(90, 90),
                              read_ahead_precision=0.0)
        model.mode_impl.early_held = early
        runs[early] = (model.logits(IDS, prefill=PREFILL), model.backend.native.calls["ffn"])
    assert any(landing) and model.stats["neurons_read_ahead"] > 0
    (a, calls_early), (b, calls) = runs[True], runs[False]
    assert calls_early > calls
    np.testing.assert_allclose(a, b, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(a, dense, atol=2e-2, rtol=2e-2)
