"""The sliding-window neuron cache against a reference set model (hypothesis)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm.backends.torch.backend import TorchBackend
from flashllm.io.reader import FlashIOError, FlashReader
from flashllm.format.manifest import FFNLayout
from flashllm.modes.sparse.neuron_cache import NeuronCache
from flashllm.format.spec import ArchSpec

D_FFN, D = 40, 8


@pytest.fixture(scope="module")
def ffn_file(tmp_path_factory):
    layout = FFNLayout(("up", "down"), D, D_FFN, 4, 2 * D * 4, (0,))
    data = np.random.default_rng(0).standard_normal((D_FFN, 2 * D)).astype(np.float32)
    path = tmp_path_factory.mktemp("cache") / "ffn.bin"
    data.tofile(path)
    return layout, data, path


def make_cache(ffn_file, capacity, dtype=None, compact=True):
    layout, _, _ = ffn_file
    spec = ArchSpec("test", 16, D, 1, 1, 1, D, D_FFN, 8)
    backend = TorchBackend(spec, "cpu", dtype, "float32", 8)
    up_bias = torch.arange(D_FFN, dtype=backend.dtype)
    return NeuronCache(capacity, D_FFN, backend.row_store(capacity, layout, {"up": up_bias}), compact)


def held_ids(cache) -> set:
    return set(cache.pointer[:cache.num_used].tolist()) - {-1}


def step(cache, reader, active, window):
    missing, k, dropped = cache.evict(np.asarray(sorted(active), dtype=np.int64), window)
    layout = cache.store.layout
    read = lambda ids, dest, rows: reader.read_rows(0, layout.stride, layout.stride, ids, dest, rows)  # noqa: E731
    cache.insert(missing, read)
    return k, dropped


def check_rows(cache, data):
    """The held rows hold their neurons' bundles and biases (all rows :num_used, or, `compact` False,
    those not emptied)."""
    n = cache.num_used
    rows, bias = cache.store.views(n)
    at = cache.held_rows()
    at = np.arange(n) if at is None else at
    assert cache.compact or len(at) == cache.held()
    rows, bias = {k: v[at] for k, v in rows.items()}, {k: v[at] for k, v in bias.items()}
    ids = cache.pointer[at]
    assert len(set(ids.tolist())) == len(at) and (ids >= 0).all()
    assert (cache.row_of[ids] == at).all()
    assert (cache.row_of >= 0).sum() == len(at)
    np.testing.assert_array_equal(rows["up"].float().numpy(), data[ids, :D])
    np.testing.assert_array_equal(rows["down"].float().numpy(), data[ids, D:])
    np.testing.assert_array_equal(bias["up"].float().numpy(), ids.astype(np.float32))


tokens = st.lists(st.tuples(st.sets(st.integers(0, D_FFN - 1), max_size=12), st.integers(1, 5)),
                  min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(tokens)
def test_cache_holds_exactly_the_window_union(ffn_file, seq):
    _, data, path = ffn_file
    cache = make_cache(ffn_file, D_FFN)
    ptr = cache.store.matrix.data_ptr()
    history, held = [], set()
    with FlashReader(path, threads=3) as reader:
        for active, window in seq:
            history.append(active)
            k, dropped = step(cache, reader, active, window)
            assert k == window and dropped == 0
            # evicted neurons come back only when active again, so a window that grows holds
            # what was held or is active now, within the union of the last k active sets
            held = (held | active) & set().union(*history[-window:])
            assert set(cache.pointer[:cache.num_used].tolist()) == held
            check_rows(cache, data)
    assert cache.store.matrix.data_ptr() == ptr  # never reallocated


@settings(max_examples=60, deadline=None)
@given(tokens, st.integers(4, 20), st.sampled_from([None, "bfloat16"]), st.booleans())
def test_small_cache_shrinks_the_window(ffn_file, seq, capacity, dtype, compact):
    _, data, path = ffn_file
    cache = make_cache(ffn_file, capacity, dtype, compact)
    history, held = [], set()
    with FlashReader(path, threads=2) as reader:
        for active, window in seq:
            history.append(active)
            k, dropped = step(cache, reader, active, window)
            cached = held_ids(cache)
            assert cache.num_used <= capacity and 1 <= k <= window and cache.held() == len(cached)
            assert dropped == max(0, len(active) - capacity)
            if not dropped:
                held = (held | active) & set().union(*history[-k:])
                assert cached == held and active <= cached
            held = cached
            if dtype is None:
                check_rows(cache, data)
            else:  # staged and converted rows: compare in the compute dtype
                rows, _ = cache.store.views(cache.num_used)
                at = np.flatnonzero(cache.pointer[:cache.num_used] >= 0)
                rows, ids = {k: v[at] for k, v in rows.items()}, cache.pointer[at]
                ref = torch.from_numpy(data[ids, :D]).to(torch.bfloat16)
                assert torch.equal(rows["up"], ref)


def read_ahead(cache, reader, guess, window):
    """A lookahead: room made for `guess` by the window rule, its missing bundles read into the freed rows."""
    ids = cache.reserve(np.asarray(sorted(guess), dtype=np.int64), window)
    rows = cache.free_rows(len(ids))
    layout = cache.store.layout
    reader.read_rows(0, layout.stride, layout.stride, ids, cache.store.landing(), rows)
    cache.store.placed(ids, rows)
    cache.append(ids)
    return ids


guessed = st.lists(st.tuples(st.sets(st.integers(0, D_FFN - 1), max_size=12),
                             st.sets(st.integers(0, D_FFN - 1), max_size=12), st.integers(1, 5)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(guessed, st.integers(4, 40), st.booleans(), st.booleans())
def test_read_ahead_into_freed_rows_keeps_the_window(ffn_file, seq, capacity, exact, compact):
    """Rows read ahead for a guessed set land in the rows `reserve` frees: a right guess leaves the
    cache holding at least what it would had the set been read when known (unless the window had to
    shrink the step before); a wrong one costs reads,
    never a wrong row, and its neurons leave the window at the next step."""
    _, data, path = ffn_file
    ahead, plain = make_cache(ffn_file, capacity, compact=compact), make_cache(ffn_file, capacity, compact=compact)
    history = []
    with FlashReader(path, threads=2) as reader:
        for guess, active, window in seq:
            active = set(sorted(active)[:capacity])
            guess = active if exact else set(sorted(guess)[:capacity])
            history.append(active)
            tight = ahead.tight  # (its window shrank last: reserve takes the least recently active rows)
            read = read_ahead(ahead, reader, guess, window)
            assert set(read.tolist()) <= guess and ahead.num_used <= capacity
            k, dropped = step(ahead, reader, active, window)
            step(plain, reader, active, window)
            cached = held_ids(ahead)
            assert dropped == 0 and active <= cached <= set().union(*history[-window:])
            check_rows(ahead, data)
            if exact and not tight:  # at least what it would hold had the set been read when known
                assert cached >= held_ids(plain)


def test_failed_read_marks_nothing_loaded(ffn_file, tmp_path):
    layout, data, path = ffn_file
    short = tmp_path / "short.bin"
    short.write_bytes(path.read_bytes()[: 10 * layout.stride])
    cache = make_cache(ffn_file, D_FFN)
    with FlashReader(short, threads=2) as reader:
        step(cache, reader, {1, 2}, 2)
        with pytest.raises(FlashIOError, match="outside the file"):
            step(cache, reader, {30, 31}, 2)
    assert set(cache.pointer[:cache.num_used].tolist()) == {1, 2}
    assert cache.row_of[30] == -1 and cache.row_of[31] == -1


@pytest.mark.parametrize("bundled", [True, False])
def test_a_layout_of_some_parts_reads_just_those(tmp_path, bundled):
    """`FFNLayout.only`: the gate rows stay resident, so a neuron's read is its up and down rows,
    into memory rows of those parts only; parts that are not adjacent in a bundle are refused."""
    from flashllm.errors import FlashLLMError
    from flashllm.io.ffn_reader import FFNReader

    parts, stride = ("gate", "up", "down"), 3 * D * 4 + 32  # a padded bundle
    full = FFNLayout(parts, D, D_FFN, 4, stride, (0,), bundled)
    values = np.random.default_rng(1).standard_normal((D_FFN, 3 * D)).astype(np.float32)
    raw = np.zeros((D_FFN, stride), np.uint8)
    raw[:, :3 * D * 4] = values.view(np.uint8)
    path = tmp_path / "ffn.bin"
    if bundled:
        raw.tofile(path)
    else:  # each part in its own region
        regions = np.zeros((3, full.part_region), np.uint8)
        for k in range(3):
            regions[k, :D_FFN * D * 4] = np.ascontiguousarray(values[:, k * D:(k + 1) * D]).view(np.uint8).ravel()
        regions.tofile(path)
    view = full.only(("up", "down"))
    assert view.parts == ("up", "down") and view.stride == 2 * D * 4 and view.layer_bytes == full.layer_bytes
    ids = np.array([3, 4, 17, 39])
    dest = np.zeros((len(ids), view.stride), np.uint8)
    reader = FFNReader(path, view, threads=1)
    try:
        io = reader.read(0, ids, dest, np.arange(len(ids)))
    finally:
        reader.close()
    np.testing.assert_array_equal(dest.view(np.float32), values[ids, D:])
    assert io.bytes_requested == len(ids) * view.stride
    with pytest.raises(FlashLLMError, match="not adjacent"):
        full.only(("gate", "down"))


@settings(max_examples=40, deadline=None)
@given(tokens, st.integers(6, 30), st.sets(st.integers(0, D_FFN - 1), min_size=1, max_size=5))
def test_pinned_neurons_stay_and_the_window_works_on_the_other_rows(ffn_file, seq, capacity, hot):
    _, data, path = ffn_file
    cache = make_cache(ffn_file, capacity)
    with FlashReader(path, threads=2) as reader:
        layout = cache.store.layout
        cache.pin(np.array(sorted(hot)), lambda ids, dest, rows: reader.read_rows(0, layout.stride, layout.stride,
                                                                                   ids, dest, rows))
        assert cache.pinned == len(hot) and set(cache.pointer[:len(hot)].tolist()) == hot
        history, held = [], set()
        for active, window in seq:
            history.append(active)
            k, dropped = step(cache, reader, active, window)
            assert set(cache.pointer[:len(hot)].tolist()) == hot  # never evicted, never moved
            cached = set(cache.pointer[:cache.num_used].tolist())
            assert cache.num_used <= capacity and dropped == max(0, len(active - hot) - (capacity - len(hot)))
            if not dropped:
                held = (held | active) & set().union(*history[-k:])
                assert cached == hot | held and active <= cached
            held = cached - hot
            check_rows(cache, data)
        cache.reset()  # a new sequence: the window's rows go, the pinned ones stay
        assert cache.num_used == len(hot) and set(np.flatnonzero(cache.row_of >= 0).tolist()) == hot
    with pytest.raises(ValueError, match="once per cache"):
        cache.pin(np.array([0]), None)


def test_pinned_rows_leave_the_window_its_expected_need():
    from flashllm.modes.sparse.neuron_cache import pinned_rows

    freq = np.array([0.9] * 10 + [0.02] * 90)
    h = pinned_rows(freq, 40, 4)
    cold = np.sort(freq)[::-1][h:]
    assert 10 <= h < 40 and h + cold.sum() <= 40  # the hot ones pinned, the rest fits a window of 1 at least
    assert pinned_rows(freq, 16, 4) >= 10  # the hot ones, and a window of one token (with a margin) for the rest
    assert pinned_rows(freq, 5, 4) == 0  # not even one token's expected set fits: nothing is pinned
    assert pinned_rows(freq, 100, 4) == 99  # a cache of the whole layer: all but the window's one row
    assert pinned_rows(np.zeros(100), 50, 4) == 0  # nothing is ever active: nothing worth a row
    assert [pinned_rows(freq, c, 4) for c in (20, 40, 60, 80)] == sorted(pinned_rows(freq, c, 4) for c in (20, 40, 60, 80))


def test_reserve_keeps_the_neurons_it_is_told_to_keep(ffn_file):
    """`reserve(guess, window, keep)` frees rows as if the next set were guess + keep, so a cached neuron in
    `keep` (likely needed, not read ahead) is not evicted for the guess; without `keep` it would be."""
    _, data, path = ffn_file
    with FlashReader(path, threads=2) as reader:
        kept, plain = make_cache(ffn_file, 6), make_cache(ffn_file, 6)
        for cache in (kept, plain):
            step(cache, reader, {0, 1, 2}, 2)
            step(cache, reader, {3, 4, 5}, 2)  # a full cache: 0, 1, 2 are the least recently active
        guess = np.array([6, 7, 8])
        assert list(plain.reserve(guess, 2)) == [6, 7, 8] and (plain.row_of[[0, 1, 2]] < 0).all()
        assert list(kept.reserve(guess, 2, keep=np.array([2, 30]))) == [6, 7, 8] and kept.row_of[2] >= 0
        assert kept.row_of[30] < 0 and (kept.row_of[[0, 1, 3]] < 0).all()  # kept, not read; the oldest others leave
        for cache in (kept, plain):  # the reads land; the cache stays whole
            read_ahead_rows = cache.free_rows(3)
            layout = cache.store.layout
            reader.read_rows(0, layout.stride, layout.stride, guess, cache.store.landing(), read_ahead_rows)
            cache.store.placed(guess, read_ahead_rows)
            cache.append(guess)
            check_rows(cache, data)
