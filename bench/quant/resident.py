"""Resident matrices and MLX cache rows held quantized: compute per call and bytes, measured ways.

    python -m bench quant resident [--repeat 10] [--out bench/results/quant/resident.md]

torch CPU, one resident [out, in] matrix times T tokens (T=1: a decode step; T=16: a short prefill):
float32 and bfloat16 `F.linear`; torch's weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) fed float32 or bfloat16 activations; and dequantizing the codes
per call before a float32 `F.linear`. This chooses how `--quantize-resident` computes on torch.

MLX (the CPU build here: Metal is not available on Linux), the sparse FFN of one token over n
cached neurons (up rows + down columns, groups of 64): rows kept quantized (`mx.quantized_matmul`)
vs rows dequantized on insert (float32), and the cost of inserting 10% new rows each way.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from flashllm.backends.torch.quant import QuantMatrix
from flashllm.format.quant import QuantScheme


def timeit(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def torch_case(n: int, k: int, T: int, repeat: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=gen) * 0.02, torch.randn(T, k, generator=gen)
    q8, q4 = QuantMatrix(w, 8, torch.float32), QuantMatrix(w, 4, torch.float32)
    wb = w.bfloat16()
    out = {"shape": f"{n}x{k}", "T": T,
           "float32": timeit(lambda: F.linear(x, w), repeat),
           "bfloat16": timeit(lambda: F.linear(x.bfloat16(), wb).float(), repeat),
           "int8 kernel, bf16 x": timeit(lambda: q8.linear(x), repeat),
           "int8 kernel, f32 x": timeit(lambda: torch._weight_int8pack_mm(x, q8.codes, q8.scales.float()), repeat),
           "int8 dequant per call": timeit(lambda: F.linear(x, q8.codes.float() * q8.scales.float()[:, None]), repeat),
           "int4 kernel, bf16 x": timeit(lambda: q4.linear(x), repeat),
           "int4 kernel, f32 x": timeit(lambda: torch._weight_int4pack_mm_for_cpu(x, q4.codes, q4.group,
                                                                                  q4.scales.float()), repeat)}
    qs = QuantScheme.named("int4", 64)
    raw = qs.quantize(w.numpy())
    out["int4 dequant per call"] = timeit(lambda: F.linear(x, torch.from_numpy(qs.dequantize(raw, k))), repeat)
    out["bytes"] = {"float32": w.numel() * 4, "bfloat16": w.numel() * 2, "int8": q8.nbytes, "int4": q4.nbytes}
    return out


def mlx_case(d: int, n: int, repeat: int) -> dict:
    import mlx.core as mx

    from flashllm.backends.mlx.quant import QuantArray

    rng = np.random.default_rng(0)
    up, down = (rng.standard_normal((n, d)).astype(np.float32) * 0.02 for _ in range(2))
    x = mx.array(rng.standard_normal((1, d)).astype(np.float32))
    out = {"d_model": d, "rows": n}
    for bits in (4, 8):
        qs = QuantScheme.named(f"int{bits}", 64)
        parts = []
        for w in (up, down):
            raw = qs.quantize(w)
            lay = qs.part_layout(d)
            piece = {key: raw[:, o:o + size] for key, (o, size) in lay.items()}
            parts.append(QuantArray(mx.array(np.ascontiguousarray(piece["codes"]).view(np.uint32)),
                                    mx.array(np.ascontiguousarray(piece["scales"]).view(np.float16).astype(np.float32)),
                                    mx.array(np.ascontiguousarray(piece["mins"]).view(np.float16).astype(np.float32)),
                                    64, bits))
        qu, qd = parts

        def quantized():
            mx.eval(qd.matmul(mx.maximum(qu.matmul(x, True), 0), False))

        out[f"int{bits} quantized rows ms"] = timeit(quantized, repeat)
        out[f"int{bits} bytes/row"] = 2 * (d * bits // 8 + 2 * (d // 64) * 4)
        new = n // 10
        raw_new = np.concatenate([qs.quantize(up[:new]), qs.quantize(down[:new])], axis=1)
        idx = mx.array(np.arange(new, dtype=np.int32))

        def insert_quantized():
            for w, off in ((qu, 0), (qd, qs.part_bytes(d))):
                lay = qs.part_layout(d)
                piece = {key: raw_new[:, off + o:off + o + size] for key, (o, size) in lay.items()}
                w.packed[idx] = mx.array(np.ascontiguousarray(piece["codes"]).view(np.uint32))
                w.scales[idx] = mx.array(np.ascontiguousarray(piece["scales"]).view(np.float16)).astype(mx.float32)
                w.biases[idx] = mx.array(np.ascontiguousarray(piece["mins"]).view(np.float16)).astype(mx.float32)
            mx.eval(qu[:3], qd[:3])

        out[f"int{bits} insert quantized ms"] = timeit(insert_quantized, repeat)
        fu, fd = mx.array(up), mx.array(down)

        def insert_dequantized():
            vals = mx.array(np.concatenate([qs.dequantize(raw_new[:, :qs.part_bytes(d)], d),
                                            qs.dequantize(raw_new[:, qs.part_bytes(d):], d)], axis=1))
            fu[idx], fd[idx] = vals[:, :d], vals[:, d:]
            mx.eval(fu, fd)

        out[f"int{bits} insert dequantized ms"] = timeit(insert_dequantized, repeat)
    fu, fd = mx.array(up), mx.array(down)
    out["float32 rows ms"] = timeit(lambda: mx.eval(mx.maximum(x @ fu.T, 0) @ fd), repeat)
    out["float32 bytes/row"] = 2 * d * 4
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10, help="(default: %(default)s)")
    ap.add_argument("--out", help="write the markdown here")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    L = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call of one resident matrix "
         "times T tokens (lower is better); bytes held", ""]
    rows = [torch_case(n, k, T, args.repeat) for n, k in ((4096, 4096), (32000, 4096)) for T in (1, 16)]
    keys = [k for k in rows[0] if k not in ("shape", "T", "bytes")]
    L += ["| matrix | T | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    L += [f"| {r['shape']} | {r['T']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |" for r in rows]
    b = rows[0]["bytes"]
    L += ["", "bytes of the 4096x4096 matrix: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in b.items()), ""]
    try:
        import mlx.core as mx

        m = [mlx_case(4096, n, args.repeat) for n in (1024, 4096)]
        keys = [k for k in m[0] if k not in ("d_model", "rows")]
        L += [f"MLX {mx.__version__} ({mx.default_device()}): FFN of one token over n cached neurons, d_model 4096, "
              "groups of 64; insert = 10% of n new rows", "",
              "| rows | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        L += [f"| {r['rows']} | " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys)
              + " |" for r in m]
    except ImportError:
        L.append("MLX: not installed")
    text = "\n".join(L) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
