"""Calibrated sparsity of a SwiGLU (or GeGLU) model: quality and flash bytes per token per target,
at each DRAM budget asked for (the one the user runs, and unlimited).

For each --sparsity S: `flashllm predictors train MODEL --sparsity S` (per-layer thresholds on
|silu(gate)| into sparsity.json, then low-rank predictors on the thresholded labels), then on
held-out text, against the dense (unthresholded) model in the same compute dtype, sparse mode with
- oracle: the thresholded model itself, every above-threshold neuron loaded (the thresholds' cost);
- gate: the gate rows resident in DRAM decide and compute the gate (exact); each neuron read and
  cached is its up and down rows only (2/3 of a bundle);
- lowrank: the trained predictors (the thresholds' cost plus the predictors' misses); whole bundles;
each at each --dram-budget: perplexity, greedy top-1 agreement, flash bytes per decode token,
neurons dropped for lack of cache room, cache rows, DRAM. Naive mode's bytes per token are the
reference for the I/O saving.

    python -m bench models corpus --split train --out calib.txt --max-bytes 1200000 --max-file-bytes 2000
    python -m bench models corpus --split heldout --out heldout.txt --max-bytes 200000
    nice -n 19 python -m bench sparsity flashllm/data/tiny-swiglu --calib calib.txt \\
        --heldout heldout.txt --dram-budget none,0.5 --out bench/results/sparsity/silu
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import flashllm
from flashllm.converters import convert
from flashllm.predictors import evaluate as ev
from flashllm.predictors.calibrate import Target
from flashllm.predictors.train import TrainSettings, train_predictors

PREDICTORS = ("oracle", "gate", "lowrank")


def run_one(hf_dir, calib, heldout, s, rank, max_tokens, eval_tokens, gen_tokens, dtype, compute_dtype, context,
            budgets) -> dict:
    """One target sparsity, in its own copy of the converted model: every predictor at every budget."""
    torch.set_num_threads(1)
    warnings.filterwarnings("once", category=RuntimeWarning)  # each load states the thresholds; once is enough
    work = tempfile.mkdtemp(prefix="flashllm-silu-")
    try:
        model_dir = convert(hf_dir, Path(work) / "flash", dtype=dtype, progress=False)
        options = flashllm.LoadOptions(dtype=compute_dtype, context=context)
        t0 = time.perf_counter()
        meta = train_predictors(model_dir, calib, TrainSettings(rank=rank, seed=0), max_tokens=max_tokens,
                                target=Target("sparsity", s), progress=False)
        sparsity = json.loads((Path(model_dir) / "sparsity.json").read_text())
        ref = ev.dense_reference(model_dir, heldout, options, eval_tokens, gen_tokens, 32, None, progress=False)
        row = {"target_sparsity": s, "train_seconds": round(time.perf_counter() - t0, 1),
               "layer_sparsity": [round(la["sparsity"], 4) for la in sparsity["layers"]],
               "layer_ffn_error": [round(la["ffn_error"], 4) for la in sparsity["layers"]],
               "predictor_recall": meta["summary"]["recall"], "predictor_ranks": meta["summary"]["ranks"],
               "predicted_over_true": [round(r["predicted_over_true"], 3) for r in ref.layers],
               "naive_bytes_per_token": ev.naive_bytes(model_dir, ref, options), "points": []}
        for b in budgets:
            for p in PREDICTORS:
                point = ev.evaluate_load(model_dir, ref, options.replace(dram_budget=b), progress=False, predictor=p)
                row["points"].append(point)
                print(f"sparsity {s} budget {b}: {p}: ppl {point.get('ppl_dense', 0):.3f} -> "
                      f"{point.get('ppl_sparse', 0):.3f}, top-1 {point.get('top1_agreement', 0):.3f}, "
                      f"{point.get('bytes_per_token', 0) / 1024:.1f} KiB/token, "
                      f"{point.get('neurons_dropped_per_token', 0):.0f} dropped"
                      f"{' ' + point['refused'] if 'refused' in point else ''}", file=sys.stderr, flush=True)
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


def budget_name(b) -> str:
    return "unlimited" if b is None else f"{b:g}"


def table(rows, budgets) -> str:
    out = ["| DRAM budget | target sparsity | skipped per layer | FFN error | predictor | ppl dense → sparse | top-1 greedy | "
           "top-1 held-out | "
           "flash KiB / token | naive / sparse bytes | dropped / token | cache rows per layer | DRAM MiB |",
           "|" + "---|" * 13]
    for b in budgets:
        for r in rows:
            for pt in r["points"]:
                if pt["dram_budget"] != b:
                    continue
                head = f"| {budget_name(b)} | {r['target_sparsity']} | " \
                       f"{min(r['layer_sparsity']):.2f}–{max(r['layer_sparsity']):.2f} | " \
                       f"{sum(r['layer_ffn_error']) / len(r['layer_ffn_error']):.3f} | {pt.get('predictor', '')} | "
                if "refused" in pt:
                    out.append(head + f"refused: {pt['refused']} |" + " |" * 7)
                    continue
                ratio = r["naive_bytes_per_token"] / pt["bytes_per_token"] if pt["bytes_per_token"] else float("inf")
                caps = pt["cache_capacity"]
                out.append(head + f"{pt['ppl_dense']:.2f} → {pt['ppl_sparse']:.2f} ({pt['ppl_ratio'] - 1:+.1%}) | "
                           f"{pt['top1_agreement']:.3f} | {pt['top1_agreement_heldout']:.3f} | {pt['bytes_per_token'] / 1024:.1f} | {ratio:.2f}x | "
                           f"{pt['neurons_dropped_per_token']:.0f} | {min(caps)}–{max(caps)} | "
                           f"{pt['dram_bytes'] / 2**20:.2f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="HF checkpoint directory of a SwiGLU/GeGLU model")
    ap.add_argument("--calib", required=True, help="calibration text")
    ap.add_argument("--heldout", required=True, help="held-out text")
    ap.add_argument("--sparsity", default="0.25,0.4,0.5", help="targets, comma-separated (default 0.25,0.4,0.5)")
    ap.add_argument("--rank", type=int, default=64, help="predictor rank (default 64)")
    ap.add_argument("--max-tokens", type=int, default=30000, help="calibration tokens (default 30000)")
    ap.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens scored (default 1024)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens for top-1 agreement (default 64)")
    ap.add_argument("--dtype", default="float32", help="storage dtype of the conversion (default float32, as the demo)")
    ap.add_argument("--compute-dtype", default="bfloat16", help="compute dtype (default bfloat16, as the demo)")
    ap.add_argument("--context", type=int, default=256, help="context length (KV cache; default 256, as the demo)")
    ap.add_argument("--dram-budget", default="none,0.5",
                    help="budgets as fractions of the model, comma-separated; none = unlimited (default none,0.5)")
    ap.add_argument("--jobs", type=int, default=1, help="targets run in this many processes (default 1)")
    ap.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/sparsity.py"] + (argv or sys.argv[1:]))
    targets = [float(v) for v in args.sparsity.split(",")]
    budgets = [None if v.strip().lower() == "none" else float(v) for v in args.dram_budget.split(",")]
    work = (args.model, args.calib, args.heldout)
    settings = (args.rank, args.max_tokens, args.eval_tokens, args.gen_tokens, args.dtype, args.compute_dtype,
                args.context, budgets)
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(targets))) as pool:
            rows = list(pool.map(run_one, *zip(*[(*work, s, *settings) for s in targets])))
    else:
        rows = [run_one(*work, s, *settings) for s in targets]
    text = table(rows, budgets)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        Path(args.out + ".md").write_text(f"`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
