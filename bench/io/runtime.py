"""The flash I/O pipeline inside the runtime on a large model, against fio at the runtime's own request mix.

For a model at a DRAM budget inside a cgroup memory limit (budget + interpreter baseline + slack, page
cache charged; files evicted before each run), each configuration decodes --warmup + --tokens tokens
in sparse mode ("all": window, bundled rows) with active sets replayed from an activation trace
(bench/models/activation_trace.py; random weights have no sparsity of their own), in a child process. The run records
every read the engine issues in the measured tokens by size; then fio reads the same FFN file with
that size mix (bssplit, by count), the same number of threads (psync jobs) and O_DIRECT, at random
offsets, right after the run. Reported per configuration:

- engine throughput in the tokens (bytes read / the engine's own time of those reads) vs fio's;
- token latency vs max(read time, CPU time), where read time is the engine's time of the token's reads
  and CPU time everything else the token spends (total - time waiting for reads: compute, predictor,
  placing rows); 1.0 means I/O fully overlapped, 2.0 none at all; with the io_ms / mem_ms split;
- reads and bytes per token.

Configurations: `default` (the runtime's defaults: gap 0, compute in the storage dtype and, since
the float16 model's reads land in the cache rows, layer l+1's lookahead set read through native AIO
straight into the rows its cache frees while layer l computes), `no-overlap` (no
read-ahead, 32 preadv threads), `threads-overlap` (read-ahead through the preadv threads),
`aio-no-overlap` (native AIO, no read-ahead), `ordered` (the FFN laid out in co-activation order; on
random weights a permutation of the replay, see TracePredictor), `ordered+no-overlap`, and `ordered+gap`
(gap-filling with the threshold fio's measurement gives: reading g more bytes costs g over the
bandwidth, one read less saves the per-read cost, from a fit of fio at one and at eight bundles).
`no-split`: without the overlap inside a layer (a layer's held rows computed while its missing rows are
read into the others); `no-keep`: the read-ahead's eviction does not keep the cached neurons the lookahead
scores above ReadAhead.KEEP. The replayed trace makes the lookahead exact (each layer's set does not depend on
its input); the `+measured-lookahead` configurations replay it as imperfect as the small model's own
lookahead (`--lookahead-model`, bench/io/lookahead.py --json-out: per layer, the score distribution of
the needed neurons and the count of others above each score cut, drawn independently per neuron and
token: bench/models/activation_trace.py TracePredictor._early), so that the runtime's precision cut works on scores.
Beside the runs, a replay (no I/O, unlimited cache) counts reads and bundles per token for gaps of 0..8
bundles before and after ordering, on trace tokens not used to compute the order.

    python -m bench io runtime MODEL --trace trace.npz --configs no-overlap,default --json-out runs-a.json
    python -m bench io runtime --report runs-a.json runs-b.json --markdown bench/results/io/runtime_7b.md

On a shared machine, run a few configurations at a time and keep other timed work off it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.budget import budget_bytes, parse_budget
from bench.harness import GB, MemoryGroup, MiB, baseline_rss, command_line, model_files, number
from bench.io import neuron_order as nm
from bench.models import activation_trace as tr
from bench.paper.measure import Runner

NO_OVERLAP = {"read_ahead": False, "aio_depth": 0}  # no read-ahead, preadv threads
CONFIGS = {"default": {}, "no-overlap": NO_OVERLAP, "threads-overlap": {"read_ahead": True, "aio_depth": 0},
           "aio-no-overlap": {"read_ahead": False, "aio_depth": 2048},
           "ordered": {"order": "coactivation"}, "ordered+no-overlap": {"order": "coactivation", **NO_OVERLAP},
           "ordered+gap": {"order": "coactivation", "gap_bytes": "fio"},
           # the replayed lookahead as imperfect as the small model's (--lookahead-model), not exact
           "default+measured-lookahead": {"lookahead": "measured"},
           "ordered+measured-lookahead": {"order": "coactivation", "lookahead": "measured"},
           # without the overlap inside a layer (held rows computed while the layer's missing rows are read)
           "no-split": {"plan": {"split": False}},
           "no-split+measured-lookahead": {"plan": {"split": False}, "lookahead": "measured"},
           # reading ahead evicts only by the guess (the cached neurons it scores likely needed are not kept)
           "no-keep+measured-lookahead": {"plan": {"AHEAD_KEEP": float("inf")}, "lookahead": "measured"}}


def fio(path, sizes: dict, threads: int, seconds: float, region: tuple[int, int] | None = None) -> dict:
    """fio psync randread on `path` with the request-size mix `sizes` (bytes -> reads), O_DIRECT; at random
    offsets in the whole file, or in `region` (offset, bytes)."""
    total = sum(sizes.values())
    split = ":".join(f"{b}/{100 * c / total:.4f}" for b, c in sorted(sizes.items(), key=lambda kv: int(kv[0])))
    cmd = ["fio", "--name=mix", f"--filename={path}", "--direct=1", "--ioengine=psync", "--rw=randread",
           f"--bssplit={split}", f"--numjobs={threads}", "--thread", "--group_reporting", "--norandommap",
           "--randrepeat=0", "--blockalign=4k", "--time_based", f"--runtime={int(seconds * 1000)}ms",
           "--output-format=json"] + ([f"--offset={region[0]}", f"--size={region[1]}"] if region else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    r = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"bw_bytes": r["bw_bytes"], "reads": r["total_ios"], "mean_read_bytes": r["io_bytes"] / max(r["total_ios"], 1),
            "bssplit": split, "threads": threads, "seconds": seconds}


def fio_gap(path, bundle: int, threads: int, seconds: float) -> dict:
    """The gap worth reading through: fio at one and at eight bundles per read gives time per read
    t(s) = a + s / B at this concurrency; a gap of g bytes costs g / B, a second read a: read through
    gaps under a * B."""
    t = {}
    for n in (1, 8):
        r = fio(path, {n * bundle: 1}, threads, seconds)
        t[n * bundle] = n * bundle / r["bw_bytes"]  # seconds per read, amortised over the reads in flight
    (s1, t1), (s8, t8) = sorted(t.items())
    per_byte = (t8 - t1) / (s8 - s1)
    a = t1 - s1 * per_byte
    return {"per_read_us": a * 1e6, "bandwidth_mibps": 1 / per_byte / MiB if per_byte > 0 else None,
            "gap_bytes": max(0, int(a / per_byte)) if per_byte > 0 else 0, "points": {str(k): v for k, v in t.items()}}


def replay_reads(trace, spec, seed: int, window: int, tokens: int) -> dict:
    """Reads and bundles per token (window cache, unlimited; every layer) for each gap and order, on the
    trace's first `tokens` tokens (the order is computed on its second half)."""
    from flashllm.predictors import coactivation as co

    out = {}
    for order in ("none", "coactivation"):
        p = tr.TracePredictor(trace, spec, None, seed, 0, order, window)
        n = min(tokens, p.trace.tokens // 2)
        reads, bundles = np.zeros(len(nm.GAPS)), np.zeros(len(nm.GAPS))
        for j, small in enumerate(p.layers):
            loads = co.loads(p.trace.predicted[small][:n][:, p.neurons[j]], window)
            for t in range(n):
                ids = np.flatnonzero(loads[t])
                for k, g in enumerate(nm.GAPS):
                    r, b = nm.gap_runs(ids, g)
                    reads[k] += r
                    bundles[k] += b
        out[order] = {str(g): {"reads": reads[k] / n, "bundles": bundles[k] / n} for k, g in enumerate(nm.GAPS)}
        out["tokens"] = n
    return out


def run_config(args, name: str, budget: int, runner, gap: dict | None) -> dict:
    cfg = dict(CONFIGS[name])
    if cfg.get("gap_bytes") == "fio":
        cfg["gap_bytes"] = gap["gap_bytes"]
    run = dict(label=name, mode="sparse", window=args.window, bundled=True, backend="torch", budget=budget,
               threads=args.threads, aio_depth=None, trace=args.trace, seed=args.seed, predictor="trace",
               predictor_rank=128, torch_threads=args.torch_threads, tokens=args.tokens, warmup=args.warmup,
               model_dir=str(args.model_dir), dtype=args.dtype, read_sizes=True, per_token=True)
    if cfg.pop("lookahead", None) == "measured":  # else exact: the replay's
        if not args.lookahead_model:
            raise SystemExit(f"io_runtime: error: --configs {name} needs --lookahead-model")
        run["lookahead_model"] = json.loads(Path(args.lookahead_model).read_text())["ladder"]["attn"]
    run.update(cfg)
    res = runner(run)
    if "error" in res:
        return res
    m = fmt.read_manifest(args.model_dir, verify=False)
    lay = m.layout
    res["fio"] = fio(m.path("ffn"), res["read_sizes"], args.threads, args.fio_seconds)
    # the engine reads one layer per call: the same mix at random offsets in one layer's bundles
    res["fio_layer"] = fio(m.path("ffn"), res["read_sizes"], args.threads, args.fio_seconds,
                           (lay.layer_offsets[len(lay.layer_offsets) // 2], lay.d_ffn * lay.stride))
    res["load_average_after"] = os.getloadavg()[0]
    return res


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    if args.report:
        reps = [json.loads(Path(p).read_text()) for p in args.report]
        md = markdown(reps)
        if args.markdown:
            Path(args.markdown).write_text(md)
        print(md)
        return {"reports": reps}
    if not args.model_dir or not args.trace:
        raise SystemExit("io_runtime: error: MODEL_DIR and --trace are needed (or --report)")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"io_runtime: error: --configs {','.join(unknown)}: choose from {', '.join(CONFIGS)}")
    manifest = fmt.read_manifest(args.model_dir, verify=False)
    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    budget = budget_bytes(args.dram_budget, model_bytes)
    why_not = MemoryGroup.available()
    if why_not:
        raise SystemExit(f"io_runtime: error: no memory limit possible: {why_not}")
    limit = (budget + baseline_rss() + args.cgroup_slack * MiB) // 4096 * 4096
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    files = model_files(args.model_dir)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": command_line("bench.io.runtime", argv),
              "model_dir": str(args.model_dir), "model_bytes": model_bytes, "dram_budget": budget, "memory_limit": limit,
              "load_average_start": os.getloadavg(), "fio_version": subprocess.run(
                  ["fio", "--version"], capture_output=True, text=True).stdout.strip(),
              "bundle_bytes": manifest.layout.stride, "runs": {}}
    gap = fio_gap(manifest.path("ffn"), manifest.layout.stride, args.threads, args.fio_seconds) \
        if any(CONFIGS[c].get("gap_bytes") == "fio" for c in args.configs) else None
    report["fio_gap"] = gap
    group = MemoryGroup(limit)
    try:
        runner = Runner(True, group, files, log)
        for name in args.configs:
            report["runs"][name] = run_config(args, name, budget, runner, gap)
            r = report["runs"][name]
            if "error" not in r:
                log(f"  engine {r['bytes_read'] / r['read_ms'] / 1e6:.3f} GB/s, fio {r['fio']['bw_bytes'] / GB:.3f} GB/s "
                    f"(one layer: {r['fio_layer']['bw_bytes'] / GB:.3f})")
    finally:
        group.remove()
    if args.replay_tokens:
        report["replay"] = replay_reads(args.trace, manifest.spec, args.seed, args.window, args.replay_tokens)
    report["load_average_end"] = os.getloadavg()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    print(markdown([report]))
    return report


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="flashllm model directory (e.g. make_model.py --shape llama-7b)")
    p.add_argument("--trace", help="activation trace to replay (bench/models/activation_trace.py record)")
    p.add_argument("--configs", type=lambda s: s.split(","), default=["no-overlap", "default"],
                   help=f"configurations, in order: {', '.join(CONFIGS)} (default: no-overlap,default)")
    p.add_argument("--dram-budget", type=parse_budget, default=0.5, help="of the model (default: %(default)s)")
    p.add_argument("--cgroup-slack", type=int, default=1024, help="MiB in the limit above budget + interpreter "
                   "baseline, as bench/peers/run.py (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="measured decode tokens (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="decode tokens before them (default: %(default)s)")
    p.add_argument("--window", type=int, default=4, help="sparse window (default: %(default)s)")
    p.add_argument("--threads", type=int, default=32, help="reads in flight: engine threads and fio jobs "
                   "(default: %(default)s, the runtime's)")
    p.add_argument("--torch-threads", type=int, default=None, help="compute threads (default: the runtime's)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the runtime's, the storage dtype)")
    p.add_argument("--lookahead-model", help="bench/io/lookahead.py --json-out of the trace's model, for the "
                   "*+measured-lookahead configurations: the replayed lookahead scores neurons as that layer's "
                   "real lookahead did (the others: exact)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fio-seconds", type=float, default=10.0, help="seconds per fio run (default: %(default)s)")
    p.add_argument("--replay-tokens", type=int, default=0, help="also count replayed reads per token over this "
                   "many trace tokens (default: 0, off)")
    p.add_argument("--json-out", help="write the report (JSON) here")
    p.add_argument("--report", nargs="+", help="only print the markdown of these JSON reports, combined")
    p.add_argument("--markdown", help="with --report: write the markdown here")
    return p




def markdown(reps: list[dict]) -> str:
    first = reps[0]
    L = ["| run | configuration | total ms | read ms (engine) | io_ms (waited) | mem_ms | compute ms | predictor ms | "
         "total / max(read, CPU) | CPU ms: process / reader threads | GB/token | reads/token | engine GB/s | "
         "fio GB/s, same mix: file / one layer | engine / fio: file / one layer | dropped/token | lookahead recall | "
         "load avg |", "|---" * 18 + "|"]
    for rep in reps:
        for name, r in rep["runs"].items():
            if "error" in r:
                L.append(f"| {rep['date']} | {name} | failed: {r['error']} |" + " |" * 16)
                continue
            cpu = r["total_ms"] - r["io_ms"]
            eng = r["bytes_read"] / r["read_ms"] / 1e6 if r["read_ms"] else None
            f = r["fio"]["bw_bytes"] / GB
            fl = r["fio_layer"]["bw_bytes"] / GB if "fio_layer" in r else None  # (runs before it was measured)
            L.append(f"| {rep['date']} | {name} | {number(r['total_ms'])} | {number(r['read_ms'])} | {number(r['io_ms'])} | {number(r['mem_ms'])} | "
                     f"{number(r['compute_ms'])} | {number(r['predictor_ms'])} | {r['total_ms'] / max(r['read_ms'], cpu):.2f} | "
                     f"{number(r.get('cpu_ms'))} / {number(r.get('io_cpu_ms'))} | "
                     f"{r['bytes_read'] / GB:.3f} | {number(r['reads'])} | {number(eng, 3)} | {f:.3f} / {number(fl, 3)} | "
                     f"{number(eng / f if eng else None, 2)} / {number(eng / fl if eng and fl else None, 2)} | "
                     f"{number(r['neurons_dropped'])} | "
                     f"{number(r.get('read_ahead_recall'), 2)} | {r['load_average_at_start']:.1f}–{r['load_average_after']:.1f} |")
    L += ["", "Runs: " + "; ".join(f"`{rep['command']}` ({rep['date']})" for rep in reps),
          f"memory limit {first['memory_limit'] / GB:.2f} GB (DRAM budget {first['dram_budget'] / GB:.2f} GB of "
          f"{first['model_bytes'] / GB:.2f} GB); {first['fio_version']}"]
    for rep in reps:
        for name, r in rep["runs"].items():
            for key, what in (("read_ahead_recall_per_layer", "lookahead recall"),
                              ("read_ahead_precision_per_layer", "lookahead precision"),
                              ("read_ahead_share_per_layer", "share of the loaded neurons read ahead")):
                if r.get(key):
                    L.append(f"- {rep['date']} {name}: {what} per layer " + " ".join(
                        "-" if x is None else f"{x:.2f}" for x in r[key]))
            if r.get("read_ahead_cut") and r.get("read_ahead_recall") not in (None, 1.0):
                L.append(f"- {rep['date']} {name}: read-ahead cut per layer at the end (index into "
                         "ReadAhead.CUTS, - paused) " + " ".join("-" if c is None else str(c)
                                                                       for c in r["read_ahead_cut"]))
        for name, r in rep["runs"].items():
            if "error" not in r:
                L.append(f"- {name}: fio mix `{r['fio']['bssplit']}` ({r['fio']['threads']} jobs, mean read "
                         f"{r['fio']['mean_read_bytes'] / 1024:.0f} KiB; the engine's: "
                         f"{r['bytes_read'] / max(r['reads'], 1) / 1024:.0f} KiB)")
        if rep.get("fio_gap"):
            g = rep["fio_gap"]
            L.append(f"- gap cost model (fio, same jobs): a read costs {g['per_read_us']:.0f} us + size / "
                     f"{number(g['bandwidth_mibps'])} MiB/s: gaps under {g['gap_bytes']:,} bytes are read through")
        if rep.get("replay"):
            rp = rep["replay"]
            gaps = list(rp["none"])
            L += ["", f"Replay, reads / bundles per token over {rp['tokens']} held-out trace tokens (window cache, "
                  "unlimited; every layer):", "", "| order | " + " | ".join(f"gap {g} bundles" for g in gaps) + " |",
                  "|---" * (len(gaps) + 1) + "|"]
            for order in ("none", "coactivation"):
                L.append(f"| {order} | " + " | ".join(f"{rp[order][g]['reads']:,.0f} / {rp[order][g]['bundles']:,.0f}"
                                                     for g in gaps) + " |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
