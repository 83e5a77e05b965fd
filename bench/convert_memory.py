"""Peak RSS of `flashllm convert` on a large HF checkpoint: conversion streams tensor by tensor.

    python bench/convert_memory.py --shape opt-1.3b --work /tmp/convmem [--keep]

Writes an HF checkpoint of that shape with random weights (bench/make_model.py --hf), converts it
in a child process, and prints the child's peak RSS next to the checkpoint size. Deletes what it
wrote unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="opt-1.3b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (needs ~2x the model size)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    here = Path(__file__).parent
    made, hf, out = args.work / "made", args.work / "hf", args.work / "converted"
    try:
        subprocess.run([sys.executable, str(here / "make_model.py"), "--shape", args.shape, "--dtype", args.dtype,
                        "--out", str(made), "--hf", "--hf-out", str(hf), "--force", "--quiet"], check=True)
        shutil.rmtree(made)  # only the HF checkpoint is needed
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli", "convert", str(hf), str(out), "--force"])
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
        seconds = time.perf_counter() - t0
        if status != 0:
            sys.exit("convert failed")
        peak = usage.ru_maxrss * 1024
        result = {"shape": args.shape, "dtype": args.dtype, "checkpoint_bytes": dir_bytes(hf),
                  "converted_bytes": dir_bytes(out), "convert_peak_rss_bytes": peak, "convert_seconds": seconds}
        result["peak_rss_over_checkpoint"] = peak / result["checkpoint_bytes"]
        print(json.dumps(result, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
