"""Quantized cache rows vs dequantized cache rows: FFN compute per token and DRAM per cached neuron.

    python -m bench quant compute [--d-model 4096 2048] [--rows 1024 4096] [--threads 1] [--repeat 30] [--out FILE.md]

The sparse FFN of one token over n cached neurons (ReLU; up rows and down columns of int8/int4
bundles, groups of 64 along d_model as stored) on the torch CPU, each way interleaved in rounds:
- dequantized cache (dequantize on insert): rows in float32 / float16 / bfloat16 as the runtime's
  row store holds them (one [capacity, 2 d] matrix; the up and down parts are strided views) and
  computed by the runtime's own `TorchBackend.ffn` (its DOWN_KERNEL per dtype);
- int4 cache: up rows in torch's int4 kernel layout (`aten._weight_int4pack_mm_for_cpu`, groups
  along K as stored, bfloat16 activations and scales); down columns kept as stored codes and
  dequantized per token into bfloat16 (their groups run along the output, which no CPU kernel takes),
  then the runtime's bfloat16 down kernel;
- int8 cache: codes dequantized per token into bfloat16, then the bfloat16 kernels; and
  "int8 kernel": torch's weight-only int8 kernel (`aten._weight_int8pack_mm`) on both parts, which
  needs per-neuron symmetric scales (the bundles' groups would be re-quantized on insert, a further
  quality cost not measured here) and the down columns stored transposed ([d, capacity] codes):
  the fastest a quantized int8 cache could compute on this CPU.
`place` columns: ms to insert n/10 new neurons (dequantize into the rows / repack for the kernel).
The choice it supports is `torch_backend.CACHE_ROWS` (dequantize on insert where it is faster).
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from flashllm.backends.torch.backend import TorchBackend
from flashllm.backends.torch.quant import KERNEL_DTYPE, dequantize_rows, pack_int4
from flashllm.format.quant import QuantScheme
from flashllm.format.spec import ArchSpec

G = 64
WAYS = ("float32", "float16", "bfloat16", "int4 kernel", "int8 deq.", "int8 kernel")


def backend(d: int, dtype: str, threads: int) -> TorchBackend:
    spec = ArchSpec(family="opt", norm="layernorm", norm_eps=1e-5, positional="learned", activation="relu",
                    vocab_size=16, d_model=d, n_layers=1, n_heads=max(1, d // 64), n_kv_heads=max(1, d // 64),
                    head_dim=64, d_ffn=16, max_positions=8, ffn_bias=False, tied_embeddings=True)
    return TorchBackend(spec, "cpu", dtype, "float16", context=8, threads=threads)


def ways(d: int, n: int, threads: int) -> tuple[dict, dict, dict]:
    """way -> (compute one token, bytes per cached neuron, place n/10 new neurons), and max |diff| vs float32."""
    torch.manual_seed(0)
    x = torch.randn(1, d)
    up, down = torch.randn(n, d) * 0.02, torch.randn(n, d) * 0.02
    out, place = {}, {}
    q4, q8 = QuantScheme.named("int4", G), QuantScheme.named("int8", G)
    new = max(16, n // 160 * 16)  # new neurons per token (the int4 layout takes rows in blocks of 16)
    for q, name in ((q8, "int8"), (q4, "int4")):
        raw_u, raw_d = q.quantize(up.numpy()), q.quantize(down.numpy())
        # dequantized caches: what each compute dtype's row store holds and computes with
        for dt in ("float32", "float16", "bfloat16"):
            B = backend(d, dt, threads)
            m = torch.empty(n, 2 * d, dtype=B.dtype)
            m[:, :d], m[:, d:] = dequantize_rows(raw_u, q, d, B.dtype, "cpu"), dequantize_rows(raw_d, q, d, B.dtype, "cpu")
            rows = {"up": m[:, :d], "down": m[:, d:]}
            xb = x.to(B.dtype)
            out[(name, dt)] = (lambda B=B, xb=xb, rows=rows: B.ffn(xb, rows, None, None, None), 2 * d * B.itemsize)
            place[(name, dt)] = lambda B=B, r=raw_u[:new], q=q: dequantize_rows(r, q, d, B.dtype, "cpu")
        bf = backend(d, "bfloat16", threads)
        xb = x.to(KERNEL_DTYPE)
        if name == "int4":
            codes, s, mins = q.unpack(raw_u, d)
            packed = torch.empty(n, d // 2, dtype=torch.uint8)
            nib = raw_u[:, :d // 2]
            pack_int4([nib], packed)
            s, mins = torch.from_numpy(s).float(), torch.from_numpy(mins).float()
            sz = torch.stack((s, mins + 8 * s), 2).transpose(0, 1).contiguous().to(KERNEL_DTYPE)  # [G, n, 2]

            def int4(packed=packed, sz=sz, raw_d=raw_d, bf=bf, xb=xb, q=q):
                h = F.relu(torch._weight_int4pack_mm_for_cpu(xb, packed, G, sz))
                return bf._down(h, dequantize_rows(raw_d, q, d, KERNEL_DTYPE, "cpu"))

            out[(name, "int4 kernel")] = (int4, 2 * q.part_bytes(d))
            dst = torch.empty(new, d // 2, dtype=torch.uint8)
            place[(name, "int4 kernel")] = lambda nib=nib[:new], dst=dst: pack_int4([nib], dst)
        else:
            def int8_deq(raw_u=raw_u, raw_d=raw_d, bf=bf, xb=xb, q=q):
                u = dequantize_rows(raw_u, q, d, KERNEL_DTYPE, "cpu")
                return bf._down(F.relu(F.linear(xb, u)), dequantize_rows(raw_d, q, d, KERNEL_DTYPE, "cpu"))

            out[(name, "int8 deq.")] = (int8_deq, 2 * q.part_bytes(d))
            place[(name, "int8 deq.")] = lambda: None
            # per-neuron symmetric codes: up [n, d], down transposed [d, n]
            su, sd = up.abs().amax(1) / 127, down.abs().amax(1) / 127
            cu = torch.round(up / su[:, None]).to(torch.int8)
            cdt = torch.round(down / sd[:, None]).to(torch.int8).t().contiguous()
            su_b, sd_b, ones = su.to(KERNEL_DTYPE), sd.to(KERNEL_DTYPE), torch.ones(d, dtype=KERNEL_DTYPE)

            def int8_kernel(cu=cu, cdt=cdt, su_b=su_b, sd_b=sd_b, ones=ones, xb=xb):
                h = F.relu(torch._weight_int8pack_mm(xb, cu, su_b))
                return torch._weight_int8pack_mm(h * sd_b, cdt, ones)

            out[(name, "int8 kernel")] = (int8_kernel, 2 * (d + 2))
            place[(name, "int8 kernel")] = lambda w=torch.cat((up[:new], down[:new])): \
                torch.round(w / w.abs().amax(1, keepdim=True) * 127).to(torch.int8)
    ref = {name: out[(name, "float32")][0]().float() for name in ("int8", "int4")}
    diff = {k: float((fn().float() - ref[k[0]]).abs().max()) for k, (fn, _) in out.items()}
    return out, place, diff


def timed(fn, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def case(d: int, n: int, threads: int, repeat: int, rounds: int) -> list[dict]:
    out, place, diff = ways(d, n, threads)
    for fn, _ in out.values():
        fn()  # first use
    ms = {k: [] for k in out}
    for _ in range(rounds):  # interleaved: every way sees the same machine load
        for k, (fn, _) in out.items():
            ms[k].append(timed(fn, repeat))
    rows = []
    for (q, way), (fn, row_bytes) in out.items():
        rows.append({"d_model": d, "rows": n, "bundles": q, "way": way, "ms": statistics.median(ms[(q, way)]),
                     "ms_range": (min(ms[(q, way)]), max(ms[(q, way)])), "bytes_per_row": row_bytes,
                     "place_ms": timed(place[(q, way)], max(1, repeat // 3)), "max_abs_diff": diff[(q, way)]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, nargs="+", default=[4096, 2048])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=20, help="calls per timing (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is shown (default: %(default)s)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = [r for d in args.d_model for n in args.rows for r in case(d, n, args.threads, args.repeat, args.rounds)]
    lines = [f"torch {torch.__version__}, {args.threads} intra-op thread(s), {args.rounds} interleaved rounds x "
             f"{args.repeat} calls (median, [min-max] of the rounds); load average {load0:.1f} at start, "
             f"{os.getloadavg()[0]:.1f} at end. One token's FFN over n cached neurons; bytes per cached neuron; "
             "place: ms to insert n/10 new neurons", "",
             "| d_model | n | bundles | cache rows | ms/token | vs float16 rows | B/neuron | place ms | max abs diff vs float32 rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f16 = next(x for x in rows if (x["d_model"], x["rows"], x["bundles"], x["way"]) ==
                   (r["d_model"], r["rows"], r["bundles"], "float16"))
        lo, hi = r["ms_range"]
        lines.append(f"| {r['d_model']} | {r['rows']} | {r['bundles']} | {r['way']} | {r['ms']:.3f} [{lo:.3f}-{hi:.3f}] | "
                     f"{r['ms'] / f16['ms']:.2f}x | {r['bytes_per_row']} | {r['place_ms']:.3f} | {r['max_abs_diff']:.1e} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
