"""The paper's measurements on one model at one DRAM budget, side by side in one run.

"LLM in a flash" (Alizadeh et al.) Table 2, Table 3, Figure 7 and Figure 8, on this machine:

- Table 2: naive (no layer weights resident: every token reads them all from flash); hybrid (a
  fixed share of each FFN resident, the rest re-read densely per token); hybrid + predictor
  (sparse mode, window 1, unbundled layout: only predicted neurons read, two reads per neuron);
  + windowing (window k, unbundled); + bundling (window k, bundled: everything on, "all").
  Columns: DRAM in use, flash->DRAM bytes per token, effective read throughput, I/O latency.
- Table 3: per decode token I/O, memory management, compute and total for naive / hybrid / all,
  per backend (torch CPU; MLX's CPU build only for small models, being 10-30x slower on Linux).
- Figure 7: window size 1..8 (bundled) vs DRAM in use vs latency.
- Figure 8: I/O latency of each of --fig8-tokens generated tokens ("all").

Every run decodes fixed random token ids one at a time after a 1-token prompt; sparse runs first
decode --warmup tokens that are not averaged (the cache starts empty), then --tokens measured ones.
Model files are dropped from the page cache (posix_fadvise DONTNEED) before each run, and with
--cgroup each run is a child process in a cgroup v1 memory group limited to the DRAM budget plus a
stated allowance for the Python process, so the page cache cannot hold the model either.

    python -m bench paper tables MODEL_DIR --dram-budget 0.5 --tokens 32 --trace trace.npz \\
        [--unbundled-dir DIR] [--naive-tokens 3] [--window 4] [--json] [--plot DIR] [--cgroup]

The unbundled rows need an unbundled copy of the model: --unbundled-dir, or for a model written
by bench/models/make_model.py it is written (same shape and seed, --no-bundle) next to the model and
deleted afterwards. With --trace, active sets come from bench/models/activation_trace.py's TracePredictor (the method
is printed with every table); without it from --predictor (lowrank if the model has predictors,
else oracle).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.harness import (GB, MiB, MemoryGroup, baseline_rss, code_version, load, machine_desc,
                           model_files)
from bench.models import make_model as mm
from bench.paper.measure import Runner, io_engine, run_one
from bench.paper.plot import plot
from bench.paper.report import (_ok, fig7_rows, fig8_rows, markdown,
                                model_desc, ratios, table2_rows, table3_rows, targets, trace_report)
from flashllm.format import manifest as fmt
from flashllm.budget import budget_bytes, parse_budget


def plan_runs(args, model_dir: Path, unbundled: Path | None, budget: float, predictor: str) -> dict:
    """Every measurement of the report, by name."""
    base = dict(backend="torch", budget=budget, threads=args.threads, aio_depth=args.aio_depth,
                gap_bytes=args.gap_bytes, trace=args.trace,
                seed=args.seed, predictor=predictor, predictor_rank=args.predictor_rank,
                torch_threads=args.torch_threads, quantize_resident=args.quantize_resident, kv_bits=args.kv_bits,
                device=args.device, gpu_budget=args.gpu_budget)

    def run(label, mode, bundled=True, window=None, tokens=args.tokens, warmup=args.warmup, backend="torch", **kw):
        d = model_dir if bundled else unbundled
        return dict(base, label=label, mode=mode, bundled=bundled, window=window, tokens=tokens, warmup=warmup,
                    model_dir=str(d), backend=backend, dtype=compute_dtype(args.dtype, model_dir, backend), **kw)

    runs = {}
    k = args.window
    for backend in args.backends:
        suffix = "" if backend == "torch" else f"@{backend}"
        runs["naive" + suffix] = run("naive" + suffix, "naive", tokens=args.naive_tokens, warmup=0, backend=backend)
        runs["hybrid" + suffix] = run("hybrid" + suffix, "hybrid", tokens=args.hybrid_tokens, warmup=0,
                                      backend=backend)
        if backend == "torch" and unbundled is not None:
            runs["hybrid+predictor"] = run("hybrid+predictor", "sparse", bundled=False, window=1)
            runs["+windowing"] = run("+windowing", "sparse", bundled=False, window=k)
        runs["all" + suffix] = run("all" + suffix, "sparse", window=k, backend=backend,
                                   profile=args.profile and backend == "torch")
    for w in args.fig7_windows:
        if w != k:
            runs[f"window {w}"] = run(f"window {w}", "sparse", window=w, tokens=args.fig7_tokens or args.tokens)
    if args.fig8_tokens:
        runs["fig8"] = run("fig8", "sparse", window=k, tokens=args.fig8_tokens, warmup=0, per_token=True)
    if args.only:
        runs = {name: r for name, r in runs.items() if name in args.only}
    return runs


def compute_dtype(choice: str, model_dir: Path, backend: str) -> str | None:
    """auto: bfloat16 for float16 storage (CPU fp16 matmul is slow, fp32 doubles resident DRAM), else native."""
    if choice != "auto":
        return choice
    stored = json.loads((Path(model_dir) / fmt.MANIFEST).read_text())["dtype"]
    return "bfloat16" if stored == "float16" else stored


UNBUNDLED_RUNS = ("hybrid+predictor", "+windowing")  # the rows that read the unbundled copy


def ensure_unbundled(args, model_dir: Path, manifest, log) -> tuple[Path | None, bool, str]:
    """(unbundled model dir or None, whether we wrote it (delete after), how it was made)."""
    if args.only and not any(name in args.only for name in UNBUNDLED_RUNS):
        return None, False, f"no unbundled copy (--only runs none of {', '.join(UNBUNDLED_RUNS)})"
    if args.unbundled_dir:
        p = Path(args.unbundled_dir)
        if not p.exists():
            raise SystemExit(f"--unbundled-dir {p}: does not exist")
        return p, False, f"given: {p}"
    src = manifest.data.get("source", {})
    if not src.get("random_weights"):
        return None, False, "no unbundled copy (pass --unbundled-dir; make one with `flashllm convert --no-bundle`)"
    shape = next((name for name, fields in mm.SHAPES.items()
                  if mm.spec_for(name, manifest.spec.activation) == manifest.spec), None)
    if shape is None:
        return None, False, "no make_model shape matches this spec: pass --unbundled-dir"
    out = Path(args.work_dir or model_dir.parent) / f"{model_dir.name}-unbundled"
    if out.exists():
        try:
            m2 = fmt.read_manifest(out, verify=False)
            if not m2.layout.bundled and m2.spec == manifest.spec and m2.data["source"].get("seed") == src.get("seed"):
                return out, not args.keep_unbundled, f"reused {out}"
        except Exception:  # noqa: BLE001 - rewrite below
            pass
    log(f"writing the unbundled copy {out} (make_model --shape {shape} --seed {src.get('seed')} --no-bundle)")
    mm.write_model(manifest.spec, out, manifest.data["dtype"], int(src.get("seed", 0)), bundled=False, force=True,
                   progress=None if not args.quiet else False, shape_name=shape)
    return out, not args.keep_unbundled, f"written by bench/models/make_model.py --shape {shape} --seed {src.get('seed')} --no-bundle"


def parse_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--dram-budget", type=parse_budget, default=0.5,
                   help="a fraction of the model (0.5, 50%%), a size (6GiB) or bytes (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32, help="measured decode tokens per sparse run")
    p.add_argument("--warmup", type=int, default=8, help="decode tokens before the measured ones (sparse runs)")
    p.add_argument("--naive-tokens", type=int, default=3)
    p.add_argument("--hybrid-tokens", type=int, default=4)
    p.add_argument("--window", type=int, default=4, help="window of the +windowing / +bundling (all) rows")
    p.add_argument("--fig7-windows", type=parse_list, default=list(range(1, 9)), help="e.g. 1-8 or 1,2,4")
    p.add_argument("--fig7-tokens", type=int, default=None, help="measured tokens per Figure 7 run (default --tokens)")
    p.add_argument("--fig8-tokens", type=int, default=1000, help="generated tokens for Figure 8 (0: skip)")
    p.add_argument("--trace", default=None, help="activation trace (bench/models/activation_trace.py record) for the sparse runs")
    p.add_argument("--predictor", choices=["auto", "lowrank", "oracle"], default="auto",
                   help="without --trace: lowrank if the model has predictors, else oracle")
    p.add_argument("--predictor-rank", type=int, default=128, help="rank of the trace predictor's cost stand-in")
    p.add_argument("--unbundled-dir", default=None, help="unbundled copy of the model (same weights)")
    p.add_argument("--work-dir", default=None, help="where to write an unbundled copy (default: beside the model)")
    p.add_argument("--keep-unbundled", action="store_true", help="keep an unbundled copy this run wrote")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bfloat16 for float16 models), float32, "
                   "bfloat16, float16")
    p.add_argument("--threads", type=int, default=32, help="flash reads in flight (reader threads)")
    p.add_argument("--quantize-resident", default="none", choices=["none", "int8", "int4"],
                   help="resident matrices held quantized (flashllm.load's quantize_resident) (default: %(default)s)")
    p.add_argument("--kv-bits", type=int, default=16, choices=[8, 16], help="KV cache bits (default: %(default)s)")
    p.add_argument("--aio-depth", type=int, default=0, help="native AIO reads in flight per thread (0: preadv threads)")
    p.add_argument("--gap-bytes", type=lambda s: None if s == "auto" else int(s), default=0,
                   help="read through gaps up to this many bytes; auto: the disk profile's cost model (default: 0)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--backends", type=lambda s: [b for b in s.split(",") if b], default=["torch"])
    p.add_argument("--device", default=None, help="torch device: cpu or cuda (default: cpu)")
    p.add_argument("--gpu-budget", type=parse_budget, default=None,
                   help="with --device cuda: the GPU's share of the model (weights, KV, caches); --dram-budget then "
                   "limits the host side (staging) (default: unlimited)")
    p.add_argument("--mlx-max-gb", type=float, default=3.0, help="skip MLX (CPU build, 10-30x slower) above this size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="cProfile the measured tokens of the torch \"all\" run "
                   "(main thread; the table lists functions by own time per token)")
    p.add_argument("--only", type=lambda s: s.split(","), default=None, help="run only these runs (by name)")
    p.add_argument("--isolate", action="store_true", help="each run in a child process")
    p.add_argument("--cgroup", action="store_true", help="each run in a child process inside a cgroup v1 memory "
                   "group limited to the DRAM budget + allowance")
    p.add_argument("--cgroup-slack", type=int, default=1024, help="MiB allowed above the DRAM budget besides the "
                   "measured interpreter+torch baseline RSS (transient load buffers, I/O bounce buffers)")
    p.add_argument("--json", action="store_true", help="print one JSON object (table2, table3, fig7, fig8, ...)")
    p.add_argument("--json-out", default=None, help="also write that JSON object to this file")
    p.add_argument("--markdown", default=None, help="also write the markdown report to this file")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--plot-prefix", default="paper_", help="PNG file names: PREFIX{table3,fig7,fig8}.png")
    p.add_argument("--command", default=None, help="command line to record in the report (default: this one)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # one run in this process (bench/peers/run.py)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    if args.run_one:
        run_one(args.run_one, args.result)
        return {}
    if not args.model_dir:
        raise SystemExit("MODEL_DIR is required")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}",
                                                                   file=sys.stderr, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (cgroup, unbundled copy)
    setting = f"{machine_desc()}, load average {load():.1f} at start"
    model_dir = Path(args.model_dir)
    manifest = fmt.read_manifest(model_dir, verify=False)
    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    budget = budget_bytes(args.dram_budget, model_bytes)
    if args.trace:
        predictor = "trace"
    elif args.predictor == "auto":
        predictor = "lowrank" if (model_dir / "predictors.json").is_file() else "oracle"
    else:
        predictor = args.predictor
    notes3 = []
    if "mlx" in args.backends and model_bytes > args.mlx_max_gb * GB:
        args.backends = [b for b in args.backends if b != "mlx"]
        notes3.append(f"MLX skipped: the model is {model_bytes / GB:.1f} GB > --mlx-max-gb {args.mlx_max_gb}; "
                      "MLX's CPU build on Linux uses reference BLAS and is 10-30x slower than torch (MLX targets "
                      "Apple silicon); run MLX on a small shape")
    group = None
    unbundled, delete_unbundled = None, False
    try:
        unbundled, delete_unbundled, unbundled_how = ensure_unbundled(args, model_dir, manifest, log)
        if args.cgroup:
            why = MemoryGroup.available()
            if why:
                memory_limit = f"not active: {why}"
                log(f"--cgroup: {memory_limit}")
            else:
                base = baseline_rss()
                limit = budget + base + args.cgroup_slack * MiB
                group = MemoryGroup(limit)
                memory_limit = (f"cgroup v1 group {group.path}, memory.limit_in_bytes {group.limit / GB:.2f} GB = "
                                f"DRAM budget {budget / GB:.2f} GB + interpreter/torch baseline RSS {base / GB:.2f} GB "
                                f"(measured) + {args.cgroup_slack} MiB slack for transient buffers; page cache is "
                                "charged to the group, so it cannot hold the model")
                log(memory_limit)
        else:
            memory_limit = "none (no --cgroup): the budget is the runtime's own accounting"
        drop_paths = model_files(model_dir) + (model_files(unbundled) if unbundled else [])
        runner = Runner(args.isolate, group, drop_paths, log)
        runs = plan_runs(args, model_dir, unbundled, args.dram_budget, predictor)
        results = {}
        for name, run in runs.items():
            results[name] = runner(run)
        if group is not None:
            active = [r.get("cgroup_active") for r in results.values() if _ok(r)]
            memory_limit += f"; limit active in {sum(map(bool, active))} of {len(active)} runs"
            over = [n for n, r in results.items() if (r.get("cgroup_usage") or {}).get("failcnt")]
            if over:
                memory_limit += f"; the limit was reached (reclaim) in: {', '.join(over)}"
    finally:
        if group is not None:
            group.remove()
        if delete_unbundled and unbundled is not None:
            shutil.rmtree(unbundled, ignore_errors=True)
            log(f"deleted the unbundled copy {unbundled}")
    first = next((r for r in results.values() if _ok(r)), None)
    sparse = next((r for r in results.values() if _ok(r) and r["run"]["mode"] == "sparse"), None)
    cdt = first["compute_dtype"] if first else "?"
    method = (sparse or {}).get("predictor_method") or f"{predictor} predictor on the model itself"
    report = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "command": args.command or " ".join(shlex.quote(a) for a in [sys.executable.split('/')[-1],
                                                                               *sys.argv]),
                 "machine": f"{setting}, {load():.1f} at the end", "code": code_version(), "model_dir": str(model_dir), "model_desc": model_desc(manifest, model_bytes),
                 "model_gb": model_bytes / GB, "budget_gb": budget / GB, "budget_arg": args.dram_budget,
                 "gpu_budget_arg": args.gpu_budget,
                 "compute": f"torch {'CUDA' if (args.device or 'cpu').startswith('cuda') else 'CPU'}, {cdt} (storage {manifest.data['dtype']}; --dtype {args.dtype}; FFN bundles "
                            f"{manifest.data.get('quantization', 'none')}, resident matrices {args.quantize_resident}, "
                            f"KV {args.kv_bits} bits); "
                            f"flash reads: {io_engine(manifest, args.threads, args.aio_depth)}; torch intra-op threads "
                            f"{args.torch_threads or 'default'}",
                 "active_method": method, "memory_limit": memory_limit,
                 "page_cache": "model files (and the unbundled copy) evicted with posix_fadvise(DONTNEED) before "
                               "each run; flash reads use O_DIRECT; the fraction cached at each run's start is "
                               "in the Runs table",
                 "tokens_desc": (f"1-token prompt, then naive {args.naive_tokens}, hybrid {args.hybrid_tokens}, "
                                 f"sparse {args.warmup} warm-up + {args.tokens} measured decode tokens "
                                 f"(fixed random ids; the runs' context is sized to them)"),
                 "window": args.window, "unbundled": unbundled_how, "backends": args.backends},
        "runs": results,
    }
    if args.trace:
        report["trace"] = trace_report(args.trace, manifest, sorted({1, args.window, *args.fig7_windows}))
    report["table2"] = table2_rows(results)
    report["table3"] = table3_rows(results, args.backends)
    report["fig7"] = fig7_rows(results, args.fig7_windows, args.window)
    report["fig8"] = fig8_rows(results)
    report["ratios"] = ratios(report["table3"])
    report["targets"] = targets(report)
    report["notes_table3"] = notes3
    if args.plot:
        report["plots"] = plot(report, Path(args.plot), args.plot_prefix)
    md = markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(md)
    return report


if __name__ == "__main__":
    main()
