"""The I/O pipeline step by step on one model, side by side in interleaved rounds.

Configurations (each loaded fresh, decoding the same prompt greedily at the same DRAM budget):
naive with (its default) and without read-ahead; sparse at its default (no gap-filling, no read-ahead);
with lookahead read-ahead, with gap-filling (the disk profile's cost model), with both; and the
default runtime on native AIO instead of preadv threads (the engine choice). Every round runs every
configuration once, in a rotated order; the table shows medians and [min, max] over the rounds, and
the sparse/naive latency ratio is taken within each round (the machine is shared and noisy).

    python bench/io_pipeline.py [MODEL_DIR] --rounds 5 --tokens 24 --markdown bench/results/io_pipeline.md

Without MODEL_DIR the embedded model at the demo's settings (`flashllm demo`) is used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

KEYS = ("total_ms", "io_ms", "read_ms", "mem_ms", "compute_ms", "predictor_ms", "reads", "bytes_read")
CONFIGS = {
    "naive, no read-ahead": dict(mode="naive", prefetch=False),
    "naive (default: read-ahead)": dict(mode="naive"),
    "sparse (default: no gap-filling, no read-ahead)": dict(mode="sparse"),
    "sparse + read-ahead": dict(mode="sparse", prefetch=True),
    "sparse + gap-filling": dict(mode="sparse", gap_bytes=None),
    "sparse + gap-filling + read-ahead": dict(mode="sparse", gap_bytes=None, prefetch=True),
    "sparse default, native AIO": dict(mode="sparse", aio_depth=8),
}
NAIVE, DEFAULT = "naive (default: read-ahead)", "sparse (default: no gap-filling, no read-ahead)"
GAP, AHEAD = "sparse + gap-filling", "sparse + read-ahead"


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="model directory (default: the embedded model, demo settings)")
    p.add_argument("--dram-budget", default="0.5", help="DRAM budget (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=24, help="decode tokens per run (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a loaded 2-core machine more threads spin)")
    p.add_argument("--markdown", help="also write the report here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_one(model_dir, settings: dict, budget, prompt_ids, tokens: int, config: dict) -> dict:
    import flashllm

    model = flashllm.load(model_dir, predictor="lowrank", dram_budget=budget, window=4, **settings, **config)
    list(model.generate_ids(prompt_ids, tokens))
    s = model.stats
    out = {k: s[k] for k in KEYS}
    for k in ("lookahead_recall", "lookahead_recall_per_layer", "neurons_prefetched", "prefetch_unused",
              "gap_bytes", "neurons_dropped"):
        if k in s:
            out[k] = s[k]
    return out


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    import torch

    from flashllm import demo, disk_profile

    torch.set_num_threads(args.torch_threads)
    if args.model_dir:
        model_dir, settings, prompt = Path(args.model_dir), {}, demo.PROMPT
    else:
        model_dir, settings, prompt = demo.prepare(), dict(demo.SETTINGS), demo.PROMPT
    budget = float(args.dram_budget) if args.dram_budget.replace(".", "", 1).isdigit() else args.dram_budget
    import flashllm

    prompt_ids = flashllm.load(model_dir, mode="dense", **settings).tokenizer.encode(prompt)
    profile = disk_profile.profile(model_dir / "ffn.bin", quick=True)
    names = list(CONFIGS)
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        res = {}
        for name in order:
            res[name] = run_one(model_dir, settings, budget, prompt_ids, args.tokens, CONFIGS[name])
            print(f"round {r + 1}/{args.rounds} {name}: {res[name]['total_ms']:.1f} ms/token", file=sys.stderr)
        rounds.append(res)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/io_pipeline.py", *(argv if argv is not None else sys.argv[1:])]),
              "model_dir": str(model_dir), "settings": settings, "dram_budget": args.dram_budget,
              "tokens": args.tokens, "torch_threads": args.torch_threads, "load_average": os.getloadavg(),
              "disk_profile": profile.to_dict(), "disk_table": profile.table(), "rounds": rounds}
    md = markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(md)
        Path(args.markdown).with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else md)
    return report


def _med(vals, nd: int = 1) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{statistics.median(vals):,.{nd}f} [{min(vals):,.{nd}f}, {max(vals):,.{nd}f}]"


def markdown(rep: dict) -> str:
    rounds = rep["rounds"]
    L = [f"# The I/O pipeline step by step ({rep['date']})", "",
         f"- command: `{rep['command']}`",
         f"- model: `{rep['model_dir']}` {rep['settings']}, DRAM budget {rep['dram_budget']}, window 4, "
         f"lowrank predictors, {rep['tokens']} greedy decode tokens per run, torch threads {rep['torch_threads']}",
         f"- {len(rounds)} interleaved rounds (rotated order); cells: median [min, max] over the rounds, per decode token",
         f"- load average at the end: {', '.join(f'{x:.1f}' for x in rep['load_average'])} (2 cores, shared)",
         "- io_ms: time the token waited for reads; read_ms: the engine's own time of the token's reads "
         "(overlapped or not); mem_ms: placing rows (copy/cast into the cache)", "",
         "| configuration | total (ms) | io_ms | read_ms | mem_ms | compute_ms | reads | KiB read | lookahead recall |",
         "|---|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        rs = [r[name] for r in rounds]
        L.append(f"| {name} | " + " | ".join(_med([x[k] for x in rs]) for k in KEYS[:5]) +
                 f" | {_med([x['reads'] for x in rs])} | {_med([x['bytes_read'] / 1024 for x in rs])} | "
                 f"{_med([x.get('lookahead_recall') for x in rs], 2)} |")
    ratios = [r[NAIVE]["total_ms"] / r[DEFAULT]["total_ms"] for r in rounds]
    ratios0 = [r["naive, no read-ahead"]["total_ms"] / r[DEFAULT]["total_ms"] for r in rounds]
    gap = [r[GAP]["total_ms"] / r[DEFAULT]["total_ms"] for r in rounds]
    ahead = [r[AHEAD]["total_ms"] / r[DEFAULT]["total_ms"] for r in rounds]
    aio = [r["sparse default, native AIO"]["total_ms"] / r[DEFAULT]["total_ms"] for r in rounds]
    def line(what, xs, unit=""):
        return f"- {what}: {_med(xs, 2)}{unit} (per round: {', '.join(f'{x:.2f}' for x in xs)})"

    L += ["", line("sparse vs naive, both at their defaults, same round (naive latency / sparse)", ratios, "x"),
          line("sparse vs naive without read-ahead (naive's old path)", ratios0, "x"),
          line("gap-filling: latency with / without (< 1: it pays)", gap),
          line("sparse read-ahead: latency with / without (< 1: it pays)", ahead),
          line("native AIO (4 threads x 8 in flight) / 32 preadv threads, sparse default (< 1: AIO faster)", aio)]
    per_layer = [r[AHEAD].get("lookahead_recall_per_layer") for r in rounds]
    if per_layer and per_layer[0]:
        cols = list(zip(*per_layer))
        L += ["", "Lookahead recall per layer (share of the layer's predicted neurons that the prediction from "
              "the previous layer's residual stream also named; layer 0 has no lookahead):", "",
              "| layer | " + " | ".join(str(i) for i in range(len(cols))) + " |",
              "|---|" + "---|" * len(cols),
              "| recall | " + " | ".join(_med(c, 2) if any(v is not None for v in c) else "-" for c in cols) + " |"]
    g = rounds[0][GAP].get("gap_bytes")
    L += ["", f"Gap-filling threshold used: {g} bytes, from this disk profile (`flashllm.disk_profile`):", "",
          "```", rep["disk_table"], "```", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
