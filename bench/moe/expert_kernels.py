"""Where an int4 expert's time goes on the CPU: per use and per insert, each way the runtime can hold it.

For one expert of a bench/models/make_model.py MoE shape (gate, up, down; int4 asymmetric, groups of --group),
in one process, interleaved rounds, median ms:
- `dequantize at each use`: the slots hold the stored bundle; each use dequantizes it (numpy, as
  `expert_values`) and computes in the compute dtype (the path for quantized slots without a kernel);
- `int4 kernel, use`: the slot holds torch's int4 kernel layout (the default for int4 on the CPU); a use is two weight-only kernel calls
  with bfloat16 activations (`Int4ExpertSlots`); `int4 kernel, insert`: the repack of a bundle stored as
  rows (`--expert-layout portable`); `insert, other CPU's packing`: a bundle stored packed for another
  CPU's block (unpacked, packed again); a bundle stored packed for this CPU (`--expert-layout torch-cpu`)
  has no insert at all: the read lands in the slot;
- `dequantized slot, use` / `insert`: the slot holds the dequantized expert in the compute dtype.
Each at 1 and 2 torch threads (on a loaded 2-core machine the second thread can cost more than it gives).
With --backend mlx (MLX's CPU device, compute float32): `MLX affine slot` (the default for int4/int8
experts on MLX: codes, scales and mins copied in, `mx.quantized_matmul` at use; `MLXExpertSlots`)
against a `dequantized slot` (float32, what MLX held before), each per use and per insert, and the
insert of a bundle stored packed for torch (unpacked into MLX's format).

    python -m bench moe kernels --shape qwen3-30b-a3b [--backend mlx] [--rounds 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import torch

from flashllm.backends.torch.backend import TorchBackend
from flashllm.backends.torch.quant import Int4ExpertSlots
from flashllm.format.experts import PACKING_BLOCKS, ExpertLayout, packing_name
from flashllm.format.quant import QuantScheme


def expert_bundle(layout: ExpertLayout, seed: int) -> np.ndarray:
    """One stored int4 expert bundle of N(0, 0.02²) weights, quantized as the converter does."""
    rng = np.random.default_rng(seed)
    bundle = np.zeros(layout.stride, dtype=np.uint8)
    for part in layout.parts:
        w = rng.normal(0, 0.02, layout.part_shape(part)).astype(np.float32)
        bundle[layout.part_range(part)] = layout.quant.quantize(w).reshape(-1)
    return bundle


def packed_for_another_cpu(layout: ExpertLayout, bundle: np.ndarray) -> tuple[ExpertLayout, np.ndarray]:
    """The layout and bytes of `bundle` stored packed for a block other than this CPU's."""
    from flashllm.backends.torch.quant import _pack_block

    block = next(b for b in PACKING_BLOCKS if b != _pack_block())
    out = np.zeros(layout.stride, dtype=np.uint8)
    layout.pack(bundle, out, block)
    return dataclasses.replace(layout, packing=packing_name(block)), out


def measure(shape: str, rounds: int, threads: tuple[int, ...], dtype: str, group: int = 64) -> list[dict]:
    from bench.models import make_model

    spec = make_model.spec_for(shape)
    layout = ExpertLayout.plan(spec, 2, QuantScheme.named("int4", group))
    backend = TorchBackend(spec, "cpu", dtype, "float16", context=4, quantized_ffn=True)
    bundle = expert_bundle(layout, 0)
    kernel = Int4ExpertSlots(1, layout, backend.dtype, backend.host_buffer((1, layout.stride)))
    kernel.insert(0, bundle)
    other_layout, other = packed_for_another_cpu(layout, bundle)
    other_slots = Int4ExpertSlots(1, other_layout, backend.dtype, backend.host_buffer((1, layout.stride)))
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
             "int4 kernel, insert, other CPU's packing": lambda: other_slots.insert(0, other),
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


def measure_mlx(shape: str, rounds: int, bits: int = 4, group: int = 64) -> list[dict]:
    """The MLX cases (CPU device, float32 compute), median wall and CPU ms over interleaved rounds."""
    import mlx.core as mx

    from bench.models import make_model
    from flashllm.backends.mlx.backend import MLXBackend
    from flashllm.backends.mlx.quant import MLXExpertSlots

    spec = make_model.spec_for(shape)
    layout = ExpertLayout.plan(spec, 2, QuantScheme.named(f"int{bits}", group))
    backend = MLXBackend(spec, "cpu", "float32", "float16", context=4, quantized_ffn=True)
    bundle = expert_bundle(layout, 0)
    slots = MLXExpertSlots(1, layout, backend.dtype)
    slots.insert(0, bundle)
    torch_layout, torch_bundle = packed_for_another_cpu(layout, bundle) if bits == 4 else (None, None)
    packed_slots = MLXExpertSlots(1, torch_layout, backend.dtype) if bits == 4 else None
    shape3 = (len(layout.parts), layout.d_ffn, layout.d_model)
    dense = [mx.zeros(shape3, dtype=backend.dtype)]
    x = mx.random.normal((1, spec.d_model)).astype(backend.dtype)

    def use(rows):
        mx.eval(backend.ffn(x, rows, None, None, None))

    def dense_insert():
        dense[0] = backend.tensor(layout.dequantize(bundle).reshape(shape3))

    dense_insert()
    cases = {f"MLX affine slot (int{bits}), use": lambda: use(slots.rows(0)),
             f"MLX affine slot (int{bits}), insert": lambda: slots.insert(0, bundle),
             **({"MLX affine slot, insert of a torch-packed bundle": lambda: packed_slots.insert(0, torch_bundle)}
                if bits == 4 else {}),
             "dequantized slot (float32), use": lambda: use({p: dense[0][k] for k, p in enumerate(layout.parts)}),
             "dequantized slot (float32), insert": dense_insert}
    wall, cpu = ({k: [] for k in cases} for _ in range(2))
    for _ in range(rounds):
        for k, f in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            wall[k].append(1e3 * (time.perf_counter() - t0))
            cpu[k].append(1e3 * (time.process_time() - c0))
    return [{"threads": "MLX CPU", "case": k, "median_ms": float(np.median(v)), "min_ms": float(np.min(v)),
             "cpu_ms": float(np.median(cpu[k]))} for k, v in wall.items()]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help="bench/models/make_model.py MoE shape (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (default: %(default)s; not MLX)")
    p.add_argument("--dtype", default="float16", help="compute dtype (default: %(default)s)")
    p.add_argument("--group", type=int, default=64, help="int4 group size (default: %(default)s)")
    p.add_argument("--backend", default="torch", choices=["torch", "mlx"], help="(default: %(default)s)")
    p.add_argument("--bits", type=int, default=4, choices=[4, 8], help="MLX: expert code bits (default: %(default)s)")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    threads = tuple(int(t) for t in args.threads.split(","))
    load = os.getloadavg()[0]
    if args.backend == "mlx":
        import mlx.core as mx

        rows, threads = measure_mlx(args.shape, args.rounds, args.bits, args.group), ("MLX CPU",)
        what = f"MLX {mx.__version__} (CPU device), compute float32"
    else:
        rows = measure(args.shape, args.rounds, threads, args.dtype, args.group)
        what = f"torch {torch.__version__}, compute {args.dtype}"
    cases = list(dict.fromkeys(r["case"] for r in rows))
    lines = [f"One int{args.bits if args.backend == 'mlx' else 4} expert of the `{args.shape}` shape; {what}; "
             f"wall ms median (min) / process CPU ms median over {args.rounds} interleaved rounds; load average "
             f"{load:.1f} at start (wall time includes waiting for a core; CPU time is the work).", "",
             f"| {'backend' if args.backend == 'mlx' else 'torch threads'} | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]
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
