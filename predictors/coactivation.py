"""Co-activation ordering: a per-layer neuron order in which neurons read together are adjacent.

A sparse decode token reads the neurons it needs and its sliding-window cache lacks: its *loads*,
L_t = P_t & ~(P_{t-1} | ... | P_{t-window+1}) for predicted sets P. The flash engine merges neighbouring
bundles into one read, so a token costs one read per run of consecutive ids in L_t:

    reads_t = |L_t| - #{j : L_t holds both the neurons at positions j and j+1}

Summed over tokens, reads = sum_t |L_t| - sum_j C[o_j, o_{j+1}] with C[a, b] the number of tokens
loading both a and b (the co-load counts). Minimising reads is thus exactly finding an order o that
maximises the co-load weight between neighbours: a maximum-weight Hamiltonian path on C. `greedy_path`
solves it with the classic greedy edge heuristic (heaviest edges first, joining path ends without
closing a cycle; Ripple uses the same idea), on each neuron's `neighbours` heaviest edges, so a
7B layer (11008 neurons) needs no n^2 edge sort.
"""

from __future__ import annotations

import numpy as np

DEFAULT_NEIGHBOURS = 64
STATISTICS = ("loads", "active")  # what counts as "together": loaded by the same token, or active in it


def loads(pred: np.ndarray, window: int) -> np.ndarray:
    """The neurons each token of one sequence must read: predicted now, not predicted in the
    window-1 tokens before (bool [tokens, d_ffn] in, same out)."""
    held = np.zeros_like(pred)
    for j in range(1, window):
        held[j:] |= pred[:-j]
    return pred & ~held


class CoCounts:
    """Accumulates C = sum_t m_t m_t^T (co-occurrence counts) and per-neuron counts for one layer."""

    def __init__(self, d_ffn: int):
        self.pair = np.zeros((d_ffn, d_ffn), np.float32)  # exact up to 2^24 tokens
        self.single = np.zeros(d_ffn, np.float64)
        self.tokens = 0

    def add(self, masks: np.ndarray, step: int = 4096) -> None:
        for k in range(0, len(masks), step):
            m = masks[k:k + step].astype(np.float32)
            self.pair += m.T @ m  # counts < 2^24 per chunk: exact in float32
            self.single += m.sum(axis=0)
        self.tokens += len(masks)

    def reads_saved(self, order: np.ndarray) -> float:
        """Adjacent co-load weight of `order`: the reads it saves over fully scattered neurons."""
        return float(self.pair[order[:-1], order[1:]].sum())


def greedy_path(pair: np.ndarray, single: np.ndarray, neighbours: int = DEFAULT_NEIGHBOURS) -> np.ndarray:
    """A neuron order (permutation of range(n)) with heavy co-occurrence between neighbours.

    Edges: each neuron's `neighbours` heaviest partners, heaviest first; an edge joins two path ends
    of different paths. The paths are then laid out most-used first (ties: lowest id), so the order
    is deterministic; neurons never used keep their relative order at the end.
    """
    n = pair.shape[0]
    if n < 2:
        return np.arange(n)
    k = min(neighbours, n - 1)
    w = pair.copy()
    np.fill_diagonal(w, -1)
    part = np.argpartition(-w, k - 1, axis=1)[:, :k]
    rows = np.repeat(np.arange(n), k)
    cols = part.ravel()
    weight = w[rows, cols]
    keep = (weight > 0) & (rows != cols)
    a, b = np.minimum(rows, cols)[keep], np.maximum(rows, cols)[keep]
    edges = np.unique(np.stack([a, b], axis=1), axis=0)
    ew = w[edges[:, 0], edges[:, 1]]
    edges = edges[np.lexsort((edges[:, 1], edges[:, 0], -ew))]
    parent = list(range(n))
    degree = [0] * n
    link: list[list[int]] = [[] for _ in range(n)]

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in edges.tolist():
        if degree[i] >= 2 or degree[j] >= 2:
            continue
        ri, rj = root(i), root(j)
        if ri == rj:
            continue
        parent[ri] = rj
        degree[i] += 1
        degree[j] += 1
        link[i].append(j)
        link[j].append(i)
    seen = np.zeros(n, bool)
    paths = []
    for start in range(n):
        if seen[start] or degree[start] == 2:
            continue
        path, prev, cur = [], -1, start
        while cur != -1:
            path.append(cur)
            seen[cur] = True
            nxt = [x for x in link[cur] if x != prev]
            prev, cur = cur, (nxt[0] if nxt else -1)
        paths.append(path)
    paths.sort(key=lambda p: (-sum(single[q] for q in p), min(p)))
    order = np.array([q for p in paths for q in p], dtype=np.int64)
    assert len(order) == n and seen.all()
    return order


def layer_order(counts: CoCounts, neighbours: int = DEFAULT_NEIGHBOURS) -> tuple[np.ndarray, dict]:
    """One layer's order and what it is expected to save on the data it was computed from (the current
    order is kept when the greedy path would not save more: never worse on that data)."""
    order = greedy_path(counts.pair, counts.single, neighbours)
    total = float(counts.single.sum())
    identity = np.arange(len(order))
    before = total - counts.reads_saved(identity)
    after = total - counts.reads_saved(order)
    if after >= before:
        order, after = identity, before
    per_token = max(counts.tokens, 1)
    return order, {"bundles_per_token": round(total / per_token, 2),
                   "runs_per_token_before": round(before / per_token, 2),
                   "runs_per_token_after": round(after / per_token, 2)}
