"""The sparse decode token's CPU overhead outside the math, per runtime function (issues #15, #23).

Each configuration runs in a child process that wraps the runtime's per-token functions (the neuron
cache's evict/reserve/append, the FFN reader's and the I/O engine's request building, the native AIO
submit and reap syscalls, the predictor, the plan's steps, placing rows) with timers of wall time and
of the calling thread's CPU time, loads the model in sparse mode at a DRAM budget with active sets
replayed from an activation trace (bench/models/activation_trace.py), warms up and decodes --tokens tokens. Reported per
token: the token's time split as the runtime splits it (io_ms, mem_ms, predictor_ms, compute_ms) and
the math's parts (the backend's part timer), "other" = compute_ms minus the math (what compute_ms holds
that is not math), the process's and the generating thread's CPU time, and per wrapped function its
calls, wall ms and thread CPU ms (inclusive: a function's time includes what it calls). Wall time well
above thread CPU time is waiting (for example an io_submit that sleeps until the disk queue has room).

`--src DIR` (repeatable) runs every configuration from another checkout too (e.g. a `git archive` of
main before a change), interleaved round by round: before and after in one run. `--submit-probe` times
io_submit alone: calls of N random bundle reads of the model's FFN file through the AIO engine with
every read submitted by the caller (how long the submit takes, and how much of it is CPU).

    python -m bench compute overhead MODEL --trace T.npz --dram-budget 0.5 --context 512 --configs default
    python -m bench compute overhead MODEL --trace T.npz --src OTHER_CHECKOUT --src . --rounds 2 --json-out r.json
    python -m bench compute overhead MODEL --submit-probe

"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from bench.harness import ROOT, command_line, module_argv, spread


INLINE = {"flashllm.io.aio.AioQueue.INLINE_SHARE": 1e9}  # every read submitted by the caller (no submitter thread)
CONFIGS = {"default": {}, "no-overlap": {"read_ahead": False}, "threads": {"aio_depth": 0},
           "1t": {"compute_threads": 1}, "no-overlap-1t": {"read_ahead": False, "compute_threads": 1},
           "inline": INLINE, "inline-1t": {**INLINE, "compute_threads": 1},
           "nice5": {"flashllm.io.aio.AioQueue.SUBMITTER_NICE": 5}, "nice19": {"flashllm.io.aio.AioQueue.SUBMITTER_NICE": 19}}
# keys "module.Class.ATTR" are class attributes set in the child (those a checkout lacks are skipped)

# module, qualified name: the functions timed (those a checkout lacks are skipped; one name in several modules is
# one probe)
PROBES = [
    ("flashllm.modes.registry", "SparseMode.ffn"), ("flashllm.modes.registry", "SparseMode._load"),
    ("flashllm.modes.registry", "SparseMode._lookahead"), ("flashllm.modes.registry", "SparseMode._finish_prefetch"),
    ("flashllm.modes.registry", "SparseMode._fit"), ("flashllm.modes.registry", "SparseMode._compute"),
    ("flashllm.modes.registry", "predict_scored"), ("flashllm.modes.registry", "union"),  # (before flashllm/modes/sparse/mode.py)
    ("flashllm.modes.sparse.mode", "predict_scored"), ("flashllm.modes.sparse.read_ahead", "predict_scored"),
    ("flashllm.modes.sparse.mode", "union"), ("flashllm.modes.sparse.read_ahead", "union"),
    ("flashllm.modes.sparse.neuron_cache", "NeuronCache.evict"), ("flashllm.modes.sparse.neuron_cache", "NeuronCache.reserve"),
    ("flashllm.modes.sparse.neuron_cache", "NeuronCache.insert"), ("flashllm.modes.sparse.neuron_cache", "NeuronCache.append"),
    ("flashllm.modes.sparse.neuron_cache", "NeuronCache.free_rows"),
    ("flashllm.backends.torch.backend", "TorchRowStore.placed"), ("flashllm.backends.torch.backend", "TorchRowStore.move"),
    ("flashllm.io.ffn_reader", "FFNReader.submit"), ("flashllm.io.ffn_reader", "PendingNeurons.wait"),
    ("flashllm.io.reader", "FlashReader.submit_rows"), ("flashllm.io.reader", "PendingRead.wait"),
    ("flashllm.io.aio", "AioQueue.add"), ("flashllm.io.aio", "AioQueue.progress"),
    ("flashllm.io.aio", "AioContext.submit"), ("flashllm.io.aio", "AioContext.reap"),
    ("flashllm.backends.base", "Backend.low_rank"), ("flashllm.backends.torch.backend", "TorchBackend.norm"),
    ("flashllm.backends.torch.backend", "TorchBackend.linear"), ("flashllm.io.read_list", "Reads.plan"),
    ("flashllm.modes.registry", "SparseMode._poll"),
]


class Probe:
    """Inclusive wall and thread-CPU seconds and calls of one function (any thread)."""

    def __init__(self, name: str):
        self.name = name
        self.reset()

    def reset(self) -> None:
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.wall += time.perf_counter() - w0
                self.cpu += time.thread_time() - c0
                self.calls += 1
        return timed


def install_probes() -> list[Probe]:
    probes = {}
    for module, qual in PROBES:
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        *path, attr = qual.split(".")
        for p in path:
            owner = getattr(owner, p, None)
        if owner is None or not hasattr(owner, attr):
            continue
        probe = probes.setdefault(qual, Probe(qual))
        setattr(owner, attr, probe.wrap(getattr(owner, attr)))
    return list(probes.values())


def matvec_probes(lib, probes: list) -> None:
    """Time the native mat-vec (backends/native) per matrix shape: probe "native matvec ROWSxCOLS"."""
    raw, by_shape = lib.matvec, {}

    def matvec(dt, w, rows, cols, *rest):
        timed = by_shape.get((rows, cols))
        if timed is None:
            probe = Probe(f"native matvec {rows}x{cols}")
            probes.append(probe)
            timed = by_shape[rows, cols] = probe.wrap(raw)
        return timed(dt, w, rows, cols, *rest)
    lib.matvec = matvec


def child(args) -> dict:
    probes = install_probes()
    import flashllm
    from flashllm.stats import PartTimer

    # the replay and its predictor stand-in from the checkout under test (--src: the child runs there)
    from bench.models import activation_trace as trace_mod

    options = {k: v for k, v in CONFIGS[args.config].items() if not k.startswith("flashllm.")}
    for key, value in CONFIGS[args.config].items():
        if key.startswith("flashllm."):
            module, cls, attr = key.rsplit(".", 2)
            owner = getattr(importlib.import_module(module), cls, None)
            if owner is not None and hasattr(owner, attr):
                setattr(owner, attr, value)
    load = dict(mode="sparse", dram_budget=args.dram_budget, window=args.window, context=args.context,
                predictor=trace_mod.trace_predictor_factory(args.trace, 0, args.predictor_rank), **options)
    t0 = time.perf_counter()
    model = flashllm.load(args.model_dir, **load)
    load_s = time.perf_counter() - t0
    B = model.backend
    if getattr(B, "native", None) is not None:
        matvec_probes(B.native.lib, probes)
    timer = PartTimer(B.sync)
    ids = list(range(1, args.warmup + args.tokens + 2))
    model._costs = []
    model.forward(ids[:1], 0)
    tokens = []
    for i, t in enumerate(ids[1:]):
        measured = i >= args.warmup
        B.parts = timer if measured else None
        timer.reset()
        for p in probes:
            p.reset()
        c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        model.forward([t], i + 1)
        wall, cpu, main = time.perf_counter() - w0, time.process_time() - c0, time.thread_time() - m0
        if not measured:
            continue
        cost = model._costs[-1]
        tokens.append(dict(
            total_ms=cost.total_ms, io_ms=cost.io_ms, mem_ms=cost.mem_ms, predictor_ms=cost.predictor_ms,
            compute_ms=cost.compute_ms, math_ms=sum(timer.ms.values()), parts=dict(timer.ms),
            read_ms=cost.read_ms, reads=cost.reads, bytes_read=cost.bytes_read, wall_ms=wall * 1e3,
            process_cpu_ms=cpu * 1e3, main_cpu_ms=main * 1e3, neurons_read_ahead=cost.neurons_read_ahead,
            neurons_dropped=cost.neurons_dropped,
            probes={p.name: (p.calls, p.wall * 1e3, p.cpu * 1e3) for p in probes}))
    B.parts = None
    keys = [k for k in tokens[0] if k not in ("parts", "probes")]
    out = {k: statistics.fmean(t[k] for t in tokens) for k in keys}
    out["other_ms"] = out["compute_ms"] - out["math_ms"]
    out["parts"] = {k: statistics.fmean(t["parts"][k] for t in tokens) for k in tokens[0]["parts"]}
    out["probes"] = {name: [statistics.fmean(t["probes"][name][j] for t in tokens) for j in range(3)]
                     for name in tokens[0]["probes"]}
    plan = model.mode_impl.describe()
    out.update(config=args.config, load_s=load_s, load=os.getloadavg()[0], read_ahead=plan.get("read_ahead"),
               read_ahead_paused=plan.get("read_ahead_paused"))
    return out


def run_child(args, src: str, config: str) -> dict:
    """One config's child, run in the checkout `src` (its flashllm and bench are the ones imported)."""
    argv = module_argv("bench.compute.cpu_overhead", Path(args.model_dir).resolve(), "--child", config, "--trace",
                       Path(args.trace).resolve(), "--dram-budget", args.dram_budget, "--window", args.window,
                       "--context", args.context, "--tokens", args.tokens, "--warmup", args.warmup,
                       "--predictor-rank", args.predictor_rank)
    out = subprocess.run(argv, capture_output=True, text=True, cwd=Path(src).resolve())
    if out.returncode != 0:
        raise SystemExit(f"cpu_overhead: {src} {config} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def submit_probe(model_dir: str, sizes=(64, 128, 256, 512, 800, 1024), repeats: int = 3) -> None:
    """io_submit alone: per call of n random bundles of ffn.bin, the submit's wall and CPU ms and the wait."""
    import numpy as np

    from flashllm.format import manifest as fmt
    from flashllm.io.aio import AioQueue
    from flashllm.hugepages import aligned_empty
    from flashllm.io.reader import FlashReader

    AioQueue.INLINE_SHARE = 1e9  # every read submitted by the caller, as before the submitter thread
    m = fmt.read_manifest(model_dir, verify=False)
    stride = m.layout.stride
    rng = np.random.default_rng(0)
    with FlashReader(m.path("ffn"), threads=4, aio_depth=2048) as r:
        dest = aligned_empty((max(sizes), stride), np.uint8)
        print(f"engine {r.engine}, {r.size // stride} bundles of {stride} bytes, load {os.getloadavg()[0]:.1f}")
        for n in sizes:
            for _ in range(repeats):
                ids = np.sort(rng.choice(r.size // stride, n, replace=False))
                w0, c0 = time.perf_counter(), time.thread_time()
                pending = r.submit_rows(0, stride, stride, ids, dest, np.arange(n))
                w1, c1 = time.perf_counter(), time.thread_time()
                io = pending.wait()
                w2 = time.perf_counter()
                print(f"{n:5d} reads: submit {(w1 - w0) * 1e3:6.2f} ms (CPU {(c1 - c0) * 1e3:5.2f}), wait "
                      f"{(w2 - w1) * 1e3:6.2f} ms, {io.bytes_read / (w2 - w0) / 1e9:.2f} GB/s")




def report(runs: list[dict], meta: dict) -> str:
    """Markdown: the token split per (checkout, config), then per-function calls, wall and CPU per token."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["src"], r["config"]), []).append(r)
    names = list(groups)
    head = " | ".join(f"{Path(s).name or s} {c}" for s, c in names)
    lines = [f"`{meta['command']}` ({meta['when']}, load average {meta['load']}); ranges over "
             f"{meta['rounds']} rounds of {meta['tokens']} tokens", "",
             f"| per token (ms) | {head} |", "|---|" + "---|" * len(names)]
    for key in ("total_ms", "io_ms", "mem_ms", "predictor_ms", "compute_ms", "math_ms", "other_ms", "read_ms",
                "process_cpu_ms", "main_cpu_ms", "reads", "load"):
        lines.append(f"| {key} | " + " | ".join(spread([r[key] for r in groups[n]]) for n in names) + " |")
    lines += ["", f"| function: calls, wall ms, thread CPU ms per token | {head} |", "|---|" + "---|" * len(names)]
    probes = list(dict.fromkeys(p for r in runs for p in r["probes"]))
    for p in probes:
        cells = []
        for n in names:
            rs = [r["probes"][p] for r in groups[n] if p in r["probes"]]
            cells.append(f"{rs[0][0]:.0f}, {spread([x[1] for x in rs])}, {spread([x[2] for x in rs])}" if rs else "-")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--trace", help="activation trace (bench/models/activation_trace.py record); required but with --submit-probe")
    p.add_argument("--submit-probe", action="store_true", help="only time io_submit of N random bundle reads")
    p.add_argument("--dram-budget", default="0.5", help="(default: %(default)s)")
    p.add_argument("--window", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="KV cache length (default: %(default)s)")
    p.add_argument("--predictor-rank", type=int, default=128, help="trace predictor's cost stand-in (default: %(default)s)")
    p.add_argument("--configs", default="default", help=f"comma-separated, of {', '.join(CONFIGS)} (default: %(default)s)")
    p.add_argument("--src", action="append", default=None,
                   help="a checkout to run from (repeatable; default: this one)")
    p.add_argument("--rounds", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=6, help="measured decode tokens per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--json-out", default=None, help="write the runs as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.child:
        args.config = args.child
        print(json.dumps(child(args)))
        return 0
    if args.submit_probe:
        submit_probe(args.model_dir)
        return 0
    if not args.trace:
        raise SystemExit("cpu_overhead: --trace is required (bench/models/activation_trace.py record)")
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"cpu_overhead: unknown config {c!r} (expected one of {', '.join(CONFIGS)})")
    srcs = args.src or [str(ROOT)]
    loads, runs = [os.getloadavg()[0]], []
    for rnd in range(args.rounds):
        for src in srcs:
            for c in configs:
                print(f"round {rnd + 1}: {src} {c} ...", file=sys.stderr)
                runs.append({**run_child(args, src, c), "src": src, "round": rnd})
                loads.append(os.getloadavg()[0])
    meta = dict(command=command_line("bench.compute.cpu_overhead", argv), rounds=args.rounds,
                tokens=args.tokens, when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                load=spread(loads))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    print(report(runs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
