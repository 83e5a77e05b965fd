"""Does a sparse decode token overlap its flash reads with its compute? One run, on a model of real size:

- `sequential`: no read-ahead and no overlap inside a layer (`read_ahead=False`): every read is waited for
  where it is issued, so this run's io_ms is the token's I/O time and total - io_ms its compute;
- `overlapped`: the runtime's defaults (compute in the file's float16, reads landing in the cache rows
  through native AIO, layer l+1's lookahead read while layer l computes, a layer's held rows computed
  while its missing rows arrive), with the replayed lookahead exact;
- `overlapped, read-ahead awaited first`: the same, but a layer whose read-ahead is still landing waits for it
  before computing anything (rather than computing the rows it holds already meanwhile);
- `overlapped, measured lookahead`: the defaults, the lookahead as imperfect as the embedded model's own
  (layer l+1's predictor on layer l's residual stream, bench/io/lookahead.py's per-layer score ladder):
  its recall and the bytes it reads for nothing are what predicting a layer early costs.

Active sets are replayed from an activation trace of the embedded model (random weights have no sparsity of
their own). Each configuration runs in a child process inside a cgroup v1 memory limit (DRAM budget +
interpreter baseline + slack, page cache charged, the model's files evicted before each run); the
configurations alternate for --rounds rounds. Per round: each token's ms, the sequential run's I/O and
compute, and token / max(I/O, compute) (1.0: fully overlapped; target <= 1.25) beside token / (I/O + compute).

    python -m bench paper overlap --shape llama-7b --rounds 2 [--layers N] [--model DIR] [--keep-model]

The model (bench/models/make_model.py, float16, seed 0; --layers cuts it to its first N layers and so its
file size) is written into --work-dir and deleted afterwards unless --keep-model or --model names one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from bench.harness import GB, MiB, MemoryGroup, baseline_rss, cache_dir, command_line, load, model_files, number
from bench.paper.measure import Runner
from bench.paper.run import DATA, sh
from flashllm.budget import budget_bytes, parse_budget
from flashllm.format import manifest as fmt

CONFIGS = {"sequential": {"read_ahead": False},
           "overlapped": {},
           # without computing a layer's held rows while its read-ahead lands (SparseMode.early_held)
           "overlapped, read-ahead awaited first": {"plan": {"early_held": False}},
           "overlapped, measured lookahead": {"lookahead": "measured"}}


def inputs(args) -> tuple[Path, Path, Path, bool]:
    """(model dir, trace, lookahead ladder, whether this run wrote the model), made in --work-dir when missing."""
    work, py = Path(args.work_dir), sys.executable
    work.mkdir(parents=True, exist_ok=True)
    heldout, trace, ladder = work / "heldout.txt", work / "trace.npz", work / "ladder.json"
    if not heldout.is_file():
        sh([py, "-m", "bench.models.stdlib_corpus", "--split", "heldout", "--out", heldout, "--max-bytes", "4000000"])
    if not trace.is_file():
        sh([py, "-m", "bench.models.activation_trace", "record", DATA / "tiny-opt", "--data", heldout, "--out", trace,
            "--tokens", "2048", "--predictor", "auto", "--predictors", DATA / "tiny-opt-predictors"])
    if not ladder.is_file():
        sh([py, "-m", "bench.io.lookahead", "--tokens", "48", "--json-out", ladder])
    if args.model:
        return Path(args.model), trace, ladder, False
    model = work / f"{args.shape}{'' if args.layers is None else f'-{args.layers}l'}"
    made = not (model / fmt.MANIFEST).is_file()
    if made:
        sh([py, "-m", "bench.models.make_model", "--shape", args.shape, "--dtype", "float16", "--seed", "0",
            "--out", model, "--quiet", *(["--layers", str(args.layers)] if args.layers else [])])
    return model, trace, ladder, made


def run_of(args, name: str, model: Path, trace: Path, ladder: Path, budget: int) -> dict:
    run = dict(label=name, mode="sparse", window=args.window, bundled=True, backend="torch", budget=budget,
               threads=32, aio_depth=None, trace=str(trace), seed=0, predictor="trace", predictor_rank=128,
               tokens=args.tokens, warmup=args.warmup, model_dir=str(model), dtype=None, per_token=True)
    cfg = dict(CONFIGS[name])
    if cfg.pop("lookahead", None) == "measured":
        run["lookahead_model"] = json.loads(ladder.read_text())["ladder"]["attn"]
    return {**run, **cfg}


def summary(rounds: list[dict]) -> list[dict]:
    """Per round: each configuration's token beside the sequential run's I/O and compute."""
    rows = []
    for k, runs in enumerate(rounds):
        seq = runs.get("sequential", {})
        if "error" in seq or not seq:
            continue
        io, compute = seq["io_ms"], seq["total_ms"] - seq["io_ms"]
        for name, r in runs.items():
            if "error" in r:
                rows.append({"round": k + 1, "config": name, "error": r["error"]})
                continue
            rows.append({"round": k + 1, "config": name, "token_ms": r["total_ms"], "io_ms": io, "compute_ms": compute,
                         "own_cpu_ms": r["total_ms"] - r["io_ms"],
                         "of_max": r["total_ms"] / max(io, compute), "of_sum": r["total_ms"] / (io + compute),
                         "own_io_wait_ms": r["io_ms"], "own_read_ms": r["read_ms"], "gb_per_token": r["bytes_read"] / GB,
                         "lookahead_recall": r.get("read_ahead_recall"), "read_ahead_unused": r.get("read_ahead_unused"),
                         "neurons_dropped": r["neurons_dropped"], "load": r["load_average_at_start"]})
    return rows


def markdown(report: dict) -> str:
    L = ["| round | configuration | token ms | sequential I/O ms | sequential compute ms | token / max | token / sum | "
         "waited for reads ms | the rest (CPU) ms | GB/token | lookahead recall | dropped/token | load |", "|---" * 13 + "|"]
    for r in report["rows"]:
        if "error" in r:
            L.append(f"| {r['round']} | {r['config']} | failed: {r['error']} |" + " |" * 10)
            continue
        L.append(f"| {r['round']} | {r['config']} | {number(r['token_ms'])} | {number(r['io_ms'])} | "
                 f"{number(r['compute_ms'])} | {r['of_max']:.2f} | {r['of_sum']:.2f} | {number(r['own_io_wait_ms'])} | {number(r['own_cpu_ms'])} | "
                 f"{r['gb_per_token']:.3f} | {number(r['lookahead_recall'], 2)} | {number(r['neurons_dropped'])} | "
                 f"{number(r['load'], 1)} |")
    m = report["meta"]
    L += ["", f"`{m['command']}`: {m['model']}, DRAM budget {m['budget_gb']:.2f} GB in a {m['limit_gb']:.2f} GB cgroup "
          f"limit, {m['tokens']} measured + {m['warmup']} warm-up decode tokens per run, load {m['load'][0]:.1f} at "
          f"start, {m['load'][1]:.1f} at the end."]
    return "\n".join(L) + "\n"


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # sleeping OpenMP workers leave the cores to the reads
    why_not = MemoryGroup.available()
    if why_not:
        raise SystemExit(f"paper overlap: error: no memory limit possible: {why_not}")
    model, trace, ladder, made = inputs(args)
    group = None
    try:
        manifest = fmt.read_manifest(model, verify=False)
        model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
        budget = budget_bytes(args.dram_budget, model_bytes)
        group = MemoryGroup((budget + baseline_rss() + args.cgroup_slack * MiB) // 4096 * 4096)
        runner = Runner(True, group, model_files(model), lambda m: print(m, file=sys.stderr, flush=True))
        start, rounds = load(), []
        for _ in range(args.rounds):
            rounds.append({name: runner(run_of(args, name, model, trace, ladder, budget)) for name in CONFIGS})
        s = manifest.spec
        report = {"meta": {"command": command_line("bench.paper.overlap", argv), "load": [start, load()],
                           "model": f"{args.shape} shape, {s.n_layers} layers, float16, {model_bytes / GB:.2f} GB",
                           "budget_gb": budget / GB, "limit_gb": group.limit / GB, "tokens": args.tokens,
                           "warmup": args.warmup},
                  "rows": summary(rounds), "runs": rounds}
    finally:
        if group is not None:
            group.remove()
        if made and not args.keep_model:
            shutil.rmtree(model, ignore_errors=True)
    md = markdown(report)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    return {k: report[k] for k in ("meta", "rows")}


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-7b", help="make_model shape (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="only the shape's first N layers (a smaller file)")
    p.add_argument("--model", default=None, help="an existing model directory instead (kept)")
    p.add_argument("--work-dir", default=str(cache_dir("overlap")), help="model, trace and ladder (default: %(default)s)")
    p.add_argument("--keep-model", action="store_true", help="keep the model this run wrote")
    p.add_argument("--dram-budget", type=parse_budget, default=0.5, help="of the model (default: %(default)s)")
    p.add_argument("--cgroup-slack", type=int, default=1024, help="MiB in the limit above budget + interpreter "
                   "baseline, as bench/peers/run.py (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="measured decode tokens per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="decode tokens before them (default: %(default)s)")
    p.add_argument("--window", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--markdown", default=None, help="also write the table here")
    return p


if __name__ == "__main__":
    main()
