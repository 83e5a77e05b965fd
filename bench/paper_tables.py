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

    python bench/paper_tables.py MODEL_DIR --dram-budget 0.5 --tokens 32 --trace trace.npz \\
        [--unbundled-dir DIR] [--naive-tokens 3] [--window 4] [--json] [--plot DIR] [--cgroup]

The unbundled rows need an unbundled copy of the model: --unbundled-dir, or for a model written
by bench/make_model.py it is written (same shape and seed, --no-bundle) next to the model and
deleted afterwards. With --trace, active sets come from bench/trace.py's TracePredictor (the method
is printed with every table); without it from --predictor (lowrank if the model has predictors,
else oracle).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime
import errno
import gc
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
from flashllm import format as fmt  # noqa: E402
from flashllm.budget import budget_bytes, parse_budget  # noqa: E402

GB = 1e9  # decimal, as the paper (13.4 GB = 6.7e9 float16 parameters)
MiB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def bench_module(name: str):
    """A sibling bench script as a module (by path: `trace` would otherwise be the stdlib's)."""
    key = f"flashllm_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


# -- one measurement ---------------------------------------------------------------------------
def _vm(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _own_memory_cgroup() -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return path
    except OSError:
        pass
    return None


def measure(run: dict) -> dict:
    """Load the model as `run` says, decode the prompt, warm-up and measured tokens; per-token costs."""
    import flashllm

    if run.get("torch_threads"):
        import torch

        torch.set_num_threads(run["torch_threads"])
    predictor = run.get("predictor") or "oracle"
    if predictor == "trace":
        predictor = bench_module("trace").trace_predictor_factory(run["trace"], run["seed"], run["predictor_rank"])
    n = 1 + run["warmup"] + run["tokens"]
    t0 = time.perf_counter()
    model = flashllm.load(run["model_dir"], backend=run["backend"], mode=run["mode"], predictor=predictor,
                          dram_budget=run["budget"], window=run.get("window") or 1, threads=run["threads"],
                          aio_depth=run.get("aio_depth", 0), gap_bytes=run.get("gap_bytes"), dtype=run.get("dtype"),
                          context=n + 1, quantize_resident=run.get("quantize_resident", "none"),
                          kv_bits=run.get("kv_bits", 16))
    load_s = time.perf_counter() - t0
    read_acc, predicted_acc = [0.0], [0]
    plan = model.plan

    def on_read(io):  # the engine's wall time of each read
        read_acc[0] += io.wall_s

    def on_predict(layer, mask):  # neurons each prediction selects
        predicted_acc[0] += int(mask.sum())

    model.hooks.add("read", on_read)
    model.hooks.add("predict", on_predict)
    ids = np.random.default_rng(run["seed"]).integers(3, model.spec.vocab_size, size=n).tolist()
    read_ms, predicted = [], []
    prof = None
    for pos in range(n):
        if run.get("profile") and pos == 1 + run["warmup"]:  # profile the measured tokens only
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        read_acc[0], predicted_acc[0] = 0.0, 0
        model.forward([ids[pos]], pos)
        read_ms.append(read_acc[0] * 1e3)
        predicted.append(predicted_acc[0])
    if prof is not None:
        prof.disable()
    costs = model.token_stats  # the 1-token prompt first, then each decode token
    decode = costs[1:]
    for c, r, p in zip(decode, read_ms[1:], predicted[1:]):
        c["read_ms"], c["predicted"] = r, p
    measured = decode[run["warmup"]:]
    k = max(len(measured), 1)

    def mean(key):
        return sum(c[key] for c in measured) / k

    row_bytes = model.compute_row_bytes()
    out = {"run": run, "load_s": load_s, "decode_tokens": len(measured), "warmup_tokens": run["warmup"],
           "model_bytes": model.model_bytes, "dram_budget": model.dram_budget, "dram_bytes": model.dram_bytes(),
           "compute_dtype": model.backend.dtype_name,
           "storage_dtype": model.manifest.data["dtype"], "bundled": model.layout.bundled,
           "context": model.context, "gap_bytes": plan.describe().get("gap_bytes"), "n_layers": model.spec.n_layers, "d_ffn": model.spec.d_ffn, "kv_bytes": _kv_bytes(model), "row_bytes": row_bytes,
           "prompt": {k2: costs[0][k2] for k2 in ("bytes_read", "io_ms", "total_ms")}}
    for key in ("bytes_read", "bytes_wasted", "reads", "io_ms", "read_ms", "mem_ms", "compute_ms", "predictor_ms",
                "total_ms", "neurons_dropped", "predicted"):
        out[key] = mean(key)
    if run["mode"] == "sparse":
        cached = sum(sum(c["neurons_cached"]) for c in measured) / k
        out["neurons_cached"] = cached
        out["neurons_loaded"] = sum(sum(c["neurons_loaded"]) for c in measured) / k
        out["cache_capacity"] = plan.capacity
        out["predictor_bytes"] = model.predictor.nbytes()
        out["predictor_kind"] = model.predictor.kind
        if hasattr(model.predictor, "describe"):
            out["predictor_method"] = model.predictor.describe()
        # DRAM holding data: resident weights + KV + predictors + the cache rows in use (not the free ones)
        out["dram_in_use"] = model.backend.nbytes() + model.predictor.nbytes() + cached * row_bytes
    else:
        out["dram_in_use"] = out["dram_bytes"]
    if run["mode"] == "hybrid":
        out["resident_neurons"] = plan.resident_rows
    if run.get("per_token"):
        out["per_token"] = [{key: c[key] for key in ("bytes_read", "reads", "io_ms", "read_ms", "mem_ms", "total_ms",
                                                     "neurons_dropped")} for c in decode]
    if prof is not None:
        out["profile"] = profile_rows(prof, max(run["tokens"], 1))
    out["rss_peak"] = _vm("VmHWM")
    out["cgroup"] = _own_memory_cgroup()
    del model, plan
    gc.collect()
    return out


def io_engine(manifest, threads: int, aio_depth: int) -> str:
    """How the flash I/O engine reads this model's FFN file here (native AIO or preadv threads)."""
    from flashllm.flashio import FlashReader

    with FlashReader(manifest.path("ffn"), threads=threads, aio_depth=aio_depth) as r:
        if r.engine == "aio":
            return f"{threads} in flight, native AIO from {-(-threads // r.aio_depth)} thread(s)"
        return f"{threads} preadv threads ({'O_DIRECT' if r.direct else 'buffered'})"


def profile_rows(prof, tokens: int, top: int = 25) -> list[dict]:
    """The main thread's functions by own time, per measured token (cProfile; I/O threads not included)."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append({"function": where, "calls_per_token": nc / tokens, "own_ms_per_token": tt * 1e3 / tokens,
                     "cumulative_ms_per_token": ct * 1e3 / tokens})
    rows.sort(key=lambda r: -r["own_ms_per_token"])
    return rows[:top]


def _kv_bytes(model) -> int:
    s = model.spec
    return 2 * s.n_layers * model.context * s.n_kv_heads * s.head_dim * model.backend.itemsize


# -- page cache and memory limit ---------------------------------------------------------------
def model_files(model_dir) -> list[Path]:
    m = fmt.read_manifest(model_dir, verify=False)
    return [m.path(k) for k in m.data["files"]]


def drop_page_cache(paths) -> None:
    """Evict the files' pages from the page cache (flushing first; dirty pages cannot be dropped)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths) -> float | None:
    """Fraction of the files' pages in the page cache (mincore), None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        cached = total = 0
        for p in paths:
            size = os.path.getsize(p)
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    pages = -(-size // page)
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    cached += int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())
                    total += pages
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return cached / total if total else 0.0
    except (OSError, AttributeError):
        return None


class MemoryGroup:
    """One cgroup v1 memory group for the benchmark's child processes; removed by `remove()`/at exit."""

    def __init__(self, limit: int, name: str | None = None):
        own = _own_memory_cgroup() or "/"
        parent = CGROUP_ROOT / own.lstrip("/")
        if not os.access(parent, os.W_OK):
            parent = CGROUP_ROOT
        self.path = parent / (name or f"flashllm-bench-{os.getpid()}")
        self.path.mkdir()
        atexit.register(self.remove)
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            self.limit = int((self.path / "memory.limit_in_bytes").read_text())
        except OSError:
            self.remove()
            raise

    @staticmethod
    def available() -> str | None:
        """None if a group can be made here, else why not."""
        if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
            return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
        if os.geteuid() != 0 or not os.access(CGROUP_ROOT, os.W_OK):
            return f"{CGROUP_ROOT} is not writable (needs root)"
        return None

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside the group: a shell moves itself in, then execs (all memory is charged there)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *argv]

    def reset_peak(self) -> None:
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            try:
                (self.path / name).write_text("0")
            except OSError:
                pass

    def usage(self) -> dict:
        def read(name):
            try:
                return int((self.path / name).read_text())
            except (OSError, ValueError):
                return None
        oom_kills = None  # memory.oom_control's "oom_kill N" line (kernels >= 4.13)
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    oom_kills = int(line.split()[1])
        except (OSError, ValueError):
            pass
        return {"peak_bytes": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt"),
                "oom_kills": oom_kills}

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    return
                time.sleep(0.1)  # the last child's exit is still being accounted


def baseline_rss() -> int:
    """RSS of a Python process that imported what a run imports (torch, numpy, flashllm), before loading."""
    code = ("import torch, numpy, flashllm, flashllm.backends.torch_backend, flashllm.modes\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=BENCH.parent).stdout
    return int(out.strip()) * 1024


# -- the runs ----------------------------------------------------------------------------------
class Runner:
    """Runs measurements in this process, or each in a child process (inside the memory group)."""

    def __init__(self, isolate: bool, group: MemoryGroup | None, drop_paths: list[Path], log):
        self.isolate, self.group, self.drop_paths, self.log = isolate or group is not None, group, drop_paths, log

    def __call__(self, run: dict) -> dict:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        before = cached_fraction(self.drop_paths)
        drop_page_cache(self.drop_paths)
        after = cached_fraction(self.drop_paths)
        t0 = time.perf_counter()
        self.log(f"run {run['label']}: {run['mode']} window {run.get('window')} "
                 f"{'bundled' if run['bundled'] else 'unbundled'} {run['backend']} "
                 f"{run['warmup']}+{run['tokens']} tokens")
        if not self.isolate:
            try:
                result = measure(run)
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                result = {"error": f"{type(exc).__name__}: {exc}", "run": run}
        else:
            result = self._child(run)
        result["label"] = run["label"]
        result["load_average_at_start"] = load
        result["page_cache_before_drop"], result["page_cache_at_start"] = before, after
        result["wall_s"] = time.perf_counter() - t0
        if "error" not in result:
            self.log(f"  {result['total_ms']:.0f} ms/token, {result['bytes_read'] / GB:.3f} GB/token, "
                     f"io {result['io_ms']:.0f} ms, mem {result['mem_ms']:.1f} ms, load {result['load_s']:.1f} s, "
                     f"wall {result['wall_s']:.0f} s")
        else:
            self.log(f"  failed: {result['error']}")
        return result

    def _child(self, run: dict) -> dict:
        with tempfile.TemporaryDirectory(prefix="flashllm-bench-") as tmp:
            spec, res = Path(tmp) / "run.json", Path(tmp) / "result.json"
            spec.write_text(json.dumps(run))
            argv = [sys.executable, str(Path(__file__).resolve()), "--run-one", str(spec), "--result", str(res)]
            if self.group is not None:
                self.group.reset_peak()
                argv = self.group.command(argv)
            proc = subprocess.Popen(argv, cwd=BENCH.parent)
            try:
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            usage = self.group.usage() if self.group is not None else None
            if rc != 0 or not res.is_file():
                why = f"exit status {rc}" + (" (killed: out of memory at the cgroup limit?)" if rc in (-9, 137) else "")
                return {"error": why, "run": run, "cgroup_usage": usage}
            result = json.loads(res.read_text())
        if self.group is not None:
            result["cgroup_usage"] = usage
            result["cgroup_limit"] = self.group.limit
            result["cgroup_active"] = result.get("cgroup") is not None and \
                str(self.group.path).endswith(result["cgroup"].lstrip("/"))
        return result


def plan_runs(args, model_dir: Path, unbundled: Path | None, budget: float, predictor: str) -> dict:
    """Every measurement of the report, by name."""
    base = dict(backend="torch", budget=budget, threads=args.threads, aio_depth=args.aio_depth,
                gap_bytes=args.gap_bytes, trace=args.trace,
                seed=args.seed, predictor=predictor, predictor_rank=args.predictor_rank,
                torch_threads=args.torch_threads, quantize_resident=args.quantize_resident, kv_bits=args.kv_bits)

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


# -- tables ------------------------------------------------------------------------------------
TABLE2 = [("naive", "naive", (0, 0, 0, 0)), ("hybrid", "hybrid", (1, 0, 0, 0)),
          ("hybrid+predictor", "hybrid+predictor", (1, 1, 0, 0)), ("+windowing", "+windowing", (1, 1, 1, 0)),
          ("+bundling", "all", (1, 1, 1, 1))]


def _ok(r) -> bool:
    return r is not None and "error" not in r


def table2_rows(results: dict) -> list[dict]:
    rows = []
    for config, key, flags in TABLE2:
        r = results.get(key)
        if not _ok(r):
            continue
        rows.append({"config": config, "hybrid": bool(flags[0]), "predictor": bool(flags[1]),
                     "windowing": bool(flags[2]), "bundling": bool(flags[3]),
                     "window": r["run"].get("window"), "bundled_layout": r["bundled"],
                     "dram_gb": r["dram_in_use"] / GB, "dram_allocated_gb": r["dram_bytes"] / GB,
                     "flash_gb_per_token": r["bytes_read"] / GB,
                     "throughput_gbs": r["bytes_read"] / GB / (r["io_ms"] / 1e3) if r["io_ms"] else None,
                     "io_ms": r["io_ms"], "read_ms": r["read_ms"], "reads_per_token": r["reads"],
                     "neurons_dropped_per_token": r["neurons_dropped"], "tokens": r["decode_tokens"]})
    return rows


def table3_rows(results: dict, backends: list[str]) -> list[dict]:
    rows = []
    for backend in backends:
        suffix = "" if backend == "torch" else f"@{backend}"
        for config in ("naive", "hybrid", "all"):
            r = results.get(config + suffix)
            if not _ok(r):
                continue
            rows.append({"config": config, "backend": backend, "compute_dtype": r["compute_dtype"],
                         "io_ms": r["io_ms"], "read_ms": r["read_ms"], "mem_ms": r["mem_ms"],
                         "compute_ms": r["compute_ms"], "predictor_ms": r["predictor_ms"], "total_ms": r["total_ms"],
                         "flash_gb_per_token": r["bytes_read"] / GB, "dram_gb": r["dram_in_use"] / GB,
                         "dram_allocated_gb": r["dram_bytes"] / GB, "tokens": r["decode_tokens"]})
    return rows


def fig7_rows(results: dict, windows: list[int], k: int) -> list[dict]:
    rows = []
    for w in windows:
        r = results.get("all" if w == k else f"window {w}")
        if not _ok(r):
            continue
        rows.append({"window": w, "dram_gb": r["dram_in_use"] / GB, "flash_gb_per_token": r["bytes_read"] / GB,
                     "io_ms": r["io_ms"], "total_ms": r["total_ms"], "mem_ms": r["mem_ms"],
                     "cached_fraction": r["neurons_cached"] / (r["n_layers"] * r["d_ffn"]),
                     "neurons_dropped_per_token": r["neurons_dropped"],
                     "tokens": r["decode_tokens"]})
    return rows


def fig8_rows(results: dict) -> list[dict]:
    r = results.get("fig8")
    if not _ok(r):
        return []
    return [{"token": i + 1, "io_ms": c["io_ms"], "read_ms": c["read_ms"], "flash_gb": c["bytes_read"] / GB,
             "total_ms": c["total_ms"]} for i, c in enumerate(r["per_token"])]


def ratios(t3: list[dict]) -> dict:
    by = {(r["backend"], r["config"]): r for r in t3}
    out = {}
    for backend in sorted({r["backend"] for r in t3}):
        a = by.get((backend, "all"))
        if a is None:
            continue
        for other in ("naive", "hybrid"):
            o = by.get((backend, other))
            if o is not None:
                out[f"{other}/all{'' if backend == 'torch' else '@' + backend}"] = {
                    "total": o["total_ms"] / a["total_ms"], "io_ms": o["io_ms"] / max(a["io_ms"], 1e-9),
                    "flash_bytes": o["flash_gb_per_token"] / max(a["flash_gb_per_token"], 1e-12)}
    return out


def trace_report(path, manifest, windows: list[int]) -> dict:
    """The trace's per-layer statistics, and the flash traffic they imply for this model if the neuron
    caches could hold every window's union (no DRAM limit): the floor for the sparse rows."""
    tr = bench_module("trace")
    trace = tr.Trace.load(path)
    summary = trace.summary(windows=windows)
    spec, lay = manifest.spec, manifest.layout
    lmap = tr.layer_map(trace.n_layers, spec.n_layers)
    per_token = lay.d_ffn * lay.stride / GB
    implied = {str(k): sum(summary[f"new_w{k}"][s] for s in lmap) * per_token for k in windows}
    held = {str(k): [summary[f"held_w{k}"][s] for s in lmap] for k in windows}
    meta = {k: v for k, v in trace.meta.items() if k != "summary"}
    return {"meta": meta, "summary": summary, "layer_map": lmap, "unlimited_flash_gb_per_token": implied,
            "held_fraction_per_layer": held}


def _f(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{nd}f}"


def markdown(report: dict) -> str:
    m, L = report["meta"], []
    scale, U = (1.0, "GB") if m["model_gb"] >= 1 else (1e3, "MB")  # the JSON is in GB either way

    def g(x, nd=2):
        return _f(None if x is None else x * scale, nd)
    L.append(f"# LLM in a flash on this machine: Tables 2 and 3, Figures 7 and 8\n")
    L.append(f"- date: {m['date']}")
    L.append(f"- command: `{m['command']}`")
    L.append(f"- machine: {m['machine']}")
    if m.get("code"):
        L.append(f"- code: {m['code']}")
    L.append(f"- model: `{m['model_dir']}`: {m['model_desc']}")
    L.append(f"- DRAM budget: {m['budget_gb']:.2f} GB ({m['budget_arg']} of {m['model_gb']:.2f} GB); the runtime "
             "counts resident weights (in the compute dtype), KV cache, neuron caches and predictors against it")
    L.append(f"- compute: {m['compute']}")
    L.append(f"- active neurons: {m['active_method']}")
    L.append(f"- memory limit: {m['memory_limit']}")
    L.append(f"- page cache: {m['page_cache']}")
    L.append(f"- tokens: {m['tokens_desc']}")
    L.append(f"- units: {U} = 10^{9 if U == 'GB' else 6} bytes; ms per decode token; \"I/O latency\" is the runtime's io_ms (flash reads "
             "plus, for sparse runs, placing the read rows into the cache matrix: with float16 storage and bfloat16 "
             "compute that includes the conversion); \"reads\" is the I/O engine's own wall time for the reads alone")
    L.append("")
    L.append("## Table 2 analogue: flash→DRAM traffic per configuration\n")
    L.append(f"| configuration | hybrid | predictor | windowing | bundling | DRAM in use ({U}) | DRAM allocated ({U}) | "
             f"flash→DRAM ({U}/token) | throughput (GB/s) | I/O latency (ms) | reads (ms) | reads/token | "
             "dropped neurons/token | tokens |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = {True: "✓", False: "✗"}
    for r in report["table2"]:
        L.append(f"| {r['config']} | {yes[r['hybrid']]} | {yes[r['predictor']]} | {yes[r['windowing']]} | "
                 f"{yes[r['bundling']]} | {g(r['dram_gb'])} | {g(r['dram_allocated_gb'])} | "
                 f"{g(r['flash_gb_per_token'], 3)} | {_f(r['throughput_gbs'])} | {_f(r['io_ms'], 0)} | "
                 f"{_f(r['read_ms'], 0)} | {_f(r['reads_per_token'], 0)} | {_f(r['neurons_dropped_per_token'], 0)} | "
                 f"{r['tokens']} |")
    L.append("\nDRAM in use: resident weights + KV cache + predictors + the neuron-cache rows holding neurons "
             "(mean over the measured tokens); allocated: what the runtime reserves (caches at full capacity).")
    L.append("\n## Table 3 analogue: where a decode token's time goes\n")
    L.append(f"| configuration | backend | compute dtype | flash→DRAM ({U}) | I/O (ms) | memory mgmt (ms) | compute (ms) | "
             f"predictor (ms) | total (ms) | DRAM ({U}) | tokens |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["table3"]:
        L.append(f"| {r['config']} | {r['backend']} | {r['compute_dtype']} | {g(r['flash_gb_per_token'], 3)} | "
                 f"{_f(r['io_ms'], 0)} | {_f(r['mem_ms'], 1)} | {_f(r['compute_ms'], 0)} | {_f(r['predictor_ms'], 1)} | "
                 f"{_f(r['total_ms'], 0)} | {g(r['dram_gb'])} | {r['tokens']} |")
    L.append("")
    for name, v in report["ratios"].items():
        L.append(f"- {name}: {v['total']:.2f}× end-to-end, {v['io_ms']:.1f}× I/O time, "
                 f"{v['flash_bytes']:.1f}× flash bytes per token")
    if report.get("notes_table3"):
        L.append("")
        L += [f"- {n}" for n in report["notes_table3"]]
    if report.get("targets"):
        L.append("\n## Targets (paper, CPU) vs this run\n")
        L.append("| target | paper | this run | met |")
        L.append("|---|---|---|---|")
        for t in report["targets"]:
            L.append(f"| {t['what']} | {t['paper']} | {t['here']} | {yes[t['met']] if t['met'] is not None else '-'} |")
    prof = (report["runs"].get("all") or {}).get("profile")
    if prof:
        L.append("\n## Where the \"all\" token goes (cProfile of the measured tokens, main thread)\n")
        L.append("| function | calls/token | own ms/token | cumulative ms/token |")
        L.append("|---|---|---|---|")
        for r in prof[:15]:
            L.append(f"| `{r['function']}` | {r['calls_per_token']:.0f} | {r['own_ms_per_token']:.1f} | "
                     f"{r['cumulative_ms_per_token']:.1f} |")
    if report["fig7"]:
        L.append("\n## Figure 7 analogue: window size vs DRAM vs latency (bundled)\n")
        L.append(f"| window | DRAM in use ({U}) | flash→DRAM ({U}/token) | I/O (ms) | memory mgmt (ms) | total (ms) | "
                 "FFN held in cache | dropped neurons/token | tokens |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in report["fig7"]:
            L.append(f"| {r['window']} | {g(r['dram_gb'])} | {g(r['flash_gb_per_token'], 3)} | {_f(r['io_ms'], 0)} | "
                     f"{_f(r['mem_ms'], 1)} | {_f(r['total_ms'], 0)} | {r['cached_fraction']:.1%} | "
                     f"{_f(r['neurons_dropped_per_token'], 0)} | {r['tokens']} |")
    if report["fig8"]:
        f8 = report["fig8"]
        io = np.array([r["io_ms"] for r in f8])
        L.append(f"\n## Figure 8 analogue: I/O latency over {len(f8)} generated tokens (all, window "
                 f"{report['meta']['window']})\n")
        L.append(f"| tokens | mean I/O (ms) | median | p90 | mean flash→DRAM ({U}) | mean total (ms) |")
        L.append("|---|---|---|---|---|---|")
        edges = [0, 1, 10, 100, len(f8)] if len(f8) > 100 else [0, 1, len(f8)]
        edges = sorted(set(e for e in edges if e <= len(f8)))
        for a, b in zip(edges, edges[1:]):
            part = f8[a:b]
            v = io[a:b]
            L.append(f"| {a + 1}–{b} | {_f(float(v.mean()), 0)} | {_f(float(np.median(v)), 0)} | "
                     f"{_f(float(np.percentile(v, 90)), 0)} | {g(sum(r['flash_gb'] for r in part) / len(part), 3)} | "
                     f"{_f(sum(r['total_ms'] for r in part) / len(part), 0)} |")
    if report.get("trace"):
        t, sm = report["trace"], report["trace"]["summary"]
        k = m["window"]
        L.append(f"\n## The activation trace\n")
        L.append(f"{t['meta']['tokens']} tokens of `{Path(t['meta']['data']).name}` decoded by `{t['meta']['model']}` "
                 f"({t['meta']['predictor']} predictor), recorded {t['meta']['date']}. Per layer of the small model:\n")
        L.append(f"| small layer | large layers | active | new/token w1 | new/token w{k} | held w{k} | recall | "
                 "predicted/true |")
        L.append("|---|---|---|---|---|---|---|---|")
        lmap = t["layer_map"]
        for i, a in enumerate(sm["active"]):
            large = [j for j, s_ in enumerate(lmap) if s_ == i]
            rng_ = f"{large[0]}–{large[-1]}" if large else "-"
            rec = sm.get("recall", [None] * len(sm["active"]))[i]
            pot = sm.get("predicted_over_true", [None] * len(sm["active"]))[i]
            L.append(f"| {i} | {rng_} | {a:.1%} | {sm['new_w1'][i]:.1%} | {sm[f'new_w{k}'][i]:.1%} | "
                     f"{sm[f'held_w{k}'][i]:.1%} | {_f(rec, 3)} | {_f(pot, 2)} |")
        imp = t["unlimited_flash_gb_per_token"]
        L.append("\nWith caches large enough for every window (no DRAM limit), this trace implies per token: " +
                 ", ".join(f"window {w}: {g(v, 3)} {U}" for w, v in imp.items()) + ".")
        cap = next((r for r in report["runs"].values() if _ok(r) and r["run"]["mode"] == "sparse"), None)
        if cap:
            need = max(t["held_fraction_per_layer"][str(k)])
            L.append(f"At this budget each layer's cache holds {cap['cache_capacity']} neurons "
                     f"({cap['cache_capacity'] / cap['d_ffn']:.1%} of the FFN, the same for every layer); the union of "
                     f"the last {k} tokens needs up to {need:.1%} in the densest layers, so there the window shrinks "
                     "and, when even one token's set does not fit, neurons are dropped (counted above).")
    if report.get("plots"):
        L.append("\n## Plots\n")
        L += [f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"]]
    failed = [f"{name}: {r['error']}" for name, r in report["runs"].items() if not _ok(r)]
    if failed:
        L.append("\n## Failed runs\n")
        L += [f"- {f}" for f in failed]
    L.append("\n## Runs\n")
    L.append(f"| run | mode | window | layout | load (s) | tokens (warm-up+measured) | peak RSS ({U}) | cgroup peak ({U}) | "
             "page cache at start | machine load average at start |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        if not _ok(r):
            continue
        cg = (r.get("cgroup_usage") or {}).get("peak_bytes")
        pc = r.get("page_cache_at_start")
        L.append(f"| {name} | {r['run']['mode']} | {r['run'].get('window') or '-'} | "
                 f"{'bundled' if r['bundled'] else 'unbundled'} | {_f(r['load_s'], 1)} | "
                 f"{r['warmup_tokens']}+{r['decode_tokens']} | {g((r.get('rss_peak') or 0) / GB)} | "
                 f"{g(cg / GB) if cg else '-'} | {'-' if pc is None else f'{pc:.1%}'} | "
                 f"{_f(r.get('load_average_at_start'), 1)} |")
    return "\n".join(L) + "\n"


def targets(report: dict) -> list[dict]:
    t3 = {(r["backend"], r["config"]): r for r in report["table3"]}
    a, n = t3.get(("torch", "all")), t3.get(("torch", "naive"))
    out = []
    if a:
        out.append({"what": "flash→DRAM per token (all)", "paper": "13.4 GB → ≤ 0.3 GB",
                    "here": f"{n['flash_gb_per_token']:.1f} GB → {a['flash_gb_per_token']:.3f} GB" if n else
                    f"{a['flash_gb_per_token']:.3f} GB", "met": a["flash_gb_per_token"] <= 0.3})
    if a and n:
        x = n["total_ms"] / a["total_ms"]
        out.append({"what": "end-to-end speed-up over naive", "paper": "≥ 4.8×", "here": f"{x:.2f}×", "met": x >= 4.8})
    if a:
        share = a["mem_ms"] / a["total_ms"]
        out.append({"what": "memory management share of token time (all)", "paper": "≤ 10%",
                    "here": f"{share:.1%} ({a['mem_ms']:.1f} of {a['total_ms']:.0f} ms)", "met": share <= 0.10})
    return out


def plot(report: dict, out_dir: Path, prefix: str = "paper_") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if report["table3"]:
        rows = [r for r in report["table3"] if r["backend"] == "torch"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in rows]
        bottom = np.zeros(len(rows))
        for key, label in (("io_ms", "I/O"), ("mem_ms", "memory mgmt"), ("compute_ms", "compute"),
                           ("predictor_ms", "predictor")):
            vals = np.array([r[key] for r in rows]) / 1e3
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom += vals
        ax.set_ylabel("seconds per token")
        ax.set_title("Table 3 analogue: time per decode token")
        ax.legend()
        p = out_dir / f"{prefix}table3.png"
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    if report["fig7"]:
        rows = report["fig7"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        w = [r["window"] for r in rows]
        ax.plot(w, [r["total_ms"] for r in rows], "o-", label="latency (total)")
        ax.plot(w, [r["io_ms"] for r in rows], "s--", label="I/O")
        ax.set_xlabel("window size (tokens)")
        ax.set_ylabel("ms per token")
        ax2 = ax.twinx()
        ax2.plot(w, [r["dram_gb"] for r in rows], "^-", color="tab:green", label="DRAM in use")
        ax2.set_ylabel("DRAM in use (GB)")
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper center")
        ax.set_title("Figure 7 analogue: window size vs DRAM vs latency")
        fig.tight_layout()
        p = out_dir / f"{prefix}fig7.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    if report["fig8"]:
        rows = report["fig8"]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        t = [r["token"] for r in rows]
        io = np.array([r["io_ms"] for r in rows])
        ax.plot(t, io, lw=0.6, alpha=0.6, label="I/O latency per token")
        k = min(25, len(io))
        if k > 1:
            ax.plot(t[k - 1:], np.convolve(io, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k}")
        ax.set_xlabel("generated token")
        ax.set_ylabel("I/O ms")
        ax.set_yscale("log")
        ax.set_title("Figure 8 analogue: I/O latency per token")
        ax.legend()
        fig.tight_layout()
        p = out_dir / f"{prefix}fig8.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(str(p))
    return paths


# -- description of the setting ----------------------------------------------------------------
def code_version() -> str:
    """The commit measured, and the runtime files that differ from it (the tree is shared while others work)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=BENCH.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "flashllm", "converters"], capture_output=True,
                               text=True, cwd=BENCH.parent, check=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip() and not line[3:].startswith("flashllm/data")]
        return f"commit {head}" + (f", with uncommitted changes in {', '.join(dirty)}" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        mem = float("nan")
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}, load average {load:.1f} at start")


def model_desc(manifest, model_bytes: int) -> str:
    s, src = manifest.spec, manifest.data.get("source", {})
    ffn = manifest.data["files"]["ffn"]["size"]
    weights = "random weights (" + src["path"] + ")" if src.get("random_weights") else f"from {src.get('path')}"
    return (f"{s.family}, {s.n_layers} layers, d_model {s.d_model}, FFN {s.d_ffn} ({s.activation}), vocab "
            f"{s.vocab_size}, {manifest.data['dtype']}, {model_bytes / GB:.2f} GB on flash (resident "
            f"{(model_bytes - ffn) / GB:.2f} GB + FFN {ffn / GB:.2f} GB, bundle {manifest.layout.bundle_bytes} bytes); "
            f"{weights}")


def ensure_unbundled(args, model_dir: Path, manifest, log) -> tuple[Path | None, bool, str]:
    """(unbundled model dir or None, whether we wrote it (delete after), how it was made)."""
    if args.unbundled_dir:
        p = Path(args.unbundled_dir)
        if not p.exists():
            raise SystemExit(f"--unbundled-dir {p}: does not exist")
        return p, False, f"given: {p}"
    src = manifest.data.get("source", {})
    if not src.get("random_weights"):
        return None, False, "no unbundled copy (pass --unbundled-dir; make one with `flashllm convert --no-bundle`)"
    mm = bench_module("make_model")
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
    return out, not args.keep_unbundled, f"written by bench/make_model.py --shape {shape} --seed {src.get('seed')} --no-bundle"


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
    p.add_argument("--trace", default=None, help="activation trace (bench/trace.py record) for the sparse runs")
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
    p.add_argument("--gap-bytes", type=lambda s: None if s == "auto" else int(s), default=None,
                   help="read through gaps up to this many bytes (default auto: the disk profile's cost model)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--backends", type=lambda s: [b for b in s.split(",") if b], default=["torch"])
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
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def _run_one(spec_path: str, result_path: str) -> None:
    run = json.loads(Path(spec_path).read_text())
    result = measure(run)
    Path(result_path).write_text(json.dumps(result))


def main(argv=None) -> dict:
    args = setup_arg_parser().parse_args(argv)
    if args.run_one:
        _run_one(args.run_one, args.result)
        return {}
    if not args.model_dir:
        raise SystemExit("MODEL_DIR is required")
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}",
                                                                   file=sys.stderr, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup (cgroup, unbundled copy)
    machine_desc = machine()
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
                 "machine": f"{machine_desc}, {os.getloadavg()[0]:.1f} at the end", "code": code_version(), "model_dir": str(model_dir), "model_desc": model_desc(manifest, model_bytes),
                 "model_gb": model_bytes / GB, "budget_gb": budget / GB, "budget_arg": args.dram_budget,
                 "compute": f"torch CPU, {cdt} (storage {manifest.data['dtype']}; --dtype {args.dtype}; FFN bundles "
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
