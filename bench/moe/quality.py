"""Quality of quantized experts on the trained MoE model, against float32, at the demo's budget and dtype.

    python -m bench models corpus --split heldout --out heldout.txt
    python -m bench moe quality --data heldout.txt [--model flashllm/data/tiny-moe] [--out FILE.md]

Converts the MoE checkpoint (default: the embedded flashllm/data/tiny-moe) to float32 (the
reference), float16 (what `flashllm demo --moe` runs) and int8/int4 experts (groups of --group,
resident tensors float16) into a temporary directory, removed at the end. int8 and int4 run twice: with the
default kernels (with groups of a multiple of 64, experts kept as stored for the native int8-activation kernel,
backends/native/kernels_qdot.c; the `expert slots` column says how) and with `--kernels plain` (dequantized
experts). Per row:
- perplexity over the held-out tokens (dense mode, teacher-forced, float16 compute; float32 for
  the reference), and its ratio to float32;
- greedy top-1 agreement: float32 generates --gen-tokens tokens greedily from a held-out prompt;
  the row's model reads the same tokens and predicts each next one (fraction equal);
- at --budget of the float16 model's size (the demo's 50%) in sparse mode with router prefetch, as
  the demo runs: the expert slots per layer, how they hold experts, the perplexity over the first
  --budget-tokens held-out tokens decoded token by token, and the largest logit difference from the
  same row's dense mode (0: streaming changes nothing; the router is an exact predictor).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


import flashllm
from flashllm.converters import convert
from flashllm.predictors.evaluate import _nll as nll  # the same measure as quant_quality
from bench.harness import ROOT

ROWS = [  # label, convert dtype, quantize, load options (the float32 reference is not run at the budget)
    ("float32", "float32", "none", {"dtype": "float32"}),
    ("float16 (demo)", "float16", "none", {"dtype": "float16"}),
    ("int8 experts, default kernels", "float16", "int8", {"dtype": "float16"}),
    ("int4 experts, default kernels", "float16", "int4", {"dtype": "float16"}),
    ("int4 experts, dequantized (--kernels plain)", "float16", "int4", {"dtype": "float16", "kernels": "plain"}),
    ("int8 experts, dequantized (--kernels plain)", "float16", "int8", {"dtype": "float16", "kernels": "plain"}),
]


def measure(model_dir: Path, chunks, prompt, gen, opts: dict, budget_bytes: int | None, budget_tokens: int,
            context: int = 256) -> dict:
    dense = flashllm.load(model_dir, **opts)
    losses = np.concatenate([nll(dense.logits(c)[:-1], c[1:]) for c in chunks])
    follow = np.argmax(dense.logits(prompt + gen[:-1])[len(prompt) - 1:], axis=1) == np.array(gen)
    out = {"ppl": float(math.exp(losses.mean())), "top1_agreement": float(follow.mean()),
           "scored_tokens": int(len(losses)), "experts_file_bytes": (model_dir / "experts.bin").stat().st_size}
    if budget_bytes is None:
        return out
    at = flashllm.load(model_dir, mode="sparse", dram_budget=budget_bytes, expert_read_ahead=True, context=context, **opts)
    scored, diff, n = [], 0.0, 0
    for c in chunks:
        if n >= budget_tokens:
            break
        logits = at.logits(c, prefill=1)
        scored.append(nll(logits[:-1], c[1:]))
        diff = max(diff, float(np.abs(logits - dense.logits(c, prefill=1)).max()))  # same decode path as `at`
        n += len(c) - 1
    out.update(budget_ppl=float(math.exp(np.concatenate(scored).mean())), budget_tokens=n, budget_max_logit_diff=diff,
               slots=at.mode_impl.capacities[0], expert_slots=at.stats["expert_slots"],
               hit_rate=at.stats["expert_hit_rate"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "flashllm/data/tiny-moe", help="HF MoE checkpoint")
    ap.add_argument("--data", type=Path, required=True, help="held-out text file")
    ap.add_argument("--max-tokens", type=int, default=2048, help="held-out tokens scored (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="greedy tokens compared (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="(default: %(default)s)")
    ap.add_argument("--group", type=int, default=64, help="quantization group size (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="DRAM budget, fraction of the float16 model (default: %(default)s, the demo's)")
    ap.add_argument("--budget-tokens", type=int, default=256, help="tokens decoded at --budget (default: %(default)s)")
    ap.add_argument("--context", type=int, default=256, help="KV cache length at --budget (default: %(default)s, "
                    "the demo's)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and JSON beside it)")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="flashllm-moe-quality-"))
    try:
        dirs = {}
        for _, dtype, quant, _ in ROWS:
            key = (dtype, quant)
            if key not in dirs:
                print(f"converting {dtype} {quant} ...", file=sys.stderr, flush=True)
                dirs[key] = convert(args.model, tmp / f"{dtype}-{quant}", dtype=dtype, quantize=quant,
                                    group_size=args.group, progress=False)
        f16 = dirs["float16", "none"]
        model_bytes = sum((f16 / f).stat().st_size for f in ("resident.safetensors", "experts.bin"))
        budget_bytes = int(args.budget * model_bytes)
        ref = flashllm.load(dirs["float32", "none"], dtype="float32")
        ids = ref.tokenizer.encode(args.data.read_text(encoding="utf-8"))[:args.max_tokens + 1]
        chunks = [ids[i:i + args.seq_len] for i in range(0, len(ids) - 1, args.seq_len) if len(ids[i:i + args.seq_len]) > 1]
        prompt = ids[:args.prompt_tokens]
        gen = list(ref.generate_ids(prompt, max_new_tokens=args.gen_tokens))
        results = []
        for label, dtype, quant, opts in ROWS:
            print(f"{label} ...", file=sys.stderr, flush=True)
            budget = None if dtype == "float32" else budget_bytes
            results.append({"label": label, **measure(dirs[dtype, quant], chunks, prompt, gen, opts, budget,
                                                      args.budget_tokens, args.context)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base, budgeted = results[0], results[1]
    lines = [f"# Quantized experts on {args.model.name}: quality against float32", "",
             f"Command: `python -m bench moe quality {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Held-out: {base['scored_tokens']} tokens of {args.data} in sequences of {args.seq_len}; greedy agreement "
             f"over {len(gen)} tokens after a {len(prompt)}-token prompt; budget {args.budget:.0%} of the float16 "
             f"model = {budget_bytes / 2**20:.2f} MiB, sparse mode with router prefetch, float16 compute, context "
             f"{args.context}, "
             f"{budgeted['budget_tokens']} tokens decoded one by one; groups of {args.group}.", "",
             "| experts | experts.bin MiB | ppl | ppl vs float32 | greedy agreement | slots per layer at budget | "
             "expert slots | ppl at budget (first tokens only) | max logit diff, decoded at budget vs dense decoded alike |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        at = f"{r['slots']} | {r['expert_slots']} | {r['budget_ppl']:.2f} | {r['budget_max_logit_diff']:.2e}" \
            if "slots" in r else "(reference, not run at the budget) | | |"
        lines.append(f"| {r['label']} | {r['experts_file_bytes'] / 2**20:.2f} | {r['ppl']:.2f} | "
                     f"{r['ppl'] / base['ppl'] - 1:+.2%} | {r['top1_agreement']:.3f} | {at} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return {"rows": results}


if __name__ == "__main__":
    main()
