"""Where an MoE decode token goes on the CPU: native kernel calls, waits for flash reads, and the rest (Python and
torch glue: routing, the expert cache's bookkeeping, argument building, small torch ops).

Loads an MoE model in sparse mode at --budget, decodes --warmup tokens, then times --tokens tokens. Every call
into the native kernels (backends/native) is timed by a wrapper around the loaded library's entry points (this
process only; nothing in the runtime changes); the reader's waits are the token's io_ms. The rest of the wall
time is the overhead the issue bounds at 10% of the token.

    python -m bench moe overhead --model-dir DIR [--budget 0.25] [--tokens 8] [--warmup 4] [--quantize-resident int4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from flashllm.budget import parse_budget


class TimedLibrary:
    """The native kernels' entry points, each call timed into `seconds`."""

    def __init__(self, lib):
        self.seconds, self.calls, self._lib = 0.0, 0, lib

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not callable(fn):
            return fn

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def measure(args) -> dict:
    import flashllm

    model = flashllm.load(args.model_dir, mode="sparse", dram_budget=args.budget, context=64,
                          quantize_resident=args.quantize_resident, compute_threads=args.threads)
    B = model.backend
    if B.native is None:
        raise SystemExit("python -m bench moe overhead: the native kernels do not build here")
    timed = TimedLibrary(B.native.lib)
    B.native.lib = timed
    ids = np.random.default_rng(0).integers(3, model.spec.vocab_size, 4 + args.warmup + args.tokens).tolist()
    model._costs = []
    model.forward(ids[:4], 0)
    for i in range(args.warmup):
        model.forward([ids[4 + i]], 4 + i)
    rows = []
    for i in range(args.tokens):
        pos = 4 + args.warmup + i
        timed.seconds, timed.calls = 0.0, 0
        t0 = time.perf_counter()
        model.forward([ids[pos]], pos)
        wall = (time.perf_counter() - t0) * 1e3
        io = model._costs[-1].io_ms
        native = timed.seconds * 1e3
        rows.append({"wall_ms": wall, "native_ms": native, "io_wait_ms": io, "other_ms": wall - native - io,
                     "native_calls": timed.calls})
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return {"tokens": rows, "mean": mean, "other_share": mean["other_ms"] / mean["wall_ms"],
            "expert_slots": model.stats.get("expert_slots"), "kernels": B.kernels(), "budget": args.budget}


def markdown(result: dict) -> str:
    m = result["mean"]
    return (f"Mean of {len(result['tokens'])} decode tokens: wall {m['wall_ms']:.1f} ms = native kernels "
            f"{m['native_ms']:.1f} ms ({m['native_calls']:.0f} calls) + waits for reads {m['io_wait_ms']:.1f} ms + "
            f"the rest (Python, torch glue) {m['other_ms']:.1f} ms = **{100 * result['other_share']:.1f}%** of the token. "
            f"Expert slots: {result['expert_slots']}.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--budget", type=parse_budget, default=0.25)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantize-resident", default="int4", choices=["none", "int8", "int4"])
    args = p.parse_args(argv)
    result = measure(args)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
