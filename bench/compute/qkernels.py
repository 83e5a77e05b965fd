"""The quantized kernel table: GB/s of weights each decode kernel streams, at 1 and 2 threads, beside the machine's
streaming-read bandwidth and llama.cpp's Q4_0/Q8_0 mat-vec on the same shapes, all measured in one run.

Rows (Qwen3-30B-A3B shapes unless --shapes says otherwise): flashllm's int8-activation mat-vec (kernels_qdot.c, what
resident int4/int8 matrices use), torch's weight-only int4/int8 kernels (`QuantMatrix`, what they used before),
flashllm's expert FFN (top-k experts of one layer in one call, as a decode token's MoE layer), torch's int4 expert
slots (`Int4ExpertSlots`, per expert through `TorchBackend.moe_experts`), and the sparse FFN over quantized cache
rows (kernels_quant.c's fl_qffn, the dense models' sparse path). Each kernel cycles through distinct copies of its
weights totalling >= --working-set MiB, so the weights come from DRAM, not the caches; the figure is bytes of
weights (codes, scales, mins) per second, median of --reps passes. llama.cpp: bench/peers/ggml_matvec.c compiled
against bench/build_llama_cpp.sh's static ggml, the same shapes and working set, its vector quantized to Q8_0 by
ggml itself (its `--repack 0` kernels); Q4_0 is 4.5 bits per weight, flashllm's int4 rows 4.5 (groups of 64 with a
float16 scale and minimum), so equal GB/s is equal weights per second.

    OMP_WAIT_POLICY=PASSIVE python -m bench compute qkernels [--reps 7] [--working-set 384] [--threads 1,2] [--markdown FILE]

(OMP_WAIT_POLICY=PASSIVE: torch's idle OpenMP threads sleep, as in every run of bench/peers and bench/moe: on a loaded
2-core machine spinning ones cost torch's 2-thread rows more than their second thread gives.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import harness
from flashllm.backends import native
from flashllm.backends.torch.native import NativeKernels
from flashllm.backends.torch.qmatrix import NativeExpertSlots, NativeQuantMatrix
from flashllm.backends.torch.quant import Int4ExpertSlots, QuantMatrix, QuantRows
from flashllm.format.experts import ExpertLayout
from flashllm.format.quant import QuantScheme

# name -> (rows, input values): Qwen3-30B-A3B's attention q and o, head, and an expert's fused gate+up and down
SHAPES = {"attn q": (4096, 2048), "attn o": (2048, 4096), "head": (151936, 2048), "expert gate+up": (1536, 2048),
          "expert down": (2048, 768)}
EXPERT = dict(d_model=2048, d_ffn=768, top_k=8)
GGML_SOURCE = Path(__file__).resolve().parents[1] / "peers" / "ggml_matvec.c"
MiB = 1 << 20


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copies_for(nbytes: int, working_set: int) -> int:
    return max(1, -(-working_set // nbytes))


def stream_gbs(lib, threads: int, reps: int) -> float:
    buf = np.ones(1 << 30, dtype=np.uint8)
    return buf.nbytes / median_time(lambda: lib.stream_read(buf.ctypes.data, buf.nbytes, threads), reps) / 1e9


def matvec_rows(shape, bits: int, threads: list[int], reps: int, working_set: int, kernels) -> dict:
    """flashllm's mat-vec (NativeQuantMatrix) and torch's (QuantMatrix) on `shape` at each thread count: GB/s of
    their own bytes."""
    n, k = shape
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(1, k, dtype=torch.bfloat16)
    out = {t: {} for t in threads}
    for name, make in (("flashllm", lambda: NativeQuantMatrix(w, bits, torch.bfloat16, kernels)),
                       ("torch", lambda: QuantMatrix(w, bits, torch.bfloat16))):
        first = make()
        mats = [first] + [_copy(first) for _ in range(copies_for(first.nbytes, working_set) - 1)]

        def run():
            for m in mats:
                m.linear(x)
        for t in threads:
            torch.set_num_threads(t)
            kernels.threads = t
            out[t][name] = first.nbytes * len(mats) / median_time(run, reps) / 1e9
        del mats, first
    return out


def _copy(m):
    """Another matrix with the same values in its own memory (so passes over copies stream from DRAM)."""
    if isinstance(m, NativeQuantMatrix):
        return NativeQuantMatrix(None, m.bits, m.out_dtype, m.kernels, raw=m.raw.copy())
    c = QuantMatrix.__new__(QuantMatrix)
    c.__dict__.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in m.__dict__.items()})
    return c


def expert_rows(threads: int, reps: int, working_set: int, kernels, torch_backend) -> dict:
    """One MoE layer's top-k experts: flashllm's one call over rows as stored, torch's int4 slots per expert."""
    d, f, top_k = EXPERT["d_model"], EXPERT["d_ffn"], EXPERT["top_k"]
    q = QuantScheme.named("int4", 64)
    probe = ExpertLayout(d, f, 1, 2, 0, (0,), quant=q)
    lay = ExpertLayout(d, f, 1, 2, -(-probe.bundle_bytes // 4096) * 4096, (0,), quant=q)
    rng = np.random.default_rng(0)
    bundle = np.zeros(lay.stride, np.uint8)
    for part in lay.parts:
        bundle[lay.part_range(part)] = q.quantize(rng.normal(0, 0.02, lay.part_shape(part))).reshape(-1)
    capacity = copies_for(top_k * lay.bundle_bytes, working_set) * top_k
    x = torch.randn(1, d, dtype=torch.bfloat16)
    weights = np.full(1, 1.0 / top_k, np.float32)
    tokens = np.zeros(1, np.int64)
    kernels.threads = torch_backend.threads = threads
    torch.set_num_threads(threads)
    out = {}
    rows_slots = NativeExpertSlots(capacity, lay, np.tile(bundle, (capacity, 1)))
    groups = [[(rows_slots.rows(s), tokens, weights) for s in range(c, c + top_k)] for c in range(0, capacity, top_k)]

    def run_native():
        for g in groups:
            torch_backend.moe_experts(x, g)
    out["flashllm"] = capacity * lay.bundle_bytes / median_time(run_native, reps) / 1e9
    if Int4ExpertSlots.fits(lay):
        kslots = Int4ExpertSlots(capacity, lay, torch.bfloat16, np.zeros((capacity, lay.bundle_bytes), np.uint8))
        for s in range(capacity):
            kslots.insert(s, bundle)
        groups = [[(kslots.rows(s), tokens, weights) for s in range(c, c + top_k)] for c in range(0, capacity, top_k)]
        native_kernels, torch_backend.native = torch_backend.native, None  # (torch's path, as before)

        def run_torch():
            for g in groups:
                torch_backend.moe_experts(x, g)
        try:
            out["torch"] = capacity * lay.bundle_bytes / median_time(run_torch, reps) / 1e9
        finally:
            torch_backend.native = native_kernels
    out["per_layer_ms"] = {k: top_k * lay.bundle_bytes / v / 1e6 for k, v in out.items()}
    return out


def sparse_rows(threads: int, reps: int, working_set: int, kernels) -> dict:
    """fl_qffn over int4 cache rows (Llama-7B's d_model 4096, 2,048 rows of a row store, all of them)."""
    d, n = 4096, 2048
    q = QuantScheme.named("int4", 64)
    rng = np.random.default_rng(0)
    part = q.part_bytes(d)
    one = np.concatenate([q.quantize(rng.normal(0, 0.02, (n, d))) for _ in range(3)], axis=1)  # up, gate, down
    stores = [one.copy() for _ in range(copies_for(one.nbytes, working_set))]
    x = torch.randn(1, d, dtype=torch.bfloat16)
    acc = torch.zeros(1, d)
    kernels.threads = threads
    rows = [{p: QuantRows(s, k * part, q, d) for k, p in enumerate(("up", "gate", "down"))} for s in stores]

    def run():
        for r in rows:
            kernels.ffn(x, r, None, None, None, "silu", 0.0, None, None, acc, True, zero=True)
    return {"flashllm": one.nbytes * len(stores) / median_time(run, reps) / 1e9}


def ggml_binary(llama_cpp: Path) -> Path | None:
    """bench/peers/ggml_matvec.c built against llama.cpp's static ggml (None where that build is absent)."""
    src_inc = next(iter(llama_cpp.glob("src/*/ggml/include")), None)
    libs = llama_cpp / "build" / "ggml" / "src"
    if src_inc is None or not (libs / "libggml-cpu.a").is_file():
        return None
    out = Path(tempfile.mkdtemp(prefix="flashllm-ggml-")) / "ggml_matvec"
    subprocess.run(["cc", "-O2", "-o", str(out), str(GGML_SOURCE), f"-I{src_inc}", f"-L{libs}", "-lggml", "-lggml-cpu",
                    "-lggml-base", "-lstdc++", "-fopenmp", "-lm", "-lpthread"], check=True, capture_output=True)
    return out


def ggml_gbs(binary: Path, kind: str, shape, threads: int, reps: int, working_set: int) -> float:
    n, k = shape
    bytes_one = n * k * (18 if kind == "q4_0" else 34) // 32
    run = subprocess.run([str(binary), kind, str(n), str(k), str(threads), str(reps),
                          str(copies_for(bytes_one, working_set))], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    seconds, nbytes = run.stdout.split()
    return int(nbytes) / float(seconds) / 1e9


def measure(args) -> dict:
    lib = native.library()
    if lib is None or lib.stream_read is None:
        raise SystemExit("python -m bench compute qkernels: the native kernels do not build here")
    kernels = NativeKernels(lib, 1)
    backend = _expert_backend(kernels)
    ws = args.working_set * MiB
    binary = ggml_binary(Path(args.llama_cpp))
    rows, stream = [], {t: stream_gbs(lib, t, 3) for t in args.threads}
    for name in args.shapes:
        for bits in (4, 8):
            got = matvec_rows(SHAPES[name], bits, args.threads, args.reps, ws, kernels)
            for t in args.threads:
                if binary is not None:
                    got[t]["llama.cpp"] = ggml_gbs(binary, f"q{bits}_0", SHAPES[name], t, args.reps, ws)
                rows.append({"kernel": "mat-vec", "shape": f"{name} {SHAPES[name][0]} x {SHAPES[name][1]}", "bits": bits,
                             "threads": t, **got[t]})
    for t in args.threads:
        rows.append({"kernel": f"expert FFN (top-{EXPERT['top_k']})", "shape": "2048 x 768 experts", "bits": 4,
                     "threads": t, **expert_rows(t, args.reps, ws, kernels, backend)})
        rows.append({"kernel": "sparse FFN rows", "shape": "2048 rows of 4096", "bits": 4, "threads": t,
                     **sparse_rows(t, args.reps, ws, kernels)})
    return {"stream_gbs": stream, "rows": rows, "simd": native.describe(), "working_set_mib": args.working_set,
            "llama_cpp": str(binary is not None)}


def _expert_backend(kernels):
    """A TorchBackend stand-in with what `moe_experts` uses (its own torch FFN path and the native kernels)."""
    from types import SimpleNamespace

    from flashllm.backends.torch.backend import TorchBackend

    b = TorchBackend.__new__(TorchBackend)
    b.spec = SimpleNamespace(activation="silu", activation_threshold=0.0, gated_ffn=True)
    b.device, b.dtype, b.native, b.threads, b.parts, b.tuned = torch.device("cpu"), torch.bfloat16, kernels, 1, None, True
    b._row_ffn, b.down_kernel, b._matvec, b._down_buf = None, "matmul", None, None
    b.act = torch.nn.functional.silu
    return b


def markdown(result: dict) -> str:
    lines = ["Streaming read (one pass over 1 GiB): " + ", ".join(f"{v:.1f} GB/s at {t} thread{'s' * (int(t) > 1)}"
                                                                  for t, v in result["stream_gbs"].items()),
             f"Kernels: {result['simd']}; weights cycled through >= {result['working_set_mib']} MiB (from DRAM).", "",
             "| kernel | shape | bits | threads | flashllm GB/s | % of stream | torch GB/s | llama.cpp GB/s | flashllm / llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|"]
    stream = {int(t): v for t, v in result["stream_gbs"].items()}  # (JSON keys are strings)
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "—"  # noqa: E731
    for r in result["rows"]:
        ours, ll = r["flashllm"], r.get("llama.cpp")
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['bits']} | {r['threads']} | {ours:.1f} | "
                     f"{100 * ours / stream[int(r['threads'])]:.0f}% | {fmt(r.get('torch'))} | {fmt(ll)} | "
                     + (f"{ours / ll:.2f} |" if ll else "— |"))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--working-set", type=int, default=384, help="MiB of weight copies each kernel cycles through")
    p.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    p.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    p.add_argument("--llama-cpp", default=str(harness.llama_cpp_dir()))
    p.add_argument("--markdown", default=None, help="also write the table here")
    args = p.parse_args(argv)
    result = measure(args)
    text = markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
