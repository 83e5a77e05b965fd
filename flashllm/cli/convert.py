"""`flashllm convert`: an HF checkpoint directory into a flashllm model directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def add_parser(sub) -> None:
    """The `flashllm convert` subcommand."""
    c = sub.add_parser("convert", help="convert an HF checkpoint directory or a GGUF file into a flashllm model "
                       "directory", description="Rewrite an HF checkpoint (config.json + safetensors or .bin) or a "
                       "GGUF file (llama.cpp's; the first part of a split one) into flashllm's layout: resident "
                       "tensors plus FFN row-column bundles. Streams tensor by tensor into a temporary directory "
                       "(inside OUT when it exists, e.g. an empty mount point, else beside it) and moves the result "
                       "into place at the end. A GGUF file's Q4_0/Q4_1/Q8_0 FFN weights are kept as they are "
                       "(int4/int8 groups of 32); other quantized types are dequantized.")
    c.add_argument("src", help="HF checkpoint directory, GGUF file (MODEL.gguf, MODEL-00001-of-0000N.gguf), or "
                   "Hugging Face Hub repo id ORG/NAME (downloaded into the HF cache; HF_HUB_OFFLINE=1 uses the cache only)")
    c.add_argument("--revision", help="Hub repo id: branch, tag or commit (default: main)")
    c.add_argument("--gguf-file", metavar="NAME", help="Hub repo id: convert this GGUF file of the repository "
                   "(the first part of a split one), not its transformers checkpoint")
    c.add_argument("out", help="output model directory: a new path, or with --force an empty directory (a mount "
                   "point too) or a flashllm model directory")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="storage dtype (default: the "
                   "checkpoint's; float16 for a quantized GGUF file's dequantized tensors)")
    c.add_argument("--quantize", choices=["none", "int8", "int4"],
                   help="store FFN bundles group-wise quantized (asymmetric min/max, float16 scales; "
                   "resident tensors stay in --dtype) (default: none; a GGUF file: its own Q4_0/Q4_1/Q8_0 "
                   "scheme, else none)")
    c.add_argument("--group-size", type=int,
                   help="values per quantization group: groups run along d_model (and, in a mixture-of-experts "
                   "model, along each expert's FFN width too), so the size must divide d_model and the experts' "
                   "d_ffn; even for int4; a GGUF file's Q4_0/Q4_1/Q8_0 blocks keep their 32 unless a size is given "
                   "(default: 64)")
    c.add_argument("--expert-layout", default="portable", choices=["portable", "torch-cpu"],
                   help="MoE int4 experts: `portable` rows (every backend), or `torch-cpu`: torch's CPU int4 kernel "
                   "layout of this machine, read straight into the expert cache with no repack (other backends "
                   "and CPUs unpack it on insert) (default: %(default)s)")
    c.add_argument("--force", action="store_true", help="replace OUT if it is empty or a flashllm model directory "
                   "holding only flashllm's files (its predictors, thresholds and plan go with it); anything else "
                   "is refused (default: off)")
    c.add_argument("--no-bundle", action="store_true", help="store up rows and down columns in separate "
                   "regions (the paper's baseline without bundling; for benchmarks) (default: off)")
    c.set_defaults(func=command)


def command(args) -> None:
    """Convert, then say what the replaced model took with it and whether text prompts will work."""
    from flashllm.converters import convert
    from flashllm.converters.hub import fetch, is_repo_id
    from flashllm.errors import FlashLLMError

    src, origin = args.src, None
    if is_repo_id(args.src):
        src, origin = fetch(args.src, args.revision, args.gguf_file)
    elif args.revision or args.gguf_file:
        raise FlashLLMError(f"{args.src}: --revision and --gguf-file apply to a Hub repo id (ORG/NAME), and this "
                            f"is {'a local path' if Path(args.src).exists() else 'neither a local path nor a repo id'}")
    old = Path(args.out)
    before = set(os.listdir(old)) if args.force and old.is_dir() else set()
    out = convert(src, args.out, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size,
                  force=args.force, bundled=not args.no_bundle, expert_layout=args.expert_layout, origin=origin)
    print(f"wrote {out}")
    describe_source(out)
    # what went with the replaced model, e.g. predictors trained for it
    gone = sorted(n for n in before - set(os.listdir(out)) if not n.startswith(".flashllm-"))
    if gone:
        print(f"flashllm: note: removed with the replaced model: {', '.join(gone)}", file=sys.stderr)
    if not (out / "tokenizer.json").is_file():  # text in and out (generate, chat, serve) goes through it
        what = "no vocabulary (tokenizer.ggml.tokens)" if str(src).endswith(".gguf") else "no tokenizer.json"
        print(f"flashllm: note: {what} in {src}, so none was copied: text prompts (generate, chat, "
              f"serve) will fail until the model's tokenizer.json (and tokenizer_config.json) is copied into {out}; "
              f"without it, give token ids from Python (Model.generate_ids)", file=sys.stderr)


def describe_source(out: Path) -> None:
    """What a GGUF conversion kept exactly and what it rounded (from the manifest), on stderr."""
    import json

    source = json.loads((out / "flashllm.json").read_text()).get("source") or {}
    cost = source.get("conversion")
    if not cost:
        return
    parts = [f"{n:,} FFN values kept exactly ({q} blocks as flashllm groups)" for q, n in sorted(cost["exact"].items())]
    parts += [f"{r['values']:,} {'FFN' if r['tensors'] == 'ffn' else 'resident'} values {r['from']} -> {r['to']} "
              f"(relative RMS error {r['relative_rms_error']:.2e})" for r in cost["rounded"]]
    if parts:
        print(f"flashllm: note: {'; '.join(parts)}", file=sys.stderr)
