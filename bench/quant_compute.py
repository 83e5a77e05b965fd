"""Quantized cache rows vs dequantized cache rows: FFN compute per token and DRAM per cached neuron.

    python bench/quant_compute.py [--d-model 4096] [--rows 1024 4096] [--repeat 50] [--out FILE.md]

The sparse FFN of one token over n cached neurons (up rows and down columns, groups of 64 along
d_model) computed three ways on the torch CPU:
- dequantized cache (what flashllm does: rows are dequantized on insert): float32 and bfloat16 rows;
- int4 cache, torch's own kernel: up rows through `aten._weight_int4pack_mm_for_cpu` (groups
  along K, as stored), down columns dequantized per token (their groups run along the output);
- int8 cache, dequantized per token: codes * scale + min, then the float32 matmuls.
`mem` columns: the per-token cost of placing new rows (packing / dequantizing 10% of n).
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from flashllm.quant import QuantScheme

G = 64


def timeit(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def case(d: int, n: int, repeat: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(1, d)
    up, down = torch.randn(n, d) * 0.02, torch.randn(n, d) * 0.02
    out = {"d_model": d, "rows": n}

    def dense(u, w):
        return lambda: F.relu(F.linear(x.to(u.dtype), u)) @ w

    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        u, w = up.to(dt), down.to(dt)
        out[f"{name}_ms"] = timeit(dense(u, w), repeat)
        out[f"{name}_bytes_per_row"] = 2 * d * dt.itemsize
    # int4 asymmetric, as stored: codes 0..15, float16 scale and min per group of 64
    q4 = QuantScheme.named("int4", G)
    codes_u, s_u, m_u = q4.unpack(q4.quantize(up.numpy()), d)
    codes_d, s_d, m_d = q4.unpack(q4.quantize(down.numpy()), d)
    s_u, m_u = torch.from_numpy(s_u).float(), torch.from_numpy(m_u).float()
    sz = torch.stack((s_u, m_u + 8 * s_u), dim=2).transpose(0, 1).contiguous()  # [K/G, N, 2]: (q-8)*s + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes_u.astype(np.int32)), 1)
    cd, sd, md = torch.from_numpy(codes_d), torch.from_numpy(s_d).float(), torch.from_numpy(m_d).float()

    def deq(c, s, m):
        return (c.float().view(n, -1, G) * s[..., None] + m[..., None]).view(n, d)

    def int4():
        h = F.relu(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz))
        return h @ deq(cd, sd, md)

    ref = F.relu(F.linear(x, torch.from_numpy(q4.dequantize(q4.quantize(up.numpy()), d)))) @ deq(cd, sd, md)
    out["int4_max_abs_diff_vs_dequantized"] = float((int4() - ref).abs().max())
    out["int4_ms"] = timeit(int4, repeat)
    out["int4_bytes_per_row"] = 2 * q4.part_bytes(d)
    new = max(16, n // 160 * 16)  # the CPU int4 packer takes rows in multiples of 16
    out["int4_place_ms"] = timeit(lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(codes_u[:new].astype(np.int32)), 1), repeat)
    q8 = QuantScheme.named("int8", G)
    c8u, s8u, m8u = (torch.from_numpy(a) for a in q8.unpack(q8.quantize(up.numpy()), d))
    c8d, s8d, m8d = (torch.from_numpy(a) for a in q8.unpack(q8.quantize(down.numpy()), d))
    s8u, m8u, s8d, m8d = s8u.float(), m8u.float(), s8d.float(), m8d.float()
    out["int8_ms"] = timeit(lambda: F.relu(F.linear(x, deq(c8u, s8u, m8u))) @ deq(c8d, s8d, m8d), repeat)
    out["int8_bytes_per_row"] = 2 * q8.part_bytes(d)
    raw = q8.quantize(up[:new].numpy())
    out["dequantize_place_ms"] = timeit(lambda: torch.from_numpy(q8.dequantize(raw, d)), repeat)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, nargs="+", default=[4096, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    rows = [case(d, n, args.repeat) for d in args.d_model for n in args.rows]
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; FFN of one token over n cached neurons "
             "(up + down, ReLU), ms per token; bytes per cached neuron", "",
             "| d_model | n | float32 ms | bfloat16 ms | int4 kernel ms | int8 deq. ms | B/row f32 | B/row bf16 | B/row int4 | B/row int8 | place int4 pack ms | place dequant ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d_model']} | {r['rows']} | {r['float32_ms']:.3f} | {r['bfloat16_ms']:.3f} | {r['int4_ms']:.3f} | "
                     f"{r['int8_ms']:.3f} | {r['float32_bytes_per_row']} | {r['bfloat16_bytes_per_row']} | "
                     f"{r['int4_bytes_per_row']} | {r['int8_bytes_per_row']} | {r['int4_place_ms']:.3f} | "
                     f"{r['dequantize_place_ms']:.3f} |")
    print("\n".join(lines))
    print("int4 kernel vs dequantized reference, max |diff|:", max(r["int4_max_abs_diff_vs_dequantized"] for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
