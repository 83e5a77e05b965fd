"""Where an int4 expert's time goes on the CPU: per use and per insert, each way the runtime can hold it.

For one expert of a bench/make_model.py MoE shape (gate, up, down; int4 asymmetric, groups of --group),
in one process, interleaved rounds, median ms:
- `dequantize at each use`: the slots hold the stored bundle; each use dequantizes it (numpy, as
  `expert_values`) and computes in the compute dtype (the path for quantized slots without a kernel);
- `int4 kernel, use`: the slot holds torch's int4 kernel layout (the default for int4 on the CPU); a use is two weight-only kernel calls
  with bfloat16 activations (`Int4ExpertSlots`); `int4 kernel, insert`: the repack of a stored bundle;
- `dequantized slot, use` / `insert`: the slot holds the dequantized expert in the compute dtype.
Each at 1 and 2 torch threads (on a loaded 2-core machine the second thread can cost more than it gives).

    python bench/moe_expert_kernels.py --shape qwen3-30b-a3b [--rounds 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from flashllm.backends.torch_backend import TorchBackend  # noqa: E402
from flashllm.backends.torch_quant import Int4ExpertSlots  # noqa: E402
from flashllm.expert_format import ExpertLayout  # noqa: E402
from flashllm.quant import QuantScheme  # noqa: E402


def expert_bundle(layout: ExpertLayout, seed: int) -> np.ndarray:
    """One stored int4 expert bundle of N(0, 0.02²) weights, quantized as the converter does."""
    rng = np.random.default_rng(seed)
    bundle = np.zeros(layout.stride, dtype=np.uint8)
    for part in layout.parts:
        w = rng.normal(0, 0.02, layout.part_shape(part)).astype(np.float32)
        bundle[layout.part_range(part)] = layout.quant.quantize(w).reshape(-1)
    return bundle


def measure(shape: str, rounds: int, threads: tuple[int, ...], dtype: str, group: int = 64) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_model

    spec = make_model.spec_for(shape)
    layout = ExpertLayout.plan(spec, 2, QuantScheme.named("int4", group))
    backend = TorchBackend(spec, "cpu", dtype, "float16", context=4, quantized_ffn=True)
    bundle = expert_bundle(layout, 0)
    kernel = Int4ExpertSlots(1, layout, backend.dtype)
    kernel.insert(0, bundle)
    values = layout.dequantize(bundle).reshape(len(layout.parts), layout.d_ffn, layout.d_model)
    slot = backend.zeros((1, len(layout.parts), layout.d_ffn, layout.d_model))
    slot[0] = backend.tensor(values)
    x = torch.randn(1, spec.d_model).to(backend.dtype)

    def rows(v):
        return {p: v[k] for k, p in enumerate(layout.parts)}

    def dequantize_use():
        backend.ffn(x, rows(backend.tensor(layout.dequantize(bundle).reshape(values.shape))), None, None, None)

    def dequantize_insert():
        slot[0] = backend.tensor(layout.dequantize(bundle).reshape(values.shape))

    cases = {"dequantize at each use": dequantize_use,
             "int4 kernel, use": lambda: backend.ffn(x, kernel.rows(0), None, None, None),
             "int4 kernel, insert": lambda: kernel.insert(0, bundle),
             "dequantized slot, use": lambda: backend.ffn(x, rows(slot[0]), None, None, None),
             "dequantized slot, insert": dequantize_insert}
    wall, cpu = ({(n, k): [] for n in threads for k in cases} for _ in range(2))
    for _ in range(rounds):
        for n in threads:
            torch.set_num_threads(n)
            for k, f in cases.items():
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                wall[n, k].append(1e3 * (time.perf_counter() - t0))
                cpu[n, k].append(1e3 * (time.process_time() - c0))
    return [{"threads": n, "case": k, "median_ms": float(np.median(v)), "min_ms": float(np.min(v)),
             "cpu_ms": float(np.median(cpu[n, k]))} for (n, k), v in wall.items()]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help="bench/make_model.py MoE shape (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (default: %(default)s)")
    p.add_argument("--dtype", default="float16", help="compute dtype (default: %(default)s)")
    p.add_argument("--group", type=int, default=64, help="int4 group size (default: %(default)s)")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    threads = tuple(int(t) for t in args.threads.split(","))
    load = os.getloadavg()[0]
    rows = measure(args.shape, args.rounds, threads, args.dtype, args.group)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    lines = [f"One int4 expert of the `{args.shape}` shape; torch {torch.__version__}, compute {args.dtype}; "
             f"wall ms median (min) / process CPU ms median over {args.rounds} interleaved rounds; load average "
             f"{load:.1f} at start (wall time includes waiting for a core; CPU time is the work).", "",
             "| torch threads | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]
    for n in threads:
        cells = [f"{r['median_ms']:.2f} ({r['min_ms']:.2f}) / {r['cpu_ms']:.2f}" for c in cases for r in rows
                 if r["threads"] == n and r["case"] == c]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
