"""The native decode attention of two git revisions side by side (each revision's kernels built into a temporary
cache, as bench/compute/matvec_ab.py does): one token's rotary, KV write and attention per layer over a KV cache of the 7B's
shape, timed "cold" (a q/k/v-sized mat-vec streams its weights before each layer, as in a decode token, so the KV
lines come from DRAM) and "warm" (the same layer again and again). Prints the median microseconds per layer of each
and base/head (above 1, head is faster). Both revisions run on the same cache buffers (random values; each kernel
writes its new key and value in its own layout): where the buffers sit matters as much as the kernel here (with
each revision on its own buffers, the same kernel measured 31 and 82 us per layer warm at 6 keys: heads 128 KiB
apart share cache sets, and which physical pages back them decides how often they evict each other).

    python -m bench compute attention-ab --base HEAD~1 --head HEAD --context 512 --positions 5 64 511
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.compute import matvec_ab



def per_layer_us(lib, caches, flush, x, y, q, k, v, rope, pos: int, ctx: int, cold: bool) -> float:
    """Mean microseconds of one layer's attention call over every layer's caches (cold: after a flush of the
    caches by the mat-vec; warm: layer 0 each time)."""
    n_layers, kvh, hd, heads = caches[0].shape[0], k.shape[1], k.shape[2], q.shape[1]
    out = torch.empty(1, heads * hd, dtype=q.dtype)
    total = 0.0
    for layer in range(n_layers):
        if cold:
            lib.matvec(1, flush.data_ptr(), flush.shape[0], flush.shape[1], flush.stride(0), x.data_ptr(), None,
                       y.data_ptr(), 2)
        at = layer if cold else 0
        t0 = time.perf_counter()
        lib.attend(1, q.data_ptr(), k.data_ptr(), v.data_ptr(), caches[0][at].data_ptr(), caches[1][at].data_ptr(),
                   ctx, pos, 0, heads, kvh, hd, hd, rope[0].data_ptr(), rope[1].data_ptr(), hd ** -0.5,
                   out.data_ptr(), 1)
        total += time.perf_counter() - t0
    return total / n_layers * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision whose kernels are the baseline (default: %(default)s)")
    p.add_argument("--head", default="HEAD", help="git revision compared with it (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="KV cache length (default: %(default)s)")
    p.add_argument("--positions", type=int, nargs="+", default=[5, 64, 511],
                   help="the new token's position: it attends to keys 0..pos (default: %(default)s)")
    p.add_argument("--layers", type=int, default=32, help="(default: %(default)s, the 7B's)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--flush", default="12288x4096", help="[rows]x[cols] of the mat-vec streamed before each cold "
                                                           "layer (default: %(default)s, the 7B's q/k/v)")
    p.add_argument("--rounds", type=int, default=5, help="passes over the layers per case (default: %(default)s)")
    args = p.parse_args(argv)
    if not all(0 <= pos < args.context for pos in args.positions):
        p.error(f"--positions must lie in 0..{args.context - 1} (the context)")
    g, dt = torch.Generator().manual_seed(0), torch.float16
    shape = (args.layers, args.kv_heads, args.context, args.head_dim)
    rows, cols = map(int, args.flush.split("x"))
    flush, x, y = (torch.randn(rows, cols, generator=g).to(dt), torch.randn(1, cols, generator=g).to(dt),
                   torch.empty(1, rows, dtype=dt))
    q = torch.randn(1, args.heads, args.head_dim, generator=g).to(dt)
    k, v = (torch.randn(1, args.kv_heads, args.head_dim, generator=g).to(dt) for _ in range(2))
    rope = (torch.rand(args.head_dim, generator=g), torch.rand(args.head_dim, generator=g))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FLASHLLM_NATIVE_CACHE"] = tmp  # both builds stay out of the user's cache
        build = matvec_ab.kernels_at
        libs = {name: build(rev, Path(tmp) / name) for name, rev in (("base", args.base), ("head", args.head))}
        caches = tuple(torch.randn(shape, generator=g).to(dt) for _ in range(2))
        print(f"base {args.base}, head {args.head}; float16, {args.layers} layers of {args.kv_heads} kv heads x "
              f"{args.head_dim}, context {args.context}; median us per layer, base/head")
        for pos in args.positions:
            for cold in (True, False):
                times = {name: [] for name in libs}
                for r in range(args.rounds):
                    for name in (("base", "head") if r % 2 else ("head", "base")):
                        times[name].append(per_layer_us(libs[name], caches, flush, x, y, q, k, v, rope, pos,
                                                        args.context, cold))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                print(f"{pos + 1} keys, {'cold' if cold else 'warm'}: base {med['base']:.1f} us, head {med['head']:.1f} "
                      f"us, base/head {med['base'] / med['head']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
