"""The I/O pipeline step by step on one model, side by side in interleaved rounds.

Configurations (each loaded fresh, decoding the same prompt greedily at the same DRAM budget): dense
(everything resident, no budget: no reads at all, the floor a streaming mode could reach); naive with
(its default) and without read-ahead, and on native AIO instead of preadv threads; sparse at its
defaults (native AIO, hot neurons pinned, no gap-filling, no read-ahead; the embedded model in its
shipped co-activation neuron order), in the converter's neuron order, on preadv threads, without
pinning, with lookahead read-ahead and with gap-filling (the disk profile's cost model, measured afresh
at the start). Every round runs every configuration once, in a rotated order; the table shows medians
and [min, max] over the rounds, and ratios are taken within each round (the machine is shared and
noisy). Process CPU time per decode token is reported beside the wall time: on a loaded machine a
token's wall time is mostly its wait for a core, in proportion to the CPU it needs.

    python -m bench io pipeline [MODEL_DIR] --rounds 5 --tokens 24 --markdown bench/results/io/pipeline.md

Without MODEL_DIR the embedded model at the demo's settings (`flashllm demo`) is used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from bench.harness import command_line


KEYS = ("total_ms", "cpu_ms", "io_ms", "read_ms", "mem_ms", "compute_ms", "predictor_ms", "reads", "bytes_read")
AIO, PREADV = dict(aio_depth=64), dict(aio_depth=0)


def configs(embedded: bool) -> dict:
    """The configurations, by name (the converter-order row only for the embedded model, which ships its order)."""
    out = {DENSE: dict(mode="dense"),
           "naive, no read-ahead": dict(mode="naive", read_ahead=False),
           NAIVE: dict(mode="naive"),
           "naive, native AIO": dict(mode="naive", aio_depth=64),
           DEFAULT: dict(mode="sparse"),
           UNORDERED: dict(mode="sparse", order=False),
           THREADS: dict(mode="sparse", aio_depth=0),
           NOPIN: dict(mode="sparse", pin_hot=False),
           AHEAD: dict(mode="sparse", read_ahead=True),
           GAP: dict(mode="sparse", gap_bytes=None)}
    if not embedded:
        del out[UNORDERED]
    return out


DENSE = "dense (all resident, no budget: no reads, the floor)"
NAIVE, DEFAULT = "naive (default: read-ahead, preadv threads)", "sparse (default: native AIO, hot neurons pinned)"
UNORDERED, THREADS = "sparse, converter's neuron order", "sparse, preadv threads"
NOPIN, GAP, AHEAD = "sparse, no pinning", "sparse + gap-filling", "sparse + read-ahead"


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
    from flashllm.cli import demo
    from flashllm.paths import cache_home

    config = dict(config)
    if config.pop("order", True) is False:  # the embedded model in the converter's neuron order
        model_dir = demo.prepare(order=False, out=cache_home() / "tiny-opt-converter-order")
    if config["mode"] == "dense":
        model = flashllm.load(model_dir, **settings, **config)
    else:
        model = flashllm.load(model_dir, predictor="lowrank", dram_budget=budget, window=4, **settings, **config)
    steps = model.generate_ids(prompt_ids, tokens)
    next(steps)  # the prompt: its CPU time is not a decode token's
    cpu0 = time.process_time()
    n = sum(1 for _ in steps)
    cpu_ms = (time.process_time() - cpu0) * 1e3 / max(n, 1)
    s = model.stats
    out = {k: s[k] for k in KEYS if k in s}
    out["cpu_ms"] = cpu_ms
    for k in ("read_ahead_recall", "read_ahead_recall_per_layer", "neurons_read_ahead", "read_ahead_unused",
              "gap_bytes", "neurons_dropped", "pinned_neurons", "cache_capacity"):
        if k in s:
            out[k] = s[k]
    out["engine"] = model.mode_impl.reader.io.engine if hasattr(model.mode_impl, "reader") else "-"
    return out


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    import torch

    from flashllm.cli import demo
    from flashllm.io import disk_profile

    torch.set_num_threads(args.torch_threads)
    if args.model_dir:
        model_dir, settings, prompt = Path(args.model_dir), {}, demo.PROMPT
    else:
        model_dir, settings, prompt = demo.prepare(), dict(demo.SETTINGS), demo.PROMPT
    budget = float(args.dram_budget) if args.dram_budget.replace(".", "", 1).isdigit() else args.dram_budget
    import flashllm

    prompt_ids = flashllm.load(model_dir, mode="dense", **settings).tokenizer.encode(prompt)
    load0 = os.getloadavg()
    # measured now (1 GiB scratch file, direct I/O): the gap-filling runs take their threshold from it
    profile = disk_profile.profile(model_dir / "ffn.bin", refresh=True)
    CONFIGS = configs(embedded=not args.model_dir)
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
              "command": command_line("bench.io.pipeline", argv),
              "model_dir": str(model_dir), "settings": settings, "dram_budget": args.dram_budget,
              "tokens": args.tokens, "torch_threads": args.torch_threads, "load_average": os.getloadavg(),
              "load_average_start": load0, "configs": {k: {n: str(v) for n, v in c.items()} for k, c in CONFIGS.items()},
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
    names = list(rounds[0])
    L = [f"# The I/O pipeline step by step ({rep['date']})", "",
         f"- command: `{rep['command']}`",
         f"- model: `{rep['model_dir']}` {rep['settings']}, DRAM budget {rep['dram_budget']}, window 4, "
         f"lowrank predictors, {rep['tokens']} greedy decode tokens per run, torch threads {rep['torch_threads']}; "
         f"default engine: {rounds[0][DEFAULT]['engine']}",
         f"- {len(rounds)} interleaved rounds (rotated order); cells: median [min, max] over the rounds, per decode token",
         f"- load average at the start / end: {', '.join(f'{x:.1f}' for x in rep['load_average_start'])} / "
         f"{', '.join(f'{x:.1f}' for x in rep['load_average'])} (2 cores, shared by other work)",
         "- cpu_ms: the process's CPU time per decode token; io_ms: time the token waited for reads; read_ms: the "
         "engine's own time of the token's reads (overlapped or not); mem_ms: placing rows (copy/cast into the cache)", "",
         "| configuration | total (ms) | cpu_ms | io_ms | read_ms | mem_ms | compute_ms | reads | KiB read | dropped | "
         "lookahead recall |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        rs = [r[name] for r in rounds]
        L.append(f"| {name} | " + " | ".join(_med([x[k] for x in rs]) for k in KEYS[:6]) +
                 f" | {_med([x['reads'] for x in rs])} | {_med([x['bytes_read'] / 1024 for x in rs])} | "
                 f"{_med([x.get('neurons_dropped') for x in rs])} | {_med([x.get('read_ahead_recall') for x in rs], 2)} |")

    def ratio(a, b, key="total_ms"):
        return [r[a][key] / r[b][key] for r in rounds]

    def line(what, xs, unit=""):
        return f"- {what}: {_med(xs, 2)}{unit} (per round: {', '.join(f'{x:.2f}' for x in xs)})"

    d = rounds[0][DEFAULT]
    L += ["", line("**sparse vs naive, both at their defaults, same round (naive latency / sparse)**",
                   ratio(NAIVE, DEFAULT), "x"),
          line("the same in CPU time per token (naive / sparse)", ratio(NAIVE, DEFAULT, "cpu_ms"), "x"),
          line("sparse vs naive without read-ahead", ratio("naive, no read-ahead", DEFAULT), "x"),
          line("the bound from dense (no reads at all): naive latency / dense", ratio(NAIVE, DENSE), "x"),
          line("sparse latency / dense (1: every read and all bookkeeping hidden)", ratio(DEFAULT, DENSE)),
          line("engine: sparse on preadv threads / on native AIO (> 1: AIO pays)", ratio(THREADS, DEFAULT)),
          line("engine: naive on native AIO / on preadv threads (> 1: threads pay)", ratio("naive, native AIO", NAIVE)),
          line("hot-neuron pinning: latency without / with (> 1: it pays)", ratio(NOPIN, DEFAULT)),
          f"- pinning at the same budget: {rounds[0][NOPIN]['bytes_read'] / 1024:,.1f} KiB and "
          f"{rounds[0][NOPIN]['reads']:.1f} reads per token without, {d['bytes_read'] / 1024:,.1f} KiB and "
          f"{d['reads']:.1f} with; neurons pinned per layer at the end {d.get('pinned_neurons')} of cache rows "
          f"{d.get('cache_capacity')}",
          line("gap-filling: latency with / without (< 1: it pays)", ratio(GAP, DEFAULT)),
          line("sparse read-ahead: latency with / without (< 1: it pays)", ratio(AHEAD, DEFAULT))]
    if UNORDERED in rounds[0]:
        u = rounds[0][UNORDERED]
        L += [line("co-activation order: latency in the converter's order / in the shipped one (> 1: it pays)",
                   ratio(UNORDERED, DEFAULT)),
              f"- co-activation order: {u['reads']:.1f} -> {d['reads']:.1f} reads and {u['bytes_read'] / 1024:,.1f} -> "
              f"{d['bytes_read'] / 1024:,.1f} KiB per token (same neurons read; the model's function is unchanged)"]
    per_layer = [r[AHEAD].get("read_ahead_recall_per_layer") for r in rounds]
    if per_layer and per_layer[0]:
        cols = list(zip(*per_layer))
        L += ["", "Lookahead recall per layer (share of the layer's predicted neurons that the lookahead also "
              "named: the layer's predictor on the residual stream after the previous layer's attention; "
              "layer 0 has no lookahead):", "",
              "| layer | " + " | ".join(str(i) for i in range(len(cols))) + " |",
              "|---|" + "---|" * len(cols),
              "| recall | " + " | ".join(_med(c, 2) if any(v is not None for v in c) else "-" for c in cols) + " |"]
    g = rounds[0][GAP].get("gap_bytes")
    L += ["", f"Gap-filling threshold used: {g} bytes, from this disk profile (`flashllm.io.disk_profile`):", "",
          "```", rep["disk_table"], "```", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
