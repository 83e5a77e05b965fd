"""Peak RSS of `flashllm convert` on a large HF checkpoint: conversion streams tensor by tensor.

    python -m bench convert --shape opt-1.3b --work convert-work [--keep]
    python -m bench convert --gguf --shape llama-7b --work convert-work [--no-hf] [--keep]

Writes an HF checkpoint of that shape with random weights (bench/models/make_model.py --hf), converts it
in a child process, and prints the child's peak RSS next to the checkpoint size. With --gguf: writes a
Q4_0 GGUF file of the shape (bench/models/make_gguf.py), converts it (its FFN blocks kept as int4 groups of
32: checked bit for bit on a layer's gate and up rows), and converts the HF checkpoint of the same shape
with --quantize int4 beside it (unless --no-hf): sizes, peak RSS and seconds of both, and the FFN bytes a
dense token reads from flash in each. Deletes what it wrote unless --keep.
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

import numpy as np

from bench.harness import ROOT, module_argv


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_hf(shape: str, dtype: str, work: Path) -> Path:
    """An HF checkpoint of `shape` with random weights (bench/models/make_model.py --hf)."""
    made, hf = work / "made", work / "hf"
    subprocess.run(module_argv("bench.models.make_model", "--shape", shape, "--dtype", dtype, "--out", made,
                               "--hf", "--hf-out", hf, "--force", "--quiet"), check=True, cwd=ROOT)
    shutil.rmtree(made)  # only the HF checkpoint is needed
    return hf


def run_convert(src: Path, out: Path, *options: str) -> dict:
    """`flashllm convert` in a child process: its peak RSS, seconds, and what it wrote."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "convert", str(src), str(out), "--force",
                             *options])
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    if status != 0:
        sys.exit("convert failed")
    return {"source_bytes": dir_bytes(src) if src.is_dir() else src.stat().st_size, "converted_bytes": dir_bytes(out),
            "convert_peak_rss_bytes": usage.ru_maxrss * 1024, "convert_seconds": time.perf_counter() - t0}


def flash_bytes(out: Path) -> dict:
    """What a converted model reads from flash: FFN bundle bytes and stride, the FFN bytes of one dense token
    (every neuron of every layer), resident bytes, and the quantization."""
    from flashllm.format import manifest as fmt

    m = fmt.read_manifest(out, verify=False)
    q = m.layout.quant
    return {"quantization": f"{q.name} {q.scheme} groups of {q.group_size}" if q else "none",
            "bundle_bytes": m.layout.bundle_bytes, "bundle_stride": m.layout.stride,
            "ffn_bytes_per_dense_token": m.layout.file_size, "resident_bytes": m.data["files"]["resident"]["size"]}


def gguf_blocks_kept(gguf_path: Path, out: Path) -> bool:
    """Layer 0's gate and up rows as stored equal gguf's own dequantization of the file, bit for bit."""
    import gguf

    from flashllm.format import manifest as fmt

    m = fmt.read_manifest(out, verify=False)
    lay = m.layout
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    rows = np.fromfile(out / fmt.FFN_FILE, dtype=np.uint8, count=lay.d_ffn * lay.stride).reshape(lay.d_ffn, -1)
    for part in ("gate", "up"):
        t = tensors[f"blk.0.ffn_{part}.weight"]
        stored = lay.quant.dequantize(np.ascontiguousarray(rows[:, lay.part_range(part)]), m.spec.d_model)
        if not np.array_equal(stored, gguf.quants.dequantize(t.data, t.tensor_type)):
            return False
    return True


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="opt-1.3b")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--gguf", action="store_true", help="convert a Q4_0 GGUF file of the shape (Llama-style)")
    ap.add_argument("--no-hf", action="store_true", help="with --gguf: skip the HF int4 conversion beside it")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (needs ~2x the model size)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.gguf:
            result = gguf_versus_hf(args)
        else:
            result = {"shape": args.shape, "dtype": args.dtype,
                      **run_convert(make_hf(args.shape, args.dtype, args.work), args.work / "converted")}
            result["checkpoint_bytes"] = result.pop("source_bytes")
            result["peak_rss_over_checkpoint"] = result["convert_peak_rss_bytes"] / result["checkpoint_bytes"]
        print(json.dumps(result, indent=1))
        return result
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


def gguf_versus_hf(args) -> dict:
    from bench.models.make_gguf import write_gguf

    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = write_gguf(args.shape, args.work / f"{args.shape}-Q4_0.gguf")
    result = {"shape": args.shape, "gguf_write_seconds": time.perf_counter() - t0}
    out = args.work / "gguf-int4"
    result["gguf"] = {**run_convert(path, out), **flash_bytes(out), "blocks_kept_bit_for_bit": gguf_blocks_kept(path, out)}
    path.unlink()
    shutil.rmtree(out)
    if not args.no_hf:
        hf, out = make_hf(args.shape, args.dtype, args.work), args.work / "hf-int4"
        result["hf_int4"] = {**run_convert(hf, out, "--quantize", "int4"), **flash_bytes(out)}
    return result


if __name__ == "__main__":
    main()
