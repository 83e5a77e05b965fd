"""Peak RSS of `flashllm convert` on a large HF checkpoint: conversion streams tensor by tensor.

    python -m bench convert --shape opt-1.3b --work convert-work [--keep]

Writes an HF checkpoint of that shape with random weights (bench/models/make_model.py --hf), converts it
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

from bench.harness import ROOT, module_argv


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="opt-1.3b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (needs ~2x the model size)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    made, hf, out = args.work / "made", args.work / "hf", args.work / "converted"
    try:
        subprocess.run(module_argv("bench.models.make_model", "--shape", args.shape, "--dtype", args.dtype, "--out", made,
                                   "--hf", "--hf-out", hf, "--force", "--quiet"), check=True, cwd=ROOT)
        shutil.rmtree(made)  # only the HF checkpoint is needed
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "convert", str(hf), str(out), "--force"])
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
        seconds = time.perf_counter() - t0
        if status != 0:
            sys.exit("convert failed")
        peak = usage.ru_maxrss * 1024
        result = {"shape": args.shape, "dtype": args.dtype, "checkpoint_bytes": dir_bytes(hf),
                  "converted_bytes": dir_bytes(out), "convert_peak_rss_bytes": peak, "convert_seconds": seconds}
        result["peak_rss_over_checkpoint"] = peak / result["checkpoint_bytes"]
        print(json.dumps(result, indent=1))
        return result
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
