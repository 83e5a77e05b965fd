"""Routing traces of the trained small MoE, and their replay onto a bigger MoE through `expert_routing`.

A model with random weights routes like a random number generator, so cache hit rates on a
Qwen3-30B-A3B-shaped random model say nothing about real routing. `record` runs the trained
small MoE (flashllm/data/tiny-moe: 4 layers, 16 experts, top-2) over held-out stdlib text in
flashllm's dense mode and stores, per token and layer, the experts its router picked, and the
"early guess" a prefetcher would make: layer m's router applied to layer m-1's FFN input (for
m = 0: to the last layer's FFN input of the same token). It is observed through the `ffn_input`
hook; nothing is patched. Text is cut into sequences of --seq-len tokens, each from an empty KV
cache starting with BOS.

`ReplayRouting` maps the trace onto a model with L layers, E experts and top-k (E / 16 = 4 k / 2
is not required; the mapping needs k = 4 * 2 = 8 or k = 2 with E >= 16):
- big layer j replays small layer j mod 4, on the trace shifted by (j div 4) * 131 tokens (so the
  10 blocks of 4 layers of a 40-layer model do not see the same text at once);
- small expert e becomes the k/2 big experts perm_j[e * k/2 : (e + 1) * k/2] (perm_j: a fixed
  random permutation of the big layer's experts), so a token's 2 experts become its k;
- decode token t of the run uses trace token t (wrapping); a prefetch guess (early=True) for
  layer j uses the recorded guess of the same small layer and token.
What this preserves: each layer's expert popularity and token-to-token reuse, as a cache sees
them (a big layer with C slots behaves as the small layer with C / (k/2) slots). What it does
not: only 16 * k/2 of the E experts of a big layer are ever routed to (64 of Qwen3-30B-A3B's 128),
and real 128-expert routing may be more or less concentrated than 16-expert routing.

    python -m bench models routing record flashllm/data/tiny-moe --out bench/results/models/tiny_moe_routing.npz --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import flashllm
from flashllm.modes.experts import ExpertCache, route
from flashllm.options import EXPERT_POLICIES as POLICIES

SHIFT = 131  # tokens between the trace windows of successive blocks of small-model layers


def record(model_dir: Path, tokens: int, seq_len: int) -> dict:
    """Routed experts and early guesses per layer for `tokens` held-out tokens: int16 [L, N, k] each."""
    from bench.models import stdlib_corpus

    with tempfile.TemporaryDirectory(prefix="flashllm-moe-trace-") as tmp:
        source = str(model_dir)
        if not (model_dir / "flashllm.json").is_file():  # an HF checkpoint: convert it first
            from flashllm.converters import convert

            model_dir = convert(model_dir, Path(tmp) / "model", dtype="float32", progress=False)
        model = flashllm.load(model_dir, mode="dense", dtype="float32", context=seq_len)
        spec, B = model.spec, model.backend
        text = "\n".join(t for _, t in stdlib_corpus.texts("heldout"))
        ids = model.tokenizer.encode(text, special=False)
        bos = spec.bos_token_id
        inputs: dict[int, np.ndarray] = {}
        routed, guessed = [], []
        with model.hooks.observing("ffn_input", lambda layer, x: inputs.__setitem__(layer, x)):
            for start in range(0, tokens, seq_len - 1):
                seq = [bos] + ids[start:start + min(seq_len - 1, tokens - start)]
                model.logits(seq, prefill=len(seq))
                logits = [B.to_host(B.linear(inputs[m], B.w[f"layers.{m}.router.weight"], None)) for m in range(spec.n_layers)]
                early = [B.to_host(B.linear(inputs[(m - 1) % spec.n_layers], B.w[f"layers.{m}.router.weight"], None))
                         for m in range(spec.n_layers)]
                routed.append(np.stack([route(lg, spec)[0][1:] for lg in logits]))  # BOS left out
                guessed.append(np.stack([route(lg, spec)[0][1:] for lg in early]))
        routed, guessed = np.concatenate(routed, axis=1), np.concatenate(guessed, axis=1)
    return {"routed": routed.astype(np.int16), "guessed": guessed.astype(np.int16),
            "meta": {"model": source, "tokens": int(routed.shape[1]), "seq_len": seq_len,
                     "n_layers": spec.n_layers, "n_experts": spec.n_experts, "top_k": spec.top_k,
                     "text": "bench/models/stdlib_corpus.py held-out files, joined"}}


def save(trace: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, routed=trace["routed"], guessed=trace["guessed"],
                        meta=np.frombuffer(json.dumps(trace["meta"]).encode(), dtype=np.uint8))
    tmp.replace(path)


def load(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as f:
        return {"routed": f["routed"].astype(np.int64), "guessed": f["guessed"].astype(np.int64),
                "meta": json.loads(f["meta"].tobytes().decode())}


def stats(trace: dict, window: int = 4) -> dict:
    """Per small layer: the largest expert share, the early guess's recall, and the share of a token's
    experts used by one of the previous `window` tokens (what a cache of recent experts can hit)."""
    r, g = trace["routed"], trace["guessed"]
    L, N, k = r.shape
    E = trace["meta"]["n_experts"]
    out = []
    for m in range(L):
        share = np.bincount(r[m].ravel(), minlength=E) / r[m].size
        recall = np.mean([len(np.intersect1d(r[m, t], g[m, t])) / k for t in range(N)])
        reuse = np.mean([len(np.intersect1d(r[m, t], r[m, t - window:t].ravel())) / k for t in range(window, N)])
        out.append({"layer": m, "max_expert_share": round(float(share.max()), 4),
                    "guess_recall": round(float(recall), 4), f"reused_from_prev{window}": round(float(reuse), 4)})
    return {"layers": out, "random_reuse": round(1 - (1 - k / E) ** window, 4)}


def simulate(trace: dict, capacities: list[int], policies: tuple[str, ...] = POLICIES, window: int = 4) -> list[dict]:
    """Expert-cache hit rates of the recorded decode routing, per policy and slots per layer: the runtime's
    own ExpertCache stepped token by token over each small layer's trace (what sparse mode would hit)."""
    r = trace["routed"]
    L, N, _ = r.shape
    out = []
    for policy in policies:
        for capacity in capacities:
            hits = total = 0
            for m in range(L):
                cache = ExpertCache(capacity, trace["meta"]["n_experts"], window, policy)
                for t in range(N):
                    active = cache.start(r[m, t:t + 1])
                    cached = cache.slot_of[active] >= 0
                    hits, total = hits + int(cached.sum()), total + len(active)
                    missing = active[~cached]
                    for k in range(0, len(missing), capacity):  # fewer slots than top-k: in chunks
                        chunk = missing[k:k + capacity]
                        cache.commit(chunk, cache.place(chunk, keep=chunk))
            out.append({"policy": policy, "slots": capacity, "hit_rate": round(hits / total, 4)})
    return out


class ReplayRouting:
    """An `expert_routing` for a model of n_layers x n_experts, top_k, replaying a recorded trace (see top)."""

    def __init__(self, trace: dict, n_layers: int, n_experts: int, top_k: int, seed: int = 0):
        r = trace["routed"]
        self.small_layers, self.tokens, small_k = r.shape
        small_e = trace["meta"]["n_experts"]
        if top_k % small_k or small_e * (top_k // small_k) > n_experts:
            raise ValueError(f"cannot replay top-{small_k} of {small_e} onto top-{top_k} of {n_experts}")
        self.trace, self.n_layers, self.copies = trace, n_layers, top_k // small_k
        rng = np.random.default_rng(seed)
        self.perm = [rng.permutation(n_experts) for _ in range(n_layers)]
        self.cursor = [0] * n_layers

    def big_ids(self, layer: int, small: np.ndarray) -> np.ndarray:
        """Small expert ids [T, k_small] -> this layer's big expert ids [T, k_small * copies]."""
        c = self.copies
        return self.perm[layer][(small[..., None] * c + np.arange(c)).reshape(len(small), -1)]

    def __call__(self, layer: int, logits: np.ndarray, early: bool) -> np.ndarray:
        T = len(logits)
        m, shift = layer % self.small_layers, (layer // self.small_layers) * SHIFT
        t = (self.cursor[layer] + shift + np.arange(T)) % self.tokens
        if not early:
            self.cursor[layer] += T
        return self.big_ids(layer, self.trace["guessed" if early else "routed"][m, t])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the trained small MoE's routing on held-out text")
    r.add_argument("model", help="flashllm model directory or HF checkpoint of the small MoE")
    r.add_argument("--out", required=True, help="trace file (.npz)")
    r.add_argument("--tokens", type=int, default=2048, help="held-out tokens (default: %(default)s)")
    r.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    i = sub.add_parser("info", help="per-layer statistics of a trace and simulated expert-cache hit rates")
    i.add_argument("trace")
    i.add_argument("--slots", default="1,2,3,4,6,8", help="slots per layer to simulate (default: %(default)s)")
    args = p.parse_args(argv)
    if args.cmd == "record":
        trace = record(Path(args.model), args.tokens, args.seq_len)
        save(trace, Path(args.out))
        print(json.dumps({**trace["meta"], **stats(trace)}, indent=1))
    else:
        trace = load(Path(args.trace))
        sim = simulate(trace, [int(c) for c in args.slots.split(",")])
        print(json.dumps({**trace["meta"], **stats(trace)}, indent=1))
        slots = sorted({r["slots"] for r in sim})
        print("\n| policy | " + " | ".join(f"{c} slots" for c in slots) + " |\n|---|" + "---|" * len(slots))
        for policy in dict.fromkeys(r["policy"] for r in sim):
            rates = {r["slots"]: r["hit_rate"] for r in sim if r["policy"] == policy}
            print(f"| {policy} | " + " | ".join(f"{rates[c]:.3f}" for c in slots) + " |")
        rng, (L, N, k), E = np.random.default_rng(0), trace["routed"].shape, trace["meta"]["n_experts"]
        uniform = {"routed": np.stack([[rng.choice(E, k, replace=False) for _ in range(N)] for _ in range(L)]),
                   "meta": trace["meta"]}
        rates = {r["slots"]: r["hit_rate"] for r in simulate(uniform, slots, ("lru",))}
        print("| lru, uniform random routing | " + " | ".join(f"{rates[c]:.3f}" for c in slots) + " |")


if __name__ == "__main__":
    main()
