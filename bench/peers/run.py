"""flashllm beside what users run instead, on one model at one memory limit: llama.cpp and HF accelerate.

Each run is a child process in its own cgroup v1 memory group, made for the run and removed after
it, all with the same memory.limit_in_bytes; page cache is charged to the group, so neither
llama.cpp's mmap nor accelerate's safetensors reads can keep more of the model in memory than the
limit. Before every run the files of every model here are evicted from the page cache
(posix_fadvise DONTNEED, then checked with mincore). Runs are interleaved (round r: flashllm, each
llama.cpp configuration, accelerate; --rounds), each capped by --timeout. Outcome per run: ran,
OOM-killed (the group's oom_kill counter went up), timeout, error, or skipped (peer not installed
or no model file given).

- flashllm: its best configuration, sparse mode (window --window, bundled rows, 32 reader threads),
  DRAM budget --dram-budget of its model, via bench/paper/tables.py's measurement (--warmup tokens
  fill the neuron caches, then --tokens are timed). On random-weight models the active neurons are
  replayed from --trace (bench/models/activation_trace.py): see the caveat printed with every table.
- llama.cpp: llama-bench (-p 0 -n TOKENS -r 1, one untimed warm-up token), per --llama-config:
  `default` (mmap, repacking on), `no-mmap` (-lm none: weights read into process memory) and
  `no-repack` (--repack 0: quantized weights stay in the mmap'd file; F16 is never repacked).
- accelerate: bench/peers/accelerate_decode.py, device_map="auto" with max_memory = the same DRAM budget.

    python -m bench peers run --flashllm DIR --gguf FILE --hf DIR --trace trace.npz --dram-budget 0.5 \\
        --tokens 4 [--rounds 1] [--timeout 900] [--markdown peers.md] [--json-out peers.json]

The memory limit is the DRAM budget + the measured RSS of an interpreter that imported torch +
--cgroup-slack MiB (as bench/paper/tables.py --cgroup), the same for every peer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from flashllm.format import manifest as fmt
from flashllm.budget import budget_bytes, parse_budget
from flashllm.errors import FlashLLMError
from bench import harness
from bench.harness import GB, MiB, RESULTS, ROOT, MemoryGroup, command_line, llama_cpp_dir, module_argv
from bench.paper import report as paper_report
from bench.paper import tables as paper_tables
from bench.peers import report as peers_report


def markdown(result: dict) -> str:
    """A result record's report (`python -m bench report peers`; the record says name, date and command)."""
    return peers_report.markdown(result, header=False)

DEFAULT_LLAMA_CPP = llama_cpp_dir()
# llama-bench options per configuration: its default (mmap'd weights, CPU repacking of quantized types
# allowed); weights read into process memory instead of mmap; no repacking (every weight stays in the mmap).
LLAMA_CONFIGS = {"default": [], "no-mmap": ["-lm", "none"], "no-repack": ["--repack", "0"],
                 "no-repack-unlimited": ["--repack", "0"]}
UNLIMITED = "-unlimited"  # a configuration run without the memory limit: its compute alone (the projection's)
# flashllm's expert routing on an MoE model (bench/moe/run.py): the model's own router (random weights:
# random routing, as llama.cpp's on the same shape), the embedded trained MoE's routing replayed, or top-k
# drawn uniformly per token and layer (no reuse between tokens: the worst case for an expert cache).
# A "+prefetch" suffix turns expert prefetch on for that run.
MOE_ROUTINGS = {"model": "its own", "replay": "replayed", "uniform": "uniform random"}
PREFETCH = "+prefetch"

DEFAULT_MOE_TRACE = RESULTS / "models" / "tiny_moe_routing.npz"


# -- running one child in its own memory group ---------------------------------------------------
def run_child(argv: list[str], limit: int | None, drop: list[Path], timeout: float, name: str, log) -> dict:
    """Evict `drop` from the page cache, run argv in a fresh memory group (if `limit`), remove the group."""
    harness.drop_page_cache(drop)
    res = {"page_cache_at_start": harness.cached_fraction(drop), "argv": argv, "load_average": harness.load()}
    group = MemoryGroup(limit, name=name) if limit else None
    # bytes the child read from storage (page faults on an mmap'd file, buffered and direct reads alike):
    # the kernel's per-task read accounting, in 512-byte blocks, of the children this process has waited for
    inblock = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(group.command(argv) if group else argv, stdout=out, stderr=err,
                                start_new_session=True, cwd=ROOT)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # timed out, or we are being stopped: end the child's whole session
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            res["wall_s"] = time.perf_counter() - t0
            res["storage_bytes_read"] = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - inblock) * 512
            usage = group.usage() if group else {}
            if group:
                res["cgroup"], res["cgroup_limit"] = str(group.path), group.limit
                group.remove()
        out.seek(0)
        err.seek(0)
        res["stdout"], res["stderr_tail"] = out.read(), err.read()[-1500:]
    res.update(returncode=proc.returncode, timed_out=timed_out, cgroup_peak=usage.get("peak_bytes"),
               failcnt=usage.get("failcnt"), oom_kills=usage.get("oom_kills"))
    res["outcome"] = peers_report.outcome(proc.returncode, timed_out, usage.get("oom_kills"))
    log(f"  {res['outcome']} in {res['wall_s']:.0f} s, cgroup peak "
        f"{(res['cgroup_peak'] or 0) / GB:.2f} GB, oom_kill {res['oom_kills']}")
    return res


# -- the disk's read-ahead --------------------------------------------------------------------
def read_ahead_path(path) -> Path | None:
    """sysfs read_ahead_kb of the block device holding `path` (None if there is none): a page fault on an
    mmap'd file reads that much around the page, so it sets what llama.cpp's mmap reads (flashllm reads
    direct)."""
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):  # a disk, or a partition of one
        if (queue / "read_ahead_kb").is_file():
            return queue / "read_ahead_kb"
    return None


def read_ahead_kb(path) -> int | None:
    """The read-ahead of the block device holding `path` (KiB; None if unknown)."""
    file = read_ahead_path(path)
    try:
        return int(file.read_text()) if file else None
    except (OSError, ValueError):
        return None


@contextmanager
def read_ahead(file: Path | None, kb: int | None):
    """The disk's read-ahead set to `kb` KiB for the block (None: left as it is), restored afterwards."""
    if file is None or kb is None:
        yield
        return
    old = file.read_text().strip()
    file.write_text(str(kb))
    try:
        yield
    finally:
        file.write_text(old)


# -- the peers -------------------------------------------------------------------------------
def flashllm_argv(args, model_dir: Path, budget: int, tmp: Path, routing: str | None = None,
                  torch_threads: int = 1, tag: str = "") -> tuple[list[str], Path]:
    """The flashllm child: bench/paper/tables.py's measurement (dense-FFN models, sparse mode) or, for a
    mixture-of-experts model, bench/moe/run.py's (experts streamed, `routing`, `torch_threads`)."""
    name = f"{routing or 'ffn'}{tag}"
    spec, result = tmp / f"flashllm-run-{name}.json", tmp / f"flashllm-result-{name}.json"
    if routing is not None:
        name, prefetch = routing.removesuffix(PREFETCH), routing.endswith(PREFETCH)
        run = dict(label=f"flashllm ({routing})", model_dir=str(model_dir), budget_bytes=budget,
                   dtype=paper_tables.compute_dtype("auto", model_dir, "torch"), policy=args.moe_policy,
                   prefetch=prefetch, window=args.window, threads=32, seed=args.seed,
                   prompt=1 + args.warmup, tokens=args.tokens,
                   routing=f"replay:{args.moe_trace}" if name == "replay" else name,
                   torch_threads=torch_threads, kernels="tuned",
                   quantize_resident=args.quantize_resident)
        spec.write_text(json.dumps(run))
        return module_argv("bench.moe.run", "--run-one", spec, "--result", result), result
    run = dict(label="flashllm", mode="sparse", window=args.window, bundled=True, backend="torch", budget=budget,
               threads=32, aio_depth=None, trace=args.trace, seed=args.seed,
               predictor="trace" if args.trace else "auto", predictor_rank=128, torch_threads=args.threads,
               tokens=args.tokens, warmup=args.warmup, model_dir=str(model_dir),
               dtype=args.dtype, quantize_resident=args.quantize_resident)
    if run["predictor"] == "auto":
        run["predictor"] = "lowrank" if (model_dir / "predictors.json").is_file() else "oracle"
    spec.write_text(json.dumps(run))
    return module_argv("bench.paper.tables", "--run-one", spec, "--result", result), result


def flashllm_runs(args, budget: int, tmp: Path) -> list[dict]:
    """flashllm's runs of a round: one; for an MoE model one per --moe-routing."""
    model_dir = Path(args.flashllm)
    if not fmt.read_manifest(model_dir, verify=False).spec.is_moe:
        run = dict(peer="flashllm", label="flashllm (sparse)" + (f", resident {args.quantize_resident}"
                                                                 if args.quantize_resident != "none" else ""))
        run["argv"], run["result"] = flashllm_argv(args, model_dir, budget, tmp)
        return [run]
    runs, dirs = [], [model_dir] + ([Path(args.flashllm_compare)] if args.flashllm_compare else [])
    threads = args.flashllm_threads or [args.threads or 1]  # moe_run's default: 1
    for k, (d, routing, n) in enumerate((d, r, n) for r in args.moe_routing for n in threads for d in dirs):
        packing = fmt.read_manifest(d, verify=False).layout.packing
        extra = [f"experts {'packed ' + packing if packing else 'as rows'}"] * bool(args.flashllm_compare) + \
            [f"{n} thread{'s' * (n > 1)}"] * (len(threads) > 1)
        run = dict(peer="flashllm", moe=True, routing=routing, tokens=args.tokens,
                   label=f"flashllm (experts streamed, {MOE_ROUTINGS[routing.removesuffix(PREFETCH)]} routing"
                         f"{', prefetch' if routing.endswith(PREFETCH) else ''}{''.join(', ' + e for e in extra)})"
                         + (f", resident {args.quantize_resident}" if args.quantize_resident != "none" else ""))
        run["argv"], run["result"] = flashllm_argv(args, d, budget, tmp, routing, n, f"-{k}")
        runs.append(run)
    return runs


def plan(args, budget: int, tmp: Path) -> list[dict]:
    """One round's runs: label, peer, argv (None: skipped, with why) and how to read the result."""
    runs = flashllm_runs(args, budget, tmp)
    bench_bin = Path(args.llama_cpp) / "bin" / "llama-bench"
    for name, kb in ((c, kb) for c in args.llama_config for kb in args.read_ahead_kb or [None]):
        run = dict(peer="llama.cpp", label=f"llama.cpp ({name}" + (f", read-ahead {kb} KiB)" if kb else ")"),
                   read_ahead_kb=kb, unlimited=name.endswith(UNLIMITED))
        if not args.gguf:
            run["skipped"] = "no --gguf model"
        elif not bench_bin.is_file():
            run["skipped"] = f"not installed ({bench_bin}; bench/build_llama_cpp.sh builds it, --llama-cpp or $LLAMA_CPP_DIR points at it)"
        else:
            run["argv"] = [str(bench_bin), "-m", str(args.gguf), "-p", "0", "-n", str(args.tokens), "-r", "1",
                           "-t", str(args.threads or os.cpu_count()), "-o", "json", *LLAMA_CONFIGS[name]]
        runs.append(run)
    run = dict(peer="accelerate", label="HF accelerate (disk offload)")
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        run["skipped"] = "not installed (pip install -e '.[bench]')"
    if not args.hf:
        run["skipped"] = "no --hf checkpoint"
    if "skipped" not in run:
        run["progress"] = tmp / "accelerate.jsonl"
        run["argv"] = module_argv("bench.peers.accelerate_decode", args.hf, "--max-memory", budget, "--tokens", args.tokens,
                                  "--progress", run["progress"])
        if args.threads:
            run["argv"] += ["--threads", str(args.threads)]
    runs.append(run)
    return [r for r in runs if r["peer"] in args.peers]


def read_result(run: dict, res: dict) -> dict:
    """The run's figures from what its child left (even a killed accelerate run's tokens so far)."""
    try:
        if run["peer"] == "flashllm" and res["outcome"] == "ran" and run.get("moe"):
            r = json.loads(run["result"].read_text())
            return {"ms_per_token": r["total_ms"], "load_s": r["load_s"], "io_ms": r["io_ms"], "mem_ms": r["mem_ms"],
                    "compute_ms": r["compute_ms"], "predictor_ms": r["predictor_ms"], "bytes_read": r["bytes_read"],
                    "dram_bytes": r["dram_bytes"], "expert_hit_rate": r["expert_hit_rate"],
                    "expert_slots": r.get("expert_slots"), "routing": run["routing"], "cpu_ms": r.get("cpu_ms"),
                    "tokens": run["tokens"], "prefetch_recall": r.get("expert_read_ahead_recall"),
                    "experts_prefetched": r.get("experts_read_ahead"), "prefetch_wasted": r.get("experts_read_ahead_unused"),
                    "slots_per_layer": (r.get("cache_capacity") or [None])[0]}
        if run["peer"] == "flashllm" and res["outcome"] == "ran":
            r = json.loads(run["result"].read_text())
            return {"ms_per_token": r["total_ms"], "tokens": r["decode_tokens"], "load_s": r["load_s"],
                    "io_ms": r["io_ms"], "mem_ms": r["mem_ms"], "compute_ms": r["compute_ms"],
                    "predictor_ms": r["predictor_ms"], "bytes_read": r["bytes_read"], "dram_bytes": r["dram_bytes"],
                    "active_fraction": r["predicted"] / (r["n_layers"] * r["d_ffn"]),
                    "dropped_fraction": r["neurons_dropped"] / (r["n_layers"] * r["d_ffn"]),
                    "predictor_method": r.get("predictor_method"), "predictor_kind": r.get("predictor_kind"),
                    "compute_dtype": r["compute_dtype"]}
        if run["peer"] == "llama.cpp" and res["outcome"] == "ran":
            return peers_report.parse_llama_bench(res["stdout"])
        if run["peer"] == "accelerate" and run["progress"].is_file():
            return peers_report.parse_progress(run["progress"].read_text())
    except (ValueError, KeyError, OSError) as exc:
        return {"parse_error": f"{type(exc).__name__}: {exc}"}
    return {}


def model_files(args) -> dict[str, list[Path]]:
    files = {"flashllm": harness.model_files(args.flashllm)}
    if args.gguf:
        files["llama.cpp"] = [Path(args.gguf)]
    if args.hf:
        files["accelerate"] = sorted(Path(args.hf).glob("*.safetensors"))
    return files


def versions(args) -> dict:
    out = {"flashllm": harness.code_version()}
    version_file = Path(args.llama_cpp) / "VERSION"
    if version_file.is_file():
        out["llama.cpp"] = " / ".join(version_file.read_text().split("\n")[:2])
    for pkg in ("torch", "transformers", "accelerate"):
        try:
            out[pkg] = __import__(pkg).__version__
        except ImportError:
            out[pkg] = "not installed"
    return out


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flashllm", required=True, help="flashllm model directory")
    p.add_argument("--flashllm-compare", default=None, metavar="DIR",
                   help="MoE: a second flashllm directory of the same model (e.g. its experts in the other "
                   "--expert-layout), run beside --flashllm with the same budget")
    p.add_argument("--flashllm-threads", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="MoE: flashllm's torch threads, one run per value, e.g. 1,2 (default: --threads, else 1)")
    p.add_argument("--gguf", default=None, help="the same model as GGUF (bench/peers/gguf_convert.py) for llama.cpp")
    p.add_argument("--hf", default=None, help="the same model as an HF checkpoint, for accelerate")
    p.add_argument("--dram-budget", type=parse_budget, default=0.5,
                   help="flashllm's DRAM budget (of its model: 0.5, 50%%, 6GiB); accelerate's max_memory "
                   "(default: %(default)s)")
    p.add_argument("--budget-of", choices=["flashllm", "gguf"], default="flashllm",
                   help="the model files a fractional --dram-budget is of: flashllm's, or the GGUF's (e.g. for "
                   "quantized models, whose flashllm files hold float16 resident weights that load quantized "
                   "with --quantize-resident) (default: %(default)s)")
    p.add_argument("--dtype", default=None, help="flashllm's compute dtype on a dense-FFN model (default: the "
                   "runtime's, the storage dtype on torch CPU: float16 files read straight into the cache rows)")
    p.add_argument("--quantize-resident", default="none", choices=["none", "int8", "int4"],
                   help="flashllm holds attention, embedding and lm_head quantized (flashllm.load's "
                   "quantize_resident) (default: %(default)s)")
    p.add_argument("--moe-routing", type=lambda s: s.split(","), default=["model", "replay"],
                   help="MoE models: flashllm's expert routing per run: model (its own router), replay "
                   "(--moe-trace), uniform (k experts drawn uniformly per token and layer); a +prefetch suffix "
                   "(replay+prefetch) turns expert prefetch on for that run (default: model,replay)")
    p.add_argument("--moe-trace", default=str(DEFAULT_MOE_TRACE),
                   help="routing trace to replay (bench/models/routing_trace.py) (default: %(default)s)")
    p.add_argument("--moe-policy", default="lru", help="MoE expert-cache policy (default: %(default)s)")
    p.add_argument("--cgroup-limit", type=parse_budget, default=None,
                   help="the memory group's limit itself (a fraction of the --budget-of model files, or bytes: 25%%, "
                   "2GiB); flashllm's DRAM budget is then the limit less the interpreter baseline and "
                   "--cgroup-slack, and --dram-budget is not used (default: limit = budget + baseline + slack)")
    p.add_argument("--cgroup-slack", type=int, default=1024, help="MiB in the limit above budget + interpreter "
                   "baseline (default: %(default)s)")
    p.add_argument("--no-cgroup", action="store_true", help="run without a memory limit (the table says so)")
    p.add_argument("--trace", default=None, help="activation trace for flashllm on random weights (bench/models/activation_trace.py)")
    p.add_argument("--tokens", type=int, default=4, help="timed decode tokens per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="flashllm decode tokens before the timed ones "
                   "(default: %(default)s)")
    p.add_argument("--window", type=int, default=4, help="flashllm's window (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="compute threads for every peer (default: all cores)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all runs (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default: %(default)s)")
    p.add_argument("--peers", type=lambda s: s.split(","), default=["flashllm", "llama.cpp", "accelerate"],
                   help="which to run (default: flashllm,llama.cpp,accelerate)")
    p.add_argument("--llama-config", type=lambda s: s.split(","), default=list(LLAMA_CONFIGS),
                   help=f"llama.cpp configurations: {', '.join(LLAMA_CONFIGS)} (default: all)")
    p.add_argument("--read-ahead-kb", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="run each llama.cpp configuration with the disk's read-ahead at each of these KiB (e.g. "
                   "128,8192; root; restored after each run): its mmap'd weights are paged in with read-ahead around "
                   "every fault (default: the disk's setting as it is)")
    p.add_argument("--llama-cpp", default=str(DEFAULT_LLAMA_CPP), help="bench/build_llama_cpp.sh's prefix "
                   "(default: $LLAMA_CPP_DIR, else %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="", help="what the table is of (e.g. 'Llama-7B shape, float16, 50%%')")
    p.add_argument("--json-out", default=None, help="write the JSON report here")
    p.add_argument("--markdown", default=None, help="append the markdown section here")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    unknown = [c for c in args.llama_config if c not in LLAMA_CONFIGS]
    if unknown:
        raise SystemExit(f"peers: error: --llama-config {','.join(unknown)}: choose from {', '.join(LLAMA_CONFIGS)}")
    unknown = [r for r in args.moe_routing if r.removesuffix(PREFETCH) not in MOE_ROUTINGS]
    if unknown:
        raise SystemExit(f"peers: error: --moe-routing {','.join(unknown)}: choose from {', '.join(MOE_ROUTINGS)}")
    if args.budget_of == "gguf" and not args.gguf:
        raise SystemExit("peers: error: --budget-of gguf needs --gguf")
    log = (lambda m: None) if args.quiet else (lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", file=sys.stderr,
                                                               flush=True))
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: kill the child, remove its group
    try:
        return _run(args, argv, log)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args, argv, log) -> dict:
    """main() after its argument checks: the rounds of runs, the table, the report files."""
    # Idle OpenMP threads sleep instead of spinning (2 busy cores); every child, llama.cpp's OpenMP included.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for flag, path in (("--gguf", args.gguf), ("--hf", args.hf), ("--trace", args.trace), ("--moe-trace", args.moe_trace)):
        if path and not Path(path).exists():
            raise SystemExit(f"peers: error: {flag} {path}: does not exist")
    try:
        manifest = fmt.read_manifest(args.flashllm, verify=False)
    except FlashLLMError as exc:
        raise SystemExit(f"peers: error: --flashllm: {exc}") from None
    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    of_bytes = Path(args.gguf).stat().st_size if args.budget_of == "gguf" else model_bytes
    budget = budget_bytes(args.dram_budget, of_bytes)
    why_not = "--no-cgroup" if args.no_cgroup else MemoryGroup.available()
    base = harness.baseline_rss()
    limit = None if why_not else (budget + base + args.cgroup_slack * MiB) // 4096 * 4096  # as the kernel stores it
    if args.cgroup_limit is not None:  # the group's limit is given; flashllm's budget is what it leaves
        if why_not:
            raise SystemExit(f"peers: error: --cgroup-limit: no memory group can be made ({why_not})")
        limit = budget_bytes(args.cgroup_limit, of_bytes) // 4096 * 4096
        budget = limit - base - args.cgroup_slack * MiB
        if budget <= 0:
            raise SystemExit(f"peers: error: --cgroup-limit {limit / GB:.2f} GB leaves no DRAM budget after the "
                             f"interpreter baseline {base / GB:.2f} GB and --cgroup-slack {args.cgroup_slack} MiB")
    files = model_files(args)
    drop = [f for fs in files.values() for f in fs]
    ra_file = read_ahead_path(args.gguf) if args.read_ahead_kb and args.gguf else None
    if args.read_ahead_kb and args.gguf and ra_file is None:
        raise SystemExit(f"peers: error: --read-ahead-kb: no read_ahead_kb in sysfs for the disk of {args.gguf}")
    report = {"name": args.name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": command_line("bench.peers.run", argv),
              "machine": f"{harness.machine_desc()}, load average {harness.load():.1f} at start", "read_ahead_kb": read_ahead_kb(args.gguf or args.flashllm),
              "versions": versions(args), "model": paper_report.model_desc(manifest, model_bytes),
              "model_bytes": {k: sum(f.stat().st_size for f in fs) for k, fs in files.items()},
              "dram_budget": budget, "budget_of": args.budget_of, "quantize_resident": args.quantize_resident,
              "top_k": manifest.spec.top_k if manifest.spec.is_moe else None,
              "memory_limit": limit, "limit_given": args.cgroup_limit is not None, "baseline_rss": base,
              "cgroup_slack_mib": args.cgroup_slack,
              "no_limit_because": why_not, "trace": args.trace, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
              "tokens": args.tokens, "warmup": args.warmup, "runs": [],
              "read_ahead_runs_kb": args.read_ahead_kb if ra_file else None}
    log(f"memory limit: {limit / GB:.2f} GB" if limit else f"no memory limit: {why_not}")
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for rnd in range(args.rounds):
            (Path(tmp) / str(rnd)).mkdir()
            for k, run in enumerate(plan(args, budget, Path(tmp) / str(rnd))):
                row = {"peer": run["peer"], "label": run["label"], "round": rnd, "unlimited": run.get("unlimited", False),
                       **({"routing": run["routing"]} if "routing" in run else {})}
                if "skipped" in run:
                    row.update(outcome="skipped", why=run["skipped"])
                    log(f"{run['label']}: skipped: {run['skipped']}")
                else:
                    log(f"round {rnd + 1}/{args.rounds}: {run['label']}")
                    with read_ahead(ra_file, run.get("read_ahead_kb")):
                        res = run_child(run["argv"], None if run.get("unlimited") else limit, drop, args.timeout,
                                        f"flashllm-peers-{os.getpid()}-{rnd}-{k}", log)
                    row.update({k2: v for k2, v in res.items() if k2 != "stdout"}, **read_result(run, res))
                report["runs"].append(row)
    rows = peers_report.summarize(report["runs"])
    report["rows"], report["ratios"] = rows, peers_report.ratios(rows, report["runs"])
    print(peers_report.table(rows, report["ratios"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(peers_report.markdown(report))
    return report


if __name__ == "__main__":
    main()
