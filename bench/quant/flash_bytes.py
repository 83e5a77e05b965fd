"""Flash bytes per decode token of quantized bundles at a real model width, vs float16, in one run.

    python -m bench quant bytes [--d-model 4096] [--d-ffn 16384] [--tokens 48] [--active 0.05] [--out FILE.md]

A one-layer OPT-shaped HF checkpoint with random weights (HF init, std 0.02) whose FFN biases are
set so that about `--active` of the ReLU neurons fire per token (random weights alone fire about
half), converted to float16, int8 and int4 bundles (group 64) in a temporary directory (removed at
the end), then decoded in sparse mode with the oracle predictor (window 4, unlimited cache) over
the same random token ids. `bytes_read` is what direct I/O transferred (alignment included);
`requested` is the bundles' own bytes.
"""
import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


import flashllm
from flashllm.format import manifest as fmt
from flashllm.converters import convert


def checkpoint(path: Path, d: int, d_ffn: int, active: float) -> Path:
    import transformers

    cfg = transformers.OPTConfig(vocab_size=256, hidden_size=d, ffn_dim=d_ffn, num_hidden_layers=1,
                                 num_attention_heads=max(1, d // 128), max_position_embeddings=128,
                                 word_embed_proj_dim=d, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg).eval()
    fc1 = model.model.decoder.layers[0].fc1
    with torch.no_grad():  # layer-normed inputs have unit entries: pre-activation std = 0.02 * sqrt(d)
        fc1.bias.fill_(-float(torch.distributions.Normal(0, 0.02 * d ** 0.5).icdf(torch.tensor(1 - active))))
    model.save_pretrained(path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=4096, help="(default: %(default)s)")
    ap.add_argument("--d-ffn", type=int, default=16384, help="(default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=48, help="decode tokens (default: %(default)s)")
    ap.add_argument("--active", type=float, default=0.05, help="share of neurons firing (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and JSON beside it)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="quant-bytes-"))
    rows = {}
    try:
        src = checkpoint(work / "hf", args.d_model, args.d_ffn, args.active)
        ids = np.random.default_rng(0).integers(3, 256, size=args.tokens + 4).tolist()
        for q in ("none", "int8", "int4"):
            out = convert(src, work / q, dtype="float16", quantize=q, progress=False)
            lay = fmt.read_manifest(out).layout
            model = flashllm.load(out, mode="sparse", predictor="oracle", window=4)
            model.logits(ids, prefill=4)
            st = model.stats
            loaded = st["neurons_loaded_per_layer"][0]
            rows["float16" if q == "none" else q] = {
                "bundle_bytes": lay.bundle_bytes, "bundle_stride": lay.stride, "bytes_read": st["bytes_read"],
                "bytes_requested": st["bytes_read"] - st["bytes_wasted"], "reads": st["reads"],
                "neurons_loaded": loaded, "decode_tokens": st["decode_tokens"]}
            del model
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows["float16"]
    lines = [f"one OPT-shaped layer, d_model {args.d_model}, d_ffn {args.d_ffn}, ~{args.active:.0%} neurons active, "
             f"sparse oracle window 4, {base['decode_tokens']} decode tokens", "",
             "| FFN bundles | bundle bytes | stride | neurons read/token | flash bytes/token | requested | vs float16 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        r["vs_float16"] = r["bytes_read"] / base["bytes_read"]
        n = f"{r['neurons_loaded']:.1f}"
        lines.append(f"| {name} | {r['bundle_bytes']} | {r['bundle_stride']} | {n} | {r['bytes_read'] / 1024:.1f} KiB | "
                     f"{r['bytes_requested'] / 1024:.1f} KiB | {r['vs_float16']:.3f} |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
