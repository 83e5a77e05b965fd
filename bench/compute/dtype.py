"""What computing a float16 file in float16 instead of float32 costs in quality.

    python -m bench models corpus --split heldout --out heldout.txt
    python -m bench compute dtype --data heldout.txt [--model flashllm/data/tiny-opt] [--out FILE.md]

Converts the embedded model (or --model, an HF checkpoint) to float16 into a temporary directory
(removed at the end) and loads it three ways: float32 compute (the reference: the float16 weights,
exact in float32), float16 compute, bfloat16 compute. Per row, dense mode: perplexity over the
held-out tokens (teacher-forced), the largest |logit| difference from the reference, and greedy
top-1 agreement (the reference generates --gen-tokens tokens; the row reads the same tokens and
predicts each next one); and sparse mode with the oracle predictor at --budget (the demo's 0.5 of
the model's float32 bytes), token by token: perplexity and neurons dropped per token, where
float16 compute holds twice the cached rows of float32 in the same bytes. Speed is measured by
bench/compute/roofline.py (the roofline per dtype and the runtime's token).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


import flashllm
from flashllm.budget import BudgetTooSmall
from flashllm.converters import convert
from flashllm.predictors.evaluate import _nll as nll  # the same measure
from bench.quant.quality import add_heldout_args, heldout, score_loaded  # the same scoring at a budget

DTYPES = ("float32", "float16", "bfloat16")
CONTEXT = 256  # the demo's KV cache length


def measure(model_dir: Path, dtype: str, chunks, prompt, gen, ref_logits, budget: int, budget_tokens: int) -> dict:
    dense = flashllm.load(model_dir, dtype=dtype, context=CONTEXT)
    logits = [dense.logits(c) for c in chunks]
    losses = np.concatenate([nll(z[:-1], c[1:]) for z, c in zip(logits, chunks)])
    diff = max(float(np.abs(z - r).max()) for z, r in zip(logits, ref_logits)) if ref_logits else 0.0
    follow = np.argmax(dense.logits(prompt + gen[:-1])[len(prompt) - 1:], axis=1) == np.array(gen)
    out = dict(dtype=dtype, ppl=float(math.exp(losses.mean())), max_logit_diff=diff,
               top1_agreement=float(follow.mean()), scored=int(len(losses)), logits=logits, budget_ppl=None)
    try:
        at = flashllm.load(model_dir, mode="sparse", predictor="oracle", dram_budget=budget, dtype=dtype,
                           context=CONTEXT)
    except BudgetTooSmall as exc:
        return dict(out, budget_error=str(exc).split(";")[0])
    ppl, n, dropped_per_token = score_loaded(at, chunks, budget_tokens)
    return dict(out, budget_ppl=ppl, budget_tokens=n, dropped_per_token=dropped_per_token,
                cached_rows=sum(at.mode_impl.capacities))


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_heldout_args(ap)
    ap.add_argument("--budget", type=float, default=0.5, help="sparse mode's DRAM budget, a fraction of the "
                    "model in float32, as the demo's (default: %(default)s)")
    ap.add_argument("--budget-tokens", type=int, default=512, help="held-out tokens scored at --budget "
                    "(default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="compute-dtype-"))
    try:
        model_dir = convert(args.model, work / "float16", dtype="float16", progress=False)
        ref = flashllm.load(model_dir, dtype="float32", context=CONTEXT)
        chunks, prompt, gen = heldout(ref, args)
        budget = int(args.budget * 2 * ref.model_bytes)  # the demo's: a fraction of the float32 model
        rows, ref_logits = [], None
        for dtype in DTYPES:
            print(f"measuring {dtype}", file=sys.stderr, flush=True)
            rows.append(measure(model_dir, dtype, chunks, prompt, gen, ref_logits, budget, args.budget_tokens))
            ref_logits = ref_logits or rows[0]["logits"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows[0]
    lines = [f"{args.model.name} stored in float16: {base['scored']} held-out tokens ({args.data.name}), greedy "
             f"agreement over {len(gen)} tokens; sparse (oracle, context {CONTEXT}) at {args.budget} of the float32 "
             f"model's bytes over up to {args.budget_tokens} tokens", "",
             "| compute dtype | perplexity | vs float32 | max abs logit diff | top-1 agreement "
             "| sparse ppl at budget | vs the first row that fits | cached rows | dropped/token |", "|---|---|---|---|---|---|---|---|---|"]
    ref_budget = next((r["budget_ppl"] for r in rows if r["budget_ppl"]), None)
    for r in rows:
        sparse = (f"{r['budget_ppl']:.3f} | {r['budget_ppl'] / ref_budget - 1:+.2%} | {r['cached_rows']} | "
                  f"{r['dropped_per_token']:.1f}") if r["budget_ppl"] else f"does not fit: {r['budget_error']} | | |"
        lines.append(f"| {r['dtype']} | {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.2%} | {r['max_logit_diff']:.4f} "
                     f"| {r['top1_agreement']:.3f} | {sparse} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
