"""What reproducible sampling costs in sparse mode, in one run: decode ms/token with each token's FFN over the
cache rows of its predicted neurons (the runtime) against over every cached row (patched in here for the
comparison: a result that depends on what earlier tokens and requests left in the cache), the two alternated
round by round; and how many distinct texts one seeded request gives after different earlier requests under each.

    python -m bench io reproducible [MODEL] --dram-budget 50% --dtype bfloat16 --rounds 6

MODEL: a flashllm model directory (default: the embedded model with its predictors).
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from bench.harness import load, spread

PROMPT = "def main():"
EARLIER = ("The quick brown fox", "import numpy as np\nx =", "class A:", "for i in range(10):",
           "while True:\n    ", "# a comment about", "print('hello", "return sum(")


def every_cached_row(cache, neurons: np.ndarray) -> np.ndarray:
    """The rows the FFN runs over in the comparison: every row of the cache that holds a neuron."""
    return np.flatnonzero(cache.pointer[:cache.num_used] >= 0)


def main(argv=None) -> dict:
    import flashllm
    from flashllm.modes.sparse import mode as sparse_mode

    args = setup_arg_parser().parse_args(argv)
    warnings.simplefilter("ignore")  # the load's budget and sparsity notes: not this benchmark's subject
    if args.model is None:
        from flashllm.embedded import prepare

        args.model = str(prepare())
    rows_of = {"predicted rows": sparse_mode.held_rows_of, "every cached row": every_cached_row}
    threads = {} if args.threads is None else {"threads": args.threads}
    models = {name: flashllm.load(args.model, mode="sparse", dram_budget=args.dram_budget, dtype=args.dtype,
                                  context=args.context, **threads) for name in rows_of}
    ms = {name: [] for name in rows_of}
    texts = {name: [] for name in rows_of}
    load_start = load()
    try:
        for r in range(args.rounds):
            for name, model in models.items():
                sparse_mode.held_rows_of = rows_of[name]
                model.generate(EARLIER[r % len(EARLIER)], max_new_tokens=args.tokens // 2, temperature=0.9, seed=r)
                t0 = time.perf_counter()
                texts[name].append(model.generate(PROMPT, max_new_tokens=args.tokens, temperature=args.temperature,
                                                  seed=args.seed))
                ms[name].append((time.perf_counter() - t0) * 1e3 / args.tokens)
    finally:
        sparse_mode.held_rows_of = rows_of["predicted rows"]
    result = {"model": args.model, "dram_budget": args.dram_budget, "dtype": args.dtype, "rounds": args.rounds,
              "tokens": args.tokens, "load_average": [load_start, load()],
              "ffn_overlap": models["predicted rows"].stats["ffn_overlap"],
              "kernels": models["predicted rows"].backend.kernels(),
              "runs": {name: {"ms_per_token": ms[name], "distinct_texts": len(set(texts[name]))} for name in rows_of}}
    print(f"{args.rounds} rounds of a request after a different earlier one ({args.tokens} tokens, temperature "
          f"{args.temperature}, seed {args.seed}; {args.dtype}, budget {args.dram_budget}; load "
          f"{load_start:.1f}-{load():.1f}):")
    base = np.median(ms["every cached row"])
    for name in rows_of:
        print(f"  FFN over {name:16s}: {spread(ms[name])} ms/token (median {np.median(ms[name]):.1f}, "
              f"{np.median(ms[name]) / base:.2f}x), {len(set(texts[name]))} distinct text(s) in {args.rounds}")
    return result


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="flashllm model directory (default: the embedded model)")
    p.add_argument("--dram-budget", default="50%", help="(default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default: %(default)s)")
    p.add_argument("--context", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="flash reads in flight (default: the runtime's)")
    p.add_argument("--rounds", type=int, default=6, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=24, help="generated tokens per timed request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=7)
    return p


if __name__ == "__main__":
    main()
