"""Reconstruction error of group-wise int8/int4 FFN quantization on real weights: symmetric vs asymmetric.

    python -m bench quant error [--model flashllm/data/tiny-opt] [--groups 32 64 128] [--out FILE.md]

Every FFN part (up/gate rows, down columns: d_model values each) of an HF safetensors checkpoint
is quantized and dequantized with flashllm.format.quant; the table gives the relative RMS error
(||W - Ŵ|| / ||W|| over all FFN weights), the mean |error| and the bits stored per weight.
"""
import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from flashllm.format.quant import BITS, SCHEMES, QuantScheme
from bench.harness import ROOT

FFN_NAMES = ("fc1", "fc2", "up_proj", "gate_proj", "down_proj", "dense_h_to_4h", "dense_4h_to_h")


def ffn_parts(model_dir: Path, d_model: int) -> list[np.ndarray]:
    """Every FFN weight as [n, d_model] rows (down projections transposed, as stored in bundles)."""
    parts = []
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, w in load_file(path).items():
            if w.ndim == 2 and any(f".{k}." in name for k in FFN_NAMES):
                parts.append(w.astype(np.float32) if w.shape[1] == d_model else w.T.astype(np.float32))
    return parts


def measure(parts, q: QuantScheme) -> dict:
    err2 = ref2 = abs_err = count = 0.0
    for w in parts:
        e = q.dequantize(q.quantize(w), w.shape[1]) - w
        err2 += float((e.astype(np.float64) ** 2).sum())
        ref2 += float((w.astype(np.float64) ** 2).sum())
        abs_err += float(np.abs(e).sum())
        count += e.size
    d = parts[0].shape[1]
    return {"quantize": q.name, "scheme": q.scheme, "group_size": q.group_size,
            "rel_rms_error": (err2 / ref2) ** 0.5, "mean_abs_error": abs_err / count,
            "bits_per_weight": 8 * q.part_bytes(d) / d}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "flashllm/data/tiny-opt")
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--out", type=Path, help="also write the table as markdown here")
    args = ap.parse_args(argv)
    d = json.loads((args.model / "config.json").read_text())["hidden_size"]
    parts = ffn_parts(args.model, d)
    rows = [measure(parts, QuantScheme.named(name, g, scheme))
            for name in BITS for g in args.groups if d % g == 0 for scheme in SCHEMES]
    lines = [f"FFN weights of {args.model.name} ({sum(p.size for p in parts)} values, d_model {d})", "",
             "| quantize | scheme | group | bits/weight | rel. RMS error | mean abs error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['quantize']} | {r['scheme']} | {r['group_size']} | {r['bits_per_weight']:.3f} | "
              f"{r['rel_rms_error']:.5f} | {r['mean_abs_error']:.3e} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
