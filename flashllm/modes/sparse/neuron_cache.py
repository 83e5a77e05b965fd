"""The sliding-window neuron cache of one layer (paper §3.3): bookkeeping shared by all backends.

Rows [:num_used] of a preallocated matrix hold the bundles of the neurons active in the last k
tokens; `pointer[row]` is the neuron id in that row. Per token: evict neurons not active in the
last k tokens, then read the new neurons' bundles straight into the rows they emptied and after
num_used; only live rows beyond the new end move into emptied rows (the paper moves the last rows
into every emptied one: a copy of each evicted row's worth of bytes per token), so rows[:num_used]
are whole again once the token's reads arrived. The matrix lives in a backend RowStore (move / fill / views).

Hot neurons (PowerInfer) may be pinned: rows [:pinned] hold a set of the layer's most frequently
active neurons, filled once (`pin`) and not evicted; the window works on the rows after them. A token
whose other neurons do not fit the rest releases the least frequent pinned ones (`unpin`), so
pinning never drops a neuron that a cache without it would hold. `pinned_rows` sizes the set from
the activation frequencies and the capacity.
"""

from __future__ import annotations

import numpy as np

NEVER = -(1 << 62)


SPREAD = 2.0  # margin of the window's rows, in standard deviations of one token's unpinned active set


def pinned_rows(freq: np.ndarray, capacity: int, window: int) -> int:
    """How many of a layer's most frequently active neurons to pin in a cache of `capacity` rows, from
    their activation frequencies: the count that minimises the expected reads per token. Neurons are
    taken as active independently, neuron i on a share f_i of tokens: unpinned, it is read when active
    and absent from the last k tokens (f_i (1 - f_i)^k per token), and it holds a window row with
    probability 1 - (1 - f_i)^k; k is the longest window up to `window` whose expected rows, plus SPREAD
    standard deviations of one token's unpinned set, fit beside the pinned ones (the cache shrinks its
    window the same way; a token whose unpinned set overflows the rest drops neurons, counted). At least
    one row is left to the window."""
    f = np.sort(np.clip(np.asarray(freq, dtype=np.float64), 0.0, 1.0))[::-1]
    count = np.arange(len(f) + 1)

    def suffix(v):  # [h]: the sum over the neurons left unpinned when the h most frequent are pinned
        return np.append(np.cumsum(v[::-1])[::-1], 0.0)

    misses = np.full(len(f) + 1, np.inf)
    spread = SPREAD * np.sqrt(suffix(f * (1.0 - f)))  # one token's active unpinned set varies by this much
    for k in range(1, window + 1):  # a longer window that fits reads less: the last that fits wins
        fits = count + suffix(1.0 - (1.0 - f) ** k) + spread <= capacity
        misses[fits] = suffix(f * (1.0 - f) ** k)[fits]
    misses[min(capacity, len(f) + 1):] = np.inf
    return int(np.argmin(misses)) if np.isfinite(misses).any() else 0

class NeuronCache:
    def __init__(self, capacity: int, d_ffn: int, store, compact: bool = True):
        """`compact` False: rows emptied by eviction stay empty until refilled, and no row moves; for a
        backend that computes the held rows by index (`held_rows`) instead of rows :num_used."""
        self.capacity, self.d_ffn, self.store, self.compact = capacity, d_ffn, store, compact
        self.pointer = np.full(capacity, -1, dtype=np.int64)  # neuron id held by each row
        self.row_of = np.full(d_ffn, -1, dtype=np.int64)  # row holding each neuron, -1 if absent
        self.last_active = np.full(d_ffn, NEVER, dtype=np.int64)  # last token each neuron was active
        self.pinned = 0  # rows [:pinned] hold pinned neurons (never evicted)
        self.num_used = 0
        self.token = -1
        self.tight = False  # the last token's window shrank: its sets did not fit the rows
        self._free = np.empty(0, dtype=np.int64)  # rows below num_used emptied by eviction, to be refilled

    def reset(self) -> None:
        """A new sequence: the window's rows are forgotten, pinned rows stay."""
        h = self.pinned
        held = self.pointer[h:self.num_used]
        self.row_of[held[held >= 0]] = -1
        self.pointer[h:] = -1
        self._free = self._free[:0]
        self.last_active[:] = NEVER
        self.num_used, self.token, self.tight = h, -1, False

    def pin(self, ids: np.ndarray, read, cost=None):
        """Read neurons `ids` (most valuable first) into rows 0.. and hold them until `unpin` (once, before
        the first token; fewer than the capacity, so that the window keeps a row). Returns the IOStats."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.pinned or len(ids) >= self.capacity:
            raise ValueError(f"pin {len(ids)} neurons: once per cache, and fewer than its {self.capacity} rows")
        self.reset()
        io = self.insert(ids, read, cost)
        self.pinned = len(ids)
        return io

    def unpin(self, count: int) -> None:
        """Release the last `count` pinned neurons (the least valuable) to the window, which evicts them
        by its rule from the next token on: for a token whose other neurons need more rows than are left."""
        self.pinned = max(0, self.pinned - count)

    def evict(self, active: np.ndarray, window: int) -> tuple[np.ndarray, int, int]:
        """Start a token with active neuron ids `active`: delete rows outside the window.

        Returns (missing neuron ids to append, sorted; the window actually used; neurons dropped
        because even the current token's set exceeds the capacity). The window shrinks for this
        token when the union of the last `window` tokens would not fit (paper App. C.3).
        """
        self.token += 1
        self.last_active[active] = self.token
        return self._make_room(active, window, self.token)

    def reserve(self, guess: np.ndarray, window: int, keep: np.ndarray | None = None) -> np.ndarray:
        """Before the next token's set is known: make room for the neurons of `guess` (an early
        prediction) that are not cached, in the rows of cached neurons outside the window that are in
        neither `guess` nor `keep` (neurons likely needed too, not read), least recently active first,
        then in free rows, then, where those are too few, in more such rows — as many as needed, no row
        moves; where the last token's window had to shrink (`tight`), all of them in such rows. Returns those neurons that fit, sorted: a read
        may land them in `free_rows(len(ids))`, and `append` marks them held once it has. `evict` then
        applies the window to the true set (a wrong guess leaves at once; a neuron evicted here that the
        true set needs is read again). Unless `tight`, an exact guess evicts only rows `evict` would, and
        never a row of the window `evict` keeps then, so the cache keeps at least what it would without it."""
        missing = np.sort(guess[self.row_of[guess] < 0])
        h, n = self.pinned, self.num_used
        ids = self.pointer[h:n]
        taken = np.zeros(self.d_ffn, dtype=bool)
        taken[guess] = True
        if keep is not None:
            taken[keep] = True
        rows = h + np.flatnonzero((ids >= 0) & ~taken[np.maximum(ids, 0)])
        rows = rows[np.argsort(self.last_active[self.pointer[rows]], kind="stable")]  # least recently active first
        # rows outside the window (evict frees them unless the true set needs them) before the free rows at
        # the end (new rows there leave live rows beyond the cache's next end: `evict` would move them), and
        # more only where the cache is short of rows
        stale = int((self.last_active[self.pointer[rows]] <= self.token + 1 - window).sum())
        if self.tight:  # the last token's sets overflowed the window: it will shrink, so take such rows for all
            stale = len(rows)
        count = max(min(stale, len(missing)), len(missing) - (self.capacity - n) - len(self._free))
        oldest = rows[:count]
        self.row_of[self.pointer[oldest]] = -1
        self.pointer[oldest] = -1
        self._free = np.sort(np.concatenate([self._free, oldest]))
        return missing[:self.capacity - n + len(self._free)]

    def _make_room(self, active: np.ndarray, window: int, t: int) -> tuple[np.ndarray, int, int]:
        """`evict`'s work for token `t`, whose set `active` is marked in last_active already."""
        n, h = self.num_used, self.pinned
        cached = self.pointer[h:n]  # the window's rows (pinned rows never leave); -1: an emptied row
        held = cached >= 0
        missing = np.sort(active[self.row_of[active] < 0])
        room = self.capacity - h
        k = window
        while True:
            keep = held & (self.last_active[cached] > t - k)
            if k == 1 or int(keep.sum()) + len(missing) <= room:
                break
            k -= 1
        n_keep = int(keep.sum())
        dropped = max(0, n_keep + len(missing) - room)
        if dropped:
            missing = missing[:len(missing) - dropped]
        # rows h..end-1 are in use once `missing` is appended: the neurons missing now take the emptied rows
        # below `end` (read straight into them), and only live rows beyond `end` move, into other emptied rows
        end = h + n_keep + len(missing)
        self.row_of[cached[held & ~keep]] = -1
        self.pointer[h + np.flatnonzero(~keep)] = -1
        self.tight = k < window
        if not self.compact:  # the emptied rows are refilled first, then rows from num_used on
            self._free = h + np.flatnonzero(~keep)
            return missing, k, dropped
        holes = h + np.flatnonzero(~keep[:end - h])
        movers = h + np.flatnonzero(keep)
        movers = movers[movers >= end]
        if len(movers):
            dst, holes = holes[:len(movers)], holes[len(movers):]
            self.store.move(dst, movers)
            self.pointer[dst] = self.pointer[movers]
            self.row_of[self.pointer[dst]] = dst
            self.pointer[movers] = -1
        self.num_used, self._free = min(n, end), holes
        return missing, k, dropped

    def insert(self, ids: np.ndarray, read, cost=None):
        """Read the bundles of `ids` into the free rows and mark them held: rows are only ever marked
        after their bundles arrived. Returns the store's IOStats (None when `ids` is empty)."""
        io = self.store.fill(read, ids, self.free_rows(len(ids)), cost)
        self.append(ids)
        return io

    def append(self, ids: np.ndarray) -> None:
        """Mark `ids` as held in `free_rows(len(ids))` (`insert` calls it once their bundles were read there)."""
        rows = self.free_rows(len(ids))
        self.pointer[rows] = ids
        self.row_of[ids] = rows
        refilled = min(len(ids), len(self._free))
        self._free = self._free[refilled:]
        self.num_used += len(ids) - refilled

    def held(self) -> int:
        """Neurons held (rows :num_used less the emptied ones not refilled yet)."""
        return self.num_used - len(self._free)

    def held_rows(self) -> np.ndarray | None:
        """The rows below num_used that hold a neuron, or None when they all do."""
        return np.flatnonzero(self.pointer[:self.num_used] >= 0) if len(self._free) else None

    def free_rows(self, count: int) -> np.ndarray:
        """The rows that the next `count` appended neurons will occupy: rows the last eviction emptied
        (sorted), then rows num_used.."""
        free = self._free[:count]
        return np.concatenate([free, np.arange(self.num_used, self.num_used + count - len(free))])
