"""Per-token compute against this machine's weight-streaming roofline.

    python -m bench compute roofline MODEL_DIR [--mode sparse --dram-budget 0.5 --trace T.npz]
        [--dtype bfloat16] [--configs default 2t ...] [--rounds 2] [--tokens 8]
        [--roofline-dtypes bfloat16 float16 float32 int8 int4] [--backends torch mlx] [--out FILE.md] [--json]

1. Roofline: for each backend (torch CPU, MLX CPU) and dtype, the best rate at which one token's
   matrix-vector products stream the weights of this model's own matrix shapes (fused q/k/v, o,
   up+gate, down, head), each rotated through copies larger than the last-level cache so that
   weights come from DRAM as in a forward pass. int8/int4: torch's weight-only kernels
   (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu) and MLX's quantized_matmul
   (groups of 64), counting the codes and scales streamed. Torch at 1 and 2 intra-op threads;
   "native": flashllm's own C mat-vec (flashllm/backends/native) at 1 and 2 threads. The roofline
   of a dtype is the best rate any backend reached: the runtime's shares and bound use it.
   The surveys of bench/compute/kernel_survey.py: the down projection over bundle rows (behind
   torch_backend.DOWN_KERNEL), the whole FFN over cached rows (torch's path vs the native one-pass
   kernel) and a decode token's attention over the KV cache.
2. Runtime: the model's own decode tokens, each configuration (--configs, below) in a child
   process, rounds interleaved; per part (backend.parts, a PartTimer) ms per token, bytes it
   touches (resident q/k/v/o, KV read, the FFN rows it multiplies, the head) and GB/s as a share
   of the roofline of its backend and dtype. "python/other" is compute_ms minus the timed parts.
   With --paired (the default), each measured token also gets a roofline of its own minute: one pass of the
   native mat-vec over the model's q/k/v/o weights just before and after it (paired_roofline).

Configurations (--configs, CONFIGS below): named by what they set against the defaults (`default`): compute
threads (`1t`, `2t`), OpenMP waiting (`-spin`), kernels (`plain-`, `mv-down-`, `no-native-`, `-torch-attention`),
read-ahead, page sizes (`-thp`, `-4k-pages`), the I/O engine (`-io-uring`), or the backend (`mlx`).
Each run also records the process's CPU seconds per token ("cpu ms"): on a loaded machine wall time is mostly
waiting for a core, and CPU time shows the work itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.compute import kernel_survey
from bench.harness import GB, ROOT, command_line, module_argv, spread
from bench.models import activation_trace


SPIN = {"GOMP_SPINCOUNT": "300000"}  # libgomp's own default waiting: spin, then sleep
TUNED_2T = dict(kernels="tuned", compute_threads=2)
NO_READ_AHEAD = dict(TUNED_2T, read_ahead=False)
CONFIGS = {  # name -> (load options, extra environment); options starting with "_" set backend attributes
    "default": (dict(kernels="tuned", dtype=None), {}),
    "1t": (dict(kernels="tuned", compute_threads=1), {}),
    "2t": (TUNED_2T, {}),
    "2t-spin": (TUNED_2T, SPIN),
    "plain-2t-spin": (dict(kernels="plain", compute_threads=2), SPIN),
    "mv-down-1t": (dict(kernels="tuned", compute_threads=1, _down_kernel="mv"), {}),
    "mv-down-2t": (dict(TUNED_2T, _down_kernel="mv", _serial_attention=False), {}),
    "no-native-1t": (dict(kernels="tuned", compute_threads=1), {"FLASHLLM_NATIVE": "0"}),
    "no-native-2t": (TUNED_2T, {"FLASHLLM_NATIVE": "0"}),
    "2t-torch-attention": (dict(TUNED_2T, _native_attention=False), {}),
    "2t-no-read-ahead": (NO_READ_AHEAD, {}),
    "2t-thp": (TUNED_2T, {"THP_MEM_ALLOC_ENABLE": "1"}),
    "2t-no-read-ahead-thp": (NO_READ_AHEAD, {"THP_MEM_ALLOC_ENABLE": "1"}),
    "2t-4k-pages": (TUNED_2T, {"FLASHLLM_HUGEPAGES": "0"}),
    "2t-no-read-ahead-4k-pages": (NO_READ_AHEAD, {"FLASHLLM_HUGEPAGES": "0"}),
    "2t-io-uring": (TUNED_2T, {"FLASHLLM_IO_ENGINE": "io_uring"}),
    "mlx": (dict(backend="mlx"), {}),
}
QUANT_GROUP = 64


def llc_bytes() -> int:
    """The last-level cache size (Linux sysfs), 32 MiB if unknown."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
        except (OSError, ValueError, KeyError):
            continue
    return 32 << 20


def matrix_shapes(spec) -> dict[str, tuple[int, int]]:
    """[out, in] of one token's weight products in the tuned forward pass."""
    hd, d, f = spec.head_dim, spec.d_model, spec.d_ffn
    return {"qkv": ((spec.n_heads + 2 * spec.n_kv_heads) * hd, d), "o": (d, spec.n_heads * hd),
            "up+gate" if spec.gated_ffn else "up": ((2 if spec.gated_ffn else 1) * f, d), "down": (d, f),
            "head": (spec.vocab_size, d)}


# -- 1. roofline ----------------------------------------------------------------------------------
def torch_case(dtype: str, shape, copies: int):
    """(bytes per product, [one product per weight copy]) for torch CPU."""
    import torch
    import torch.nn.functional as F

    out, k = shape
    g = torch.Generator().manual_seed(0)
    if dtype in ("int8", "int4"):
        x = torch.randn(1, k, generator=g, dtype=torch.bfloat16)
        fns, nbytes = [], 0
        for _ in range(copies):
            codes = torch.randint(-128, 128, (out, k), generator=g, dtype=torch.int8)
            if dtype == "int8":
                scales = torch.rand(out, generator=g, dtype=torch.bfloat16)
                fns.append(lambda w=codes, s=scales: torch.ops.aten._weight_int8pack_mm(x, w, s))
                nbytes = out * k + out * 2
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    (codes.to(torch.int32) & 15).contiguous(), 1)
                sz = torch.rand(k // QUANT_GROUP, out, 2, generator=g, dtype=torch.bfloat16)
                fns.append(lambda w=packed, s=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, QUANT_GROUP, s))
                nbytes = out * k // 2 + sz.numel() * 2
        return nbytes, fns
    dt = getattr(torch, dtype)
    x = torch.randn(1, k, generator=g).to(dt)
    ws = [torch.randn(out, k, generator=g).to(dt) for _ in range(copies)]
    return out * k * dt.itemsize, [lambda w=w: F.linear(x, w) for w in ws]


def native_case(dtype: str, shape, copies: int, threads) -> dict:
    """flashllm's C mat-vec (TorchBackend.linear's decode path) per thread count, on the same weights:
    {threads: (bytes per product, [one product per weight copy])}; ValueError where it is unavailable."""
    import torch

    from flashllm.backends import native
    from flashllm.backends.torch.native import NATIVE_DTYPES, NativeKernels

    lib, dt = native.library(), getattr(torch, dtype, None)
    if lib is None or dt not in NATIVE_DTYPES:
        raise ValueError(f"no native {dtype} kernel ({native.describe()})")
    out, k = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=g).to(dt)
    ws = [torch.randn(out, k, generator=g).to(dt) for _ in range(copies)]
    return {n: (out * k * dt.itemsize, [lambda w=w, kn=NativeKernels(lib, n): kn.linear(x, w, None) for w in ws])
            for n in threads}


def mlx_case(dtype: str, shape, copies: int):
    import mlx.core as mx

    out, k = shape
    mx.random.seed(0)
    x = mx.random.normal((1, k))
    fns, nbytes = [], 0
    for _ in range(copies):
        w = mx.random.normal((out, k))
        if dtype in ("int8", "int4"):
            bits = 8 if dtype == "int8" else 4
            q = mx.quantize(w, group_size=QUANT_GROUP, bits=bits)
            mx.eval(q)
            nbytes = sum(a.nbytes for a in q)
            fns.append(lambda q=q, b=bits: mx.eval(mx.quantized_matmul(x.astype(mx.bfloat16), *q, transpose=True,
                                                                       group_size=QUANT_GROUP, bits=b)))
        else:
            w = w.astype(getattr(mx, dtype))
            xd = x.astype(w.dtype)
            mx.eval(w, xd)
            nbytes = w.nbytes
            fns.append(lambda w=w, xd=xd: mx.eval(xd @ w.T))
    return nbytes, fns


def set_torch_threads(n: int | None) -> None:
    import torch
    if n:
        torch.set_num_threads(n)


def roofline(spec, backends, dtypes, rounds: int, torch_threads=(1, 2)) -> list[dict]:
    """Best and median GB/s per (backend, dtype, threads, shape); rounds interleave shapes and threads."""
    import torch
    default_threads = torch.get_num_threads()
    rows = []
    for backend in backends:
        for dtype in dtypes:
            if backend == "mlx" and dtype == "float16":
                continue  # MLX's CPU build has no float16 matmul fast path worth listing; bfloat16 covers it
            threads = torch_threads if backend in ("torch", "native") else (None,)
            cases = {}
            for name, shape in matrix_shapes(spec).items():
                probe = (shape[0] * shape[1] * (4 if dtype == "float32" else 1 if dtype == "int8" else 2))
                copies = min(16, max(2, math.ceil(3 * llc_bytes() / probe)))
                try:  # native kernels take their thread count; torch's is set before each product below
                    per = native_case(dtype, shape, copies, threads) if backend == "native" else \
                        dict.fromkeys(threads, (torch_case if backend == "torch" else mlx_case)(dtype, shape, copies))
                    cases.update({(name, n): case for n, case in per.items()})
                except (RuntimeError, ValueError, AttributeError) as e:  # a kernel this build lacks
                    print(f"roofline: {backend} {dtype} {name}: skipped ({str(e).splitlines()[0]})", file=sys.stderr)
            times = {}
            for _ in range(rounds + 1):  # the first round warms up and is dropped
                for (name, n), (nbytes, fns) in cases.items():
                    set_torch_threads(n)
                    t0 = time.perf_counter()
                    for fn in fns:
                        fn()
                    times.setdefault((name, n), []).append((time.perf_counter() - t0) / len(fns))
            for (name, n), ts in times.items():
                nbytes = cases[name, n][0]
                ts = ts[1:]
                rows.append(dict(backend=backend, dtype=dtype, threads=n, shape=name, bytes=nbytes,
                                 best_gbps=nbytes / min(ts) / GB, median_gbps=nbytes / statistics.median(ts) / GB))
            del cases
    torch.set_num_threads(default_threads)
    return rows


def rates(rows) -> dict[tuple[str, str], float]:
    """Best rate per (backend, dtype) over shapes and thread counts."""
    out = {}
    for r in rows:
        key = (r["backend"], r["dtype"])
        out[key] = max(out.get(key, 0.0), r["best_gbps"])
    return out


def roofline_rates(rows) -> dict[str, tuple[float, str]]:
    """The roofline per dtype: the best rate any backend's kernel streamed that dtype at, and which."""
    out = {}
    for (backend, dtype), v in rates(rows).items():
        if v > out.get(dtype, (0.0, ""))[0]:
            out[dtype] = (v, backend)
    return out


# -- 2. the runtime's own tokens --------------------------------------------------------------------
def attention_projections(B) -> list:
    """The resident q/k/v/o weights of every layer (fused or not): the "attn_proj" part's bytes."""
    return [t for name, t in B.w.items() if name.startswith("layers.") and name.split(".")[2] in ("q", "k", "v", "o", "qkv")]


def part_bytes(model, cost, pos: int) -> dict[str, int]:
    """Bytes one decode token at position `pos` touches, per compute part."""
    s, B = model.spec, model.backend
    proj = sum(map(B.nbytes_of, attention_projections(B)))
    kv = 0
    for layer in range(s.n_layers):
        w = s.window(layer)
        kv += 2 * min(pos + 1, w or pos + 1) * s.n_kv_heads * s.head_dim * B.itemsize
    if model.mode == "sparse":
        ffn = sum(cost.neurons_cached) * B.cache_row_bytes(model.layout)  # as the cache holds them (int8/int4 codes too)
    else:
        ffn = model.mode_impl.device_bytes()
    head = B.w["embed.weight"] if s.tied_embeddings else B.w["lm_head.weight"]
    return {"attn_proj": proj, "attention": kv, "ffn": ffn, "logits": B.nbytes_of(head)}


def child(args) -> dict:
    """One configuration: load, warm up, time --tokens decode tokens; per-token averages as a dict."""
    import flashllm
    from flashllm.stats import PartTimer

    options, _ = CONFIGS[args.config]
    predictor = args.predictor
    if args.trace:
        predictor = activation_trace.trace_predictor_factory(args.trace, 0, args.predictor_rank, args.order,
                                                                  args.window)
    switches = {k[1:]: v for k, v in options.items() if k.startswith("_")}  # backend attributes, set after load
    options = {k: v for k, v in options.items() if not k.startswith("_")}
    load = {**dict(mode=args.mode, dtype=args.dtype, dram_budget=args.dram_budget, window=args.window,
                   context=args.context), **options}
    if args.mode == "sparse":
        load["predictor"] = predictor
    t0 = time.perf_counter()
    model = flashllm.load(args.model_dir, **load)
    load_s = time.perf_counter() - t0
    B = model.backend
    for name, value in switches.items():
        setattr(B, name, value)
    timer = PartTimer(B.sync)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.spec.vocab_size, args.warmup + args.tokens + 1).tolist()
    model._costs = []
    model.forward(ids[:1], 0)
    per_token, beside, paired = [], [], []
    for i, t in enumerate(ids[1:]):
        measured = i >= args.warmup
        if i == 0 and args.beside_rounds:  # before the warm-up: the token right after this pass's buffers were
            beside.append(beside_roofline(model, args.beside_rounds))  # freed was 1.3-1.7x slow
        if measured and args.paired:
            paired.append(paired_roofline(model))
        B.parts = timer if measured else None
        timer.reset()
        cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model.forward([t], args.start_pos + i + 1)
        cpu_ms = (time.process_time() - cpu0) * 1e3
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0  # minor page faults: first touches of memory
        if measured:
            cost = model._costs[-1]
            parts = dict(timer.ms)
            parts["python/other"] = cost.compute_ms - sum(timer.ms.values())
            per_token.append(dict(parts=parts, bytes=part_bytes(model, cost, args.start_pos + i + 1), compute_ms=cost.compute_ms,
                                  total_ms=cost.total_ms, io_ms=cost.io_ms, mem_ms=cost.mem_ms, cpu_ms=cpu_ms,
                                  predictor_ms=cost.predictor_ms, reads=cost.reads, read_bytes=cost.bytes_read,
                                  faults=faults))
    B.parts = None
    if args.paired and paired:
        paired.append(paired_roofline(model))
    if paired and min(paired) > 0:
        for k, p in enumerate(per_token):  # each token against the fastest of the passes just before and after it
            own = p["bytes"]["attn_proj"] / GB / p["parts"]["attn_proj"] * 1e3 if p["parts"]["attn_proj"] > 0 else 0.0
            p["paired_gbps"] = max(paired[k], paired[k + 1], own)  # and its own projections (never a slower one)
            p["paired_ratio"] = p["compute_ms"] / (sum(p["bytes"].values()) / GB / p["paired_gbps"] * 1e3)
    if args.beside_rounds:
        time.sleep(0.5)  # the read-ahead's reads in flight finish first
        beside.append(beside_roofline(model, args.beside_rounds))
    mean = lambda key: statistics.fmean(p[key] for p in per_token)  # noqa: E731
    return dict(config=args.config, backend=B.name, dtype=B.dtype_name, kernels=B.kernels(), load_s=load_s,
                load=os.getloadavg()[0], beside_gbps=beside, anon_huge_gb=anon_huge_gb(),
                paired_gbps=[p["paired_gbps"] for p in per_token if "paired_gbps" in p],
                paired_ratio=[p["paired_ratio"] for p in per_token if "paired_ratio" in p],
                per_token=[dict(step=args.warmup + k + 2, compute_ms=p["compute_ms"],  # step: the run's nth forward
                                bytes=sum(p["bytes"].values()), parts=p["parts"], faults=p["faults"])
                           for k, p in enumerate(per_token)],
                autogroup_nice=autogroup_nice(),
                threads=_torch_threads(), omp_wait_policy="spin" if "GOMP_SPINCOUNT" in os.environ else os.environ.get("OMP_WAIT_POLICY"),
                parts={k: statistics.fmean(p["parts"][k] for p in per_token) for k in per_token[0]["parts"]},
                bytes={k: statistics.fmean(p["bytes"][k] for p in per_token) for k in per_token[0]["bytes"]},
                **{k: mean(k) for k in ("compute_ms", "total_ms", "io_ms", "mem_ms", "predictor_ms", "cpu_ms", "reads",
                                        "read_bytes")})


def anon_huge_gb() -> float | None:
    """GB of this process's anonymous memory on transparent huge pages (Linux), else None: whether the weights
    and caches got the 2 MiB pages they asked for decides how fast they stream."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024 / GB
    except (OSError, ValueError, IndexError):
        pass
    return None


def beside_roofline(model, rounds: int) -> float:
    """The roofline in the child itself, before its warm-up tokens and after its measured ones: the best GB/s of the
    native mat-vec on the model's shapes at the run's thread count, so each run's tokens are set against the memory
    bandwidth of the same minute (it swung 24-41 GB/s between runs of one slot on this shared machine)."""
    dtype, threads = model.backend.dtype_name, _torch_threads()
    try:
        rows = roofline(model.spec, ["native"], [dtype], rounds, torch_threads=(threads,))
    except (RuntimeError, ValueError):
        return 0.0
    return max((r["best_gbps"] for r in rows), default=0.0)


def paired_roofline(model, settle_s: float = 0.3) -> float:
    """GB/s of one pass of the native mat-vec over the model's own resident attention projections (every layer's
    q/k/v and o: most of the bytes a sparse token streams, at their real shapes), after `settle_s` for reads in
    flight to land. Measured right before and after each token: this VM's bandwidth swung 27-54 GB/s within one
    run, so a roofline minutes (or a burst) away says more about the minute than the token. A token is set
    against the fastest of the two passes and of its own q/k/v/o parts (a pass after the pause may stream slower
    than the token did). 0.0 where the native kernels do not take these weights."""
    import torch

    B = model.backend
    if B.native is None:
        return 0.0
    time.sleep(settle_s)
    ws = attention_projections(B)
    xs = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype) for w in ws}
    t0 = time.perf_counter()
    for w in ws:
        if B.native.linear(xs[w.shape[1]], w, None) is None:
            return 0.0  # no native kernel for these weights
    return sum(B.nbytes_of(w) for w in ws) / (time.perf_counter() - t0) / GB


def autogroup_nice() -> int | None:
    """This process's scheduler autogroup nice (Linux with sched_autogroup: nice ranks processes only within
    one session, so a timed run raises its own session's weight; recorded beside the figures), else None."""
    try:
        return int(Path("/proc/self/autogroup").read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def _torch_threads() -> int | None:
    import torch
    return torch.get_num_threads()


def run_child(args, config: str) -> dict:
    argv = module_argv("bench.compute.roofline", args.model_dir, "--child", config, *_forward_args(args))
    env = dict(os.environ, **CONFIGS[config][1])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"compute_roofline: config {config} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forward_args(args) -> list[str]:
    out = ["--mode", args.mode, "--beside-rounds", str(args.beside_rounds), "--tokens", str(args.tokens),
           "--paired" if args.paired else "--no-paired",
           "--warmup", str(args.warmup), "--start-pos", str(args.start_pos),
           "--window", str(args.window), "--predictor", args.predictor, "--predictor-rank", str(args.predictor_rank)]
    for key in ("dtype", "dram_budget", "trace", "order", "context"):
        if getattr(args, key) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


# -- report ---------------------------------------------------------------------------------------


def report(meta, roof_rows, survey, runs) -> str:
    roof, best = rates(roof_rows), roofline_rates(roof_rows)
    lines = [f"# Compute vs the weight-streaming roofline: {meta['model']}", "",
             f"- machine: {meta['machine']}; load average at start {meta['load']:.1f}; torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- decode tokens: {meta['tokens']} measured per run after {meta['warmup']} warm-up tokens; "
             f"{meta['rounds']} rounds, configurations interleaved; ranges are min–max over rounds", "",
             "## Roofline: best GB/s of one token's matrix-vector product on this model's shapes", "",
             "| backend | dtype | threads | " + " | ".join(matrix_shapes(meta["spec"])) + " |",
             "|---|---|---|" + "---|" * len(matrix_shapes(meta["spec"]))]
    keys = sorted({(r["backend"], r["dtype"], r["threads"]) for r in roof_rows}, key=str)
    for key in keys:
        cells = {r["shape"]: r for r in roof_rows if (r["backend"], r["dtype"], r["threads"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | {key[2] or '-'} | " + " | ".join(
            f"{cells[s]['best_gbps']:.1f} (med {cells[s]['median_gbps']:.1f})" if s in cells else "-"
            for s in matrix_shapes(meta["spec"])) + " |")
    lines += ["", "Best per backend and dtype (of the above): " +
              ", ".join(f"{b} {d} {v:.1f} GB/s" for (b, d), v in sorted(roof.items())) + ". **Roofline** per dtype "
              "(the best any backend streamed; the runtime's shares and bounds below use it): " +
              ", ".join(f"{d} {v:.1f} GB/s ({b})" for d, (v, b) in sorted(best.items())), ""]
    lines += kernel_survey.tables(*survey)
    if runs:
        parts = list(runs[0]["parts"]) if runs else []
        lines += [f"## The runtime's decode token, per part ({meta['mode_desc']})", "",
                  "| config | backend dtype threads | part | ms/token | GB touched | GB/s | share of roofline |",
                  "|---|---|---|---|---|---|---|"]
        by = {}
        for r in runs:
            by.setdefault(r["config"], []).append(r)
        for config, rs in by.items():
            first = rs[0]
            rate = best.get(first["dtype"], (None,))[0]
            who = f"{first['backend']} {first['dtype']} {first['threads'] or '-'}" + \
                (" native" if first.get("kernels", "").startswith("native") else "") + \
                (f" {first['omp_wait_policy']}" if first["omp_wait_policy"] not in (None, "PASSIVE") else "")
            for part in parts + ["compute (all parts)"]:
                ms = [r["compute_ms"] if part.startswith("compute") else r["parts"][part] for r in rs]
                nb = first["bytes"].get(part) if not part.startswith("compute") else sum(first["bytes"].values())
                gbps = [nb / (m / 1e3) / GB for m in ms if m > 0] if nb else []
                share = spread([g / rate for g in gbps], "{:.0%}") if gbps and rate else "-"
                lines.append(f"| {config} | {who} | {part} | {spread(ms)} | {nb / GB:.3f} | "
                             f"{spread(gbps) if gbps else '-'} | {share} |" if nb else
                             f"| {config} | {who} | {part} | {spread(ms)} | - | - | - |")
            bound = sum(first["bytes"].values()) / GB / rate * 1e3 if rate else None
            if bound:
                lines.append(f"| {config} | | **compute / (bytes / roofline)** | "
                             f"{spread([r['compute_ms'] / bound for r in rs], '{:.2f}x')} (bound {bound:.0f} ms) | | | |")
            beside = [(r["compute_ms"], max(r["beside_gbps"])) for r in rs if max(r.get("beside_gbps") or [0]) > 0]
            if beside:
                nbytes = sum(first["bytes"].values())
                lines.append(f"| {config} | | **compute / (bytes / roofline beside the tokens)** | "
                             f"{spread([ms / (nbytes / GB / g * 1e3) for ms, g in beside], '{:.2f}x')} (roofline "
                             f"{spread([g for _, g in beside])} GB/s) | | | |")
            ratios = [q for r in rs for q in r.get("paired_ratio") or []]
            if ratios:
                lines.append(f"| {config} | | **compute / (bytes / roofline paired with each token)** | "
                             f"{spread(ratios, '{:.2f}x')}, median {statistics.median(ratios):.2f}x, ≤ 1.3x in "
                             f"{sum(q <= 1.3 for q in ratios)} of {len(ratios)} tokens (roofline "
                             f"{spread([g for r in rs for g in r['paired_gbps']])} GB/s) | | | |")
        lines += ["", "Other per-token costs (not compute): " + "; ".join(
            f"{c}: io {spread([r['io_ms'] for r in rs])} ms, mem {spread([r['mem_ms'] for r in rs])} ms, "
            f"process CPU {spread([r['cpu_ms'] for r in rs])} ms, load average {spread([r['load'] for r in rs])}, "
            f"predictor {spread([r['predictor_ms'] for r in rs])} ms, total {spread([r['total_ms'] for r in rs])} ms"
            + (f", on 2 MiB pages {spread([r['anon_huge_gb'] for r in rs], '{:.2f}')} GB"
               if all(r.get("anon_huge_gb") is not None for r in rs) else "")
            for c, rs in by.items()), ""]
    return "\n".join(lines)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a flashllm model directory (e.g. from bench/models/make_model.py)")
    p.add_argument("--mode", default="sparse", choices=["dense", "sparse"], help="(default: %(default)s)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the runtime's choice)")
    p.add_argument("--dram-budget", default=None, help="sparse mode: e.g. 0.5 (default: unlimited)")
    p.add_argument("--window", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--context", type=int, default=None,
                   help="KV cache length (default: the runtime's, min(model, 4096)); the 7B at 50%% needs less")
    p.add_argument("--predictor", default="oracle", help="sparse without --trace (default: %(default)s)")
    p.add_argument("--trace", default=None, help="bench/models/activation_trace.py trace: its active sets (the 'all' token)")
    p.add_argument("--predictor-rank", type=int, default=128, help="trace predictor's cost stand-in rank")
    p.add_argument("--order", default=None, choices=["none", "coactivation"],
                   help="with --trace: replay as if the FFN file were in co-activation order (`flashllm predictors "
                        "order`; fewer, longer reads per token; see bench/models/activation_trace.py) (default: none)")
    p.add_argument("--configs", nargs="+", default=["plain-2t-spin", "default", "1t", "2t"],
                   choices=list(CONFIGS), help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=6, help="measured decode tokens per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4, help="decode tokens before measuring (default: %(default)s)")
    p.add_argument("--start-pos", type=int, default=0,
                   help="decode from this position on (after a 1-token prompt): the attention over a long context "
                        "without prefilling it (the keys between hold zeros; the cost is the same) (default: %(default)s)")
    p.add_argument("--backends", nargs="+", default=["torch", "native", "mlx"],
                   help="roofline backends (default: %(default)s)")
    p.add_argument("--roofline-dtypes", nargs="+", default=["bfloat16", "float16", "float32", "int8", "int4"],
                   help="(default: %(default)s)")
    p.add_argument("--roofline-rounds", type=int, default=3, help="0: no roofline (default: %(default)s)")
    p.add_argument("--beside-rounds", type=int, default=1,
                   help="native roofline rounds inside each run, before its warm-up tokens and after its measured "
                        "tokens; 0: none (default: %(default)s)")
    p.add_argument("--paired", action=argparse.BooleanOptionalAction, default=True,
                   help="time one pass of the native mat-vec over the model's q/k/v/o weights before and after each "
                        "measured token (after 0.3 s for reads in flight): each token's roofline is the fastest of "
                        "the two and of its own q/k/v/o parts (default: on)")
    p.add_argument("--attention-keys", type=int, nargs="+", default=[256, 2048],
                   help="cached keys of the attention survey (default: %(default)s)")
    p.add_argument("--survey-only", action="store_true", help="only the down-projection and attention surveys")
    p.add_argument("--out", default=None, help="write the Markdown report here too")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.child:
        args.config = args.child
        print(json.dumps(child(args)))
        return 0
    import torch
    from flashllm.format import manifest as fmt

    manifest = fmt.read_manifest(args.model_dir, verify=False)
    spec = manifest.spec
    meta = dict(model=f"{Path(args.model_dir).name} ({spec.family}, d_model {spec.d_model}, {spec.n_layers} layers, "
                      f"d_ffn {spec.d_ffn}, {manifest.dtype})",
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                load=os.getloadavg()[0], torch=torch.__version__, tokens=args.tokens, warmup=args.warmup,
                rounds=args.rounds, command=command_line("bench.compute.roofline", argv),
                mode_desc=f"{args.mode}" + (f", budget {args.dram_budget}" if args.dram_budget else "") +
                (f", window {args.window}, active sets from {'the trace' if args.trace else args.predictor}"
                 + (f" in {args.order} order" if args.trace and args.order not in (None, "none") else "")
                 if args.mode == "sparse" else "") + (f", decoding from position {args.start_pos}" if args.start_pos else ""),
                spec=spec)
    print("roofline ...", file=sys.stderr)
    roof = roofline(spec, args.backends, args.roofline_dtypes, args.roofline_rounds) \
        if args.roofline_rounds and not args.survey_only else []
    survey = ([], [], [])
    if args.roofline_rounds or args.survey_only:
        rounds, llc = max(args.roofline_rounds, 1), llc_bytes()
        ks = kernel_survey
        survey = (ks.down_survey(spec, args.roofline_dtypes, rounds, llc),
                  ks.attention_survey(spec, args.roofline_dtypes, rounds, llc, args.attention_keys),
                  ks.ffn_survey(spec, args.roofline_dtypes, rounds, llc))
    runs = []
    for r in range(0 if args.survey_only else args.rounds):
        for config in args.configs:
            print(f"round {r + 1}/{args.rounds}: {config} ...", file=sys.stderr)
            runs.append(run_child(args, config))
            # each run's numbers as soon as it ends: a run killed before its report keeps the finished ones
            print(json.dumps({k: runs[-1].get(k) for k in ("config", "compute_ms", "total_ms", "io_ms", "beside_gbps",
                                                           "paired_gbps", "paired_ratio", "parts", "load")}),
                  file=sys.stderr, flush=True)
    text = report(meta, roof, survey, runs)
    if args.json:
        meta.pop("spec")
        print(json.dumps(dict(meta=meta, roofline=roof, down_survey=survey[0], attention_survey=survey[1],
                              ffn_survey=survey[2], runs=runs)))
    else:
        print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
