"""The sliding-window neuron cache of one layer (paper §3.3): bookkeeping shared by all backends.

Rows [:num_used] of a preallocated matrix hold the bundles of the neurons active in the last k
tokens; `pointer[row]` is the neuron id in that row. Per token: evict neurons not active in the
last k tokens by moving the last used rows into their places, then append the new neurons'
bundles at num_used. The matrix itself lives in a backend RowStore (move / fill / views).
"""

from __future__ import annotations

import numpy as np

NEVER = -(1 << 62)


class NeuronCache:
    def __init__(self, capacity: int, d_ffn: int, store):
        self.capacity, self.d_ffn, self.store = capacity, d_ffn, store
        self.pointer = np.full(capacity, -1, dtype=np.int64)  # neuron id held by each row
        self.row_of = np.full(d_ffn, -1, dtype=np.int64)  # row holding each neuron, -1 if absent
        self.last_active = np.full(d_ffn, NEVER, dtype=np.int64)  # last token each neuron was active
        self.num_used = 0
        self.token = -1

    def reset(self) -> None:
        self.pointer[:] = -1
        self.row_of[:] = -1
        self.last_active[:] = NEVER
        self.num_used, self.token = 0, -1

    def evict(self, active: np.ndarray, window: int) -> tuple[np.ndarray, int, int]:
        """Start a token with active neuron ids `active`: delete rows outside the window.

        Returns (missing neuron ids to append, sorted; the window actually used; neurons dropped
        because even the current token's set exceeds the capacity). The window shrinks for this
        token when the union of the last `window` tokens would not fit (paper App. C.3).
        """
        self.token += 1
        t, n = self.token, self.num_used
        self.last_active[active] = t
        cached = self.pointer[:n]
        missing = np.sort(active[self.row_of[active] < 0])
        k = window
        while True:
            keep = self.last_active[cached] > t - k
            if k == 1 or int(keep.sum()) + len(missing) <= self.capacity:
                break
            k -= 1
        n_keep = int(keep.sum())
        dropped = max(0, n_keep + len(missing) - self.capacity)
        if dropped:
            missing = missing[:len(missing) - dropped]
        holes = np.flatnonzero(~keep[:n_keep])  # stale rows inside the part that stays
        movers = n_keep + np.flatnonzero(keep[n_keep:])  # live rows beyond it, moved into the holes
        self.row_of[cached[~keep]] = -1
        if len(holes):
            self.store.move(holes, movers)
            self.pointer[holes] = self.pointer[movers]
            self.row_of[self.pointer[holes]] = holes
        self.pointer[n_keep:n] = -1
        self.num_used = n_keep
        return missing, k, dropped

    def insert(self, ids: np.ndarray, read, cost=None):
        """Read the bundles of `ids` into the free rows and mark them held: rows are only ever marked
        after their bundles arrived. Returns the store's IOStats (None when `ids` is empty)."""
        io = self.store.fill(read, ids, self.free_rows(len(ids)), cost)
        self.append(ids)
        return io

    def append(self, ids: np.ndarray) -> None:
        """Mark `ids` as held in rows num_used.. (`insert` calls it once their bundles were read there)."""
        rows = np.arange(self.num_used, self.num_used + len(ids))
        self.pointer[rows] = ids
        self.row_of[ids] = rows
        self.num_used += len(ids)

    def free_rows(self, count: int) -> np.ndarray:
        """The rows that the next `count` appended neurons will occupy."""
        return np.arange(self.num_used, self.num_used + count)
