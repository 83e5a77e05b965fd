"""The native mat-vec of two git revisions side by side: each revision's kernels (flashllm/backends/native) built
into a temporary cache, the same weights on 2 MiB huge pages (as the runtime's fused weights), calls interleaved
per weight copy (copies overflow L3), at 1 and 2 threads. Prints the median GB/s of each and the median per-call
time ratio (base / head: above 1, head is faster). A shared, noisy machine swings the absolute rates between runs;
the interleaved ratio is what one run shows.

    python -m bench compute matvec-ab --base HEAD~1 --head HEAD --shapes 12288x4096 4096x11008
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flashllm import hugepages
from flashllm.backends import native
from flashllm.backends.torch.native import NativeKernels
from bench.harness import ROOT

NATIVE_DIR = "flashllm/backends/native"


def kernels_at(rev: str, src: Path) -> native.Kernels:
    """The native kernels as of git revision `rev` (its C sources and headers), copied into `src` and built."""
    src.mkdir(parents=True)
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{NATIVE_DIR}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{NATIVE_DIR}/{name}"], check=True,
                                  capture_output=True).stdout
            (src / name).write_bytes(blob)
    sources = tuple(src / p.name for p in native.SOURCES if (src / p.name).exists())
    return native.Kernels(ctypes.CDLL(str(native.build(source=sources))))


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A float16 [rows, cols] matrix on huge pages (where the system gives them)."""
    raw = hugepages.empty(rows * cols * 2)
    w = torch.from_numpy(raw.view(np.float16).reshape(rows, cols))
    w.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(torch.float16))
    return w


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD~1", help="git revision whose kernels are the baseline (default: %(default)s)")
    p.add_argument("--head", default="HEAD", help="git revision compared with it (default: %(default)s)")
    p.add_argument("--shapes", nargs="+", default=["12288x4096", "4096x4096", "22016x4096", "4096x11008"],
                   help="[rows]x[cols] of each mat-vec (default: the Llama-7B layer's fused shapes)")
    p.add_argument("--rounds", type=int, default=4, help="passes over the weight copies (default: %(default)s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FLASHLLM_NATIVE_CACHE"] = tmp  # both builds stay out of the user's cache
        libs = {name: kernels_at(rev, Path(tmp) / name) for name, rev in (("base", args.base), ("head", args.head))}
        print(f"base {args.base}, head {args.head}; float16; median GB/s and median base/head time per call")
        for shape in args.shapes:
            rows, cols = map(int, shape.split("x"))
            nbytes = rows * cols * 2
            ws = [weights(rows, cols, k) for k in range(min(32, max(2, math.ceil(96e6 / nbytes))))]
            x = torch.randn(1, cols).to(torch.float16)
            for threads in (1, 2):
                runs = {name: NativeKernels(lib, threads) for name, lib in libs.items()}
                times = {name: [] for name in runs}
                for r in range(args.rounds):
                    for w in ws:  # alternate which goes first
                        for name in (("base", "head") if r % 2 else ("head", "base")):
                            t0 = time.perf_counter()
                            runs[name].linear(x, w, None)
                            times[name].append(time.perf_counter() - t0)
                ratio = statistics.median(b / h for b, h in zip(times["base"], times["head"]))
                rate = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
                print(f"[{rows}, {cols}] {threads} thread{'s' if threads > 1 else ''}: base {rate['base']:.1f} GB/s, "
                      f"head {rate['head']:.1f} GB/s, base/head time {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
