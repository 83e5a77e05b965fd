"""Quality and flash bytes of quantized storage on the embedded model, against float32 in one run.

    python bench/stdlib_corpus.py --split heldout --out /tmp/heldout.txt
    python bench/quant_quality.py --data /tmp/heldout.txt [--max-tokens 4096] [--groups 64 32] [--out FILE.md]

Converts flashllm/data/tiny-opt (or --model) to float32, float16, and int8/int4 bundles for each
group size (resident tensors float32 on flash) into a temporary directory, removed at the end; the
rows marked "+ resident" / "KV int8" load a model with `quantize_resident` / `kv_bits=8`. Per row:
- perplexity over the held-out tokens (dense mode, teacher-forced; sparse mode with the oracle
  predictor computes exactly the same), ratio to float32;
- greedy top-1 agreement: float32 generates `--gen-tokens` tokens greedily from a held-out prompt;
  the quantized model reads the same tokens and predicts each next one (fraction equal);
- flash bytes per decode token in sparse mode (oracle predictor, window 4, unlimited cache) over
  that same sequence, and its ratio to float16 bundles;
- with --budget (the demo's setting: 0.5, bfloat16 compute): perplexity in sparse mode with the
  oracle predictor at that budget (a fraction of the float32 model: the same bytes for every row)
  and dtype, over the first --budget-tokens held-out tokens, each sequence decoded token by token:
  what quantization costs where the user runs it (neurons the caches cannot hold are dropped;
  quantized resident matrices leave more room for the caches).
"""
import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flashllm  # noqa: E402
from flashllm.converters import convert  # noqa: E402
from flashllm.predictors import collect  # noqa: E402
from flashllm.predictors.evaluate import _greedy as greedy, _nll as nll  # noqa: E402  (the same measures)


def measure(model_dir: Path, chunks, prompt, gen, window: int, opts: dict, budget, budget_tokens: int,
            with_bytes: bool = True) -> dict:
    """Dense perplexity and top-1 agreement; flash bytes per token for stored variants (load options do
    not change what is read); sparse perplexity at `budget` if given."""
    dense = flashllm.load(model_dir, **opts)
    losses = np.concatenate([nll(dense.logits(c)[:-1], c[1:]) for c in chunks])
    seq = prompt + gen
    follow = np.argmax(dense.logits(seq[:-1])[len(prompt) - 1:], axis=1) == np.array(gen)
    out = {"ppl": float(math.exp(losses.mean())), "top1_agreement": float(follow.mean()),
           "ffn_file_bytes": (model_dir / "ffn.bin").stat().st_size, "scored_tokens": int(len(losses)),
           "dram_bytes_dense": dense.stats["dram_bytes"]}
    if not opts and with_bytes:
        sparse = flashllm.load(model_dir, mode="sparse", predictor="oracle", window=window)
        sparse.logits(seq, prefill=len(prompt))
        out.update(bytes_per_token=sparse.stats["bytes_read"], decode_tokens=sparse.stats["decode_tokens"])
    if budget is not None:  # sparse, oracle, at the user's budget and dtype: token by token
        at = flashllm.load(model_dir, mode="sparse", predictor="oracle", window=window, dram_budget=budget,
                           dtype="bfloat16", **opts)
        scored, dropped, n = [], 0.0, 0
        for c in chunks:
            if n >= budget_tokens:
                break
            scored.append(nll(at.logits(c, prefill=1)[:-1], c[1:]))
            dropped += at.stats["neurons_dropped"] * at.stats["decode_tokens"]
            n += len(c) - 1
        out.update(budget_ppl=float(math.exp(np.concatenate(scored).mean())), budget_tokens=n,
                   budget_dropped_per_token=dropped / n, budget_capacity=sum(at.plan.capacities))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "flashllm/data/tiny-opt", help="HF checkpoint")
    ap.add_argument("--data", type=Path, required=True, help="held-out text file")
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens scored (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens compared (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="(default: %(default)s)")
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 32], help="group sizes (default: %(default)s)")
    ap.add_argument("--window", type=int, default=4, help="sparse window (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=None, help="also measure sparse mode (oracle) at this DRAM "
                    "budget in bfloat16, as the demo runs (e.g. 0.5) (default: off)")
    ap.add_argument("--budget-tokens", type=int, default=256, help="held-out tokens scored at --budget "
                    "(default: %(default)s)")
    ap.add_argument("--no-bytes", action="store_true", help="skip the flash-bytes measurement (default: off)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and JSON beside it)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="quant-quality-"))
    try:
        stored = [("float32", "float32", "none", 64), ("float16", "float16", "none", 64)]
        stored += [(f"{q} g{g}", "float32", q, g) for q in ("int8", "int4") for g in args.groups]
        dirs = {name: convert(args.model, work / name.replace(" ", "-"), dtype=dt, quantize=q, group_size=g,
                              progress=False) for name, dt, q, g in stored}
        g = args.groups[0]
        # row -> (model directory, load options)
        variants = {name: (d, {}) for name, d in dirs.items()}
        variants.update({f"int8 g{g} + resident int8": (dirs[f"int8 g{g}"], {"quantize_resident": "int8"}),
                         f"int4 g{g} + resident int4": (dirs[f"int4 g{g}"], {"quantize_resident": "int4"}),
                         "KV int8": (dirs["float32"], {"kv_bits": 8}),
                         f"int4 g{g} + resident int4 + KV int8": (dirs[f"int4 g{g}"],
                                                                  {"quantize_resident": "int4", "kv_bits": 8})})
        ref = flashllm.load(dirs["float32"])
        chunks = collect.chunk_text(ref, collect.read_data(args.data, args.max_tokens), args.seq_len,
                                    args.max_tokens, str(args.data))
        prompt = chunks[0][:args.prompt_tokens]
        gen = greedy(ref, prompt, min(args.gen_tokens, ref.context - len(prompt)))
        budget = int(args.budget * ref.model_bytes) if args.budget else None  # the same bytes for every row
        at_budget = {"float32", f"int4 g{g}", f"int4 g{g} + resident int4", f"int4 g{g} + resident int4 + KV int8"}
        results = {}
        for name, (d, opts) in variants.items():
            print(f"measuring {name}", file=sys.stderr, flush=True)
            results[name] = measure(d, chunks, prompt, gen, args.window, opts, budget if name in at_budget else None,
                                    args.budget_tokens, not args.no_bytes)
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, f16 = results["float32"], results["float16"]
    at = f" | ppl at budget {args.budget} (bf16, oracle) | vs float32 there | dropped/token" if args.budget else ""
    lines = [f"{args.model.name}: {base['scored_tokens']} held-out tokens ({args.data.name}), greedy agreement over "
             f"{len(gen)} tokens" + (f", sparse oracle window {args.window} over {base['decode_tokens']} decode tokens"
                                     if "decode_tokens" in base else "")
             + (f"; at budget {args.budget} of the float32 model ({budget / 2**20:.2f} MiB for every row): "
                f"{base['budget_tokens']} tokens decoded one by one" if args.budget else ""),
             "", "| storage (+ load options) | ffn.bin MiB | DRAM dense MiB | perplexity | ppl vs float32 | top-1 "
             "agreement | flash bytes/token | vs float16" + at + " |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.budget else "")]
    for name, r in results.items():
        r["ppl_ratio"] = r["ppl"] / base["ppl"]
        cells = [name, f"{r['ffn_file_bytes'] / 2**20:.2f}", f"{r['dram_bytes_dense'] / 2**20:.2f}", f"{r['ppl']:.4f}",
                 f"{(r['ppl_ratio'] - 1) * 100:+.2f}%", f"{r['top1_agreement']:.3f}"]
        if "bytes_per_token" in r and "bytes_per_token" in f16:
            r["bytes_vs_float16"] = r["bytes_per_token"] / f16["bytes_per_token"]
            cells += [f"{r['bytes_per_token'] / 1024:.1f} KiB", f"{r['bytes_vs_float16']:.3f}"]
        else:
            cells += ["as stored" if not args.no_bytes else "not measured", ""]
        if args.budget and "budget_ppl" in r:
            r["budget_ppl_ratio"] = r["budget_ppl"] / base["budget_ppl"]
            cells += [f"{r['budget_ppl']:.4f}", f"{(r['budget_ppl_ratio'] - 1) * 100:+.2f}%",
                      f"{r['budget_dropped_per_token']:.0f}"]
        elif args.budget:
            cells += ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
