"""The `flashllm` command: a thin layer over the Python API (convert, generate, inspect, ...)."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import FlashLLMError


def _budget(text: str):
    """argparse type for budgets: see flashllm.budget for the accepted forms."""
    from .budget import parse_budget

    try:
        return parse_budget(text)
    except FlashLLMError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """Every LoadOptions field as a CLI option, with its default and a line of help (generate, serve, chat)."""
    from .modes import PLANS
    from .options import BACKENDS, DTYPES, ON_OVERFLOW, LoadOptions
    from .predictor import PREDICTORS

    d = LoadOptions()
    g = parser.add_argument_group("loading")
    g.add_argument("--backend", default=d.backend, choices=BACKENDS, help="array library (default: %(default)s)")
    g.add_argument("--device", default=d.device,
                   help="cpu, cuda or gpu (default: torch cpu, mlx Metal where present)")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="compute dtype (default: the storage dtype; float32 for float16 files on a CPU)")
    g.add_argument("--mode", default=d.mode, choices=list(PLANS), help="how layer weights are obtained: " + "; ".join(
        f"{name}: {cls.summary}" for name, cls in PLANS.items())
        + " (default: %(default)s)")
    g.add_argument("--predictor", default=d.predictor, choices=list(PREDICTORS),
                   help="sparse mode: trained low-rank predictors, the true activations (oracle), or a "
                   "ReLU-gated model's own gate projection kept resident (gate) (default: %(default)s)")
    g.add_argument("--dram-budget", type=_budget, default=d.dram_budget, metavar="BUDGET",
                   help="DRAM for weights, caches and KV: a fraction of the model (0.5 or 50%%), a size (6GiB, "
                   "700MiB, 20M) or bytes (default: unlimited, as in the Python API)")
    g.add_argument("--gpu-budget", type=_budget, default=d.gpu_budget, metavar="BUDGET",
                   help="on a GPU: device memory for weights, KV and caches, same forms (default: unlimited)")
    g.add_argument("--window", type=int, default=d.window,
                   help="sparse mode: keep neurons active in the last K tokens (default: %(default)s)")
    g.add_argument("--on-overflow", default=d.on_overflow, choices=ON_OVERFLOW,
                   help="sparse mode, when a token's predicted neurons exceed a layer's cache: drop the "
                   "lowest-scored ones (warned once on stderr) or stop with an error (default: %(default)s)")
    g.add_argument("--hybrid-fraction", type=float, default=d.hybrid_fraction,
                   help="hybrid mode: share of each FFN kept resident (default: sized by the budget)")
    g.add_argument("--threads", type=int, default=d.threads, help="flash reads in flight (default: %(default)s)")
    g.add_argument("--aio-depth", type=int, default=d.aio_depth,
                   help="Linux, direct I/O: serve the reads with native AIO, this many in flight per thread "
                        "(less CPU per read; 0: one blocking read per thread) (default: %(default)s)")
    g.add_argument("--context", type=int, default=d.context,
                   help="KV cache length (default: min(model, 4096))")


def load_options(args: argparse.Namespace):
    """The LoadOptions that `add_load_options` parsed."""
    import dataclasses

    from .options import LoadOptions

    return LoadOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LoadOptions)
                          if hasattr(args, f.name)})


def cmd_convert(args) -> None:
    from .converters import convert

    out = convert(args.src, args.out, dtype=args.dtype, quantize=args.quantize, force=args.force,
                  bundled=not args.no_bundle)
    print(f"wrote {out}")


def cmd_generate(args) -> None:
    from . import load

    model = load(args.model_dir, load_options(args))
    sample = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.json:
        ids = model.tokenizer.encode(args.prompt)
        new = list(model.generate_ids(ids, **sample))
        print(json.dumps({"text": model.tokenizer.decode(new), "token_ids": new, "stats": model.stats}))
        return
    for piece in model.stream(args.prompt, **sample):
        print(piece, end="", flush=True)
    print()
    if args.stats:
        print(format_stats(model.stats), file=sys.stderr)


def format_stats(stats: dict) -> str:
    """A few human-readable lines of the per-token stats."""
    lines = [f"mode {stats['mode']}  backend {stats['backend']}  decode tokens {stats['decode_tokens']}  "
             f"DRAM {stats['dram_bytes'] / 2**20:.1f} MiB"]
    lines.append("per decode token: " + "  ".join(
        f"{k.removesuffix('_ms')} {stats[k]:.2f} ms" for k in ("total_ms", "io_ms", "mem_ms", "compute_ms", "predictor_ms")))
    lines.append(f"flash read per token: {stats['bytes_read'] / 2**20:.3f} MiB in {stats['reads']:.0f} reads")
    return "\n".join(lines)


def cmd_inspect(args) -> None:
    from . import format as fmt

    manifest = fmt.read_manifest(args.model_dir, verify=args.verify)
    data = manifest.data
    sizes = {key: entry["size"] for key, entry in data["files"].items()}
    info = {"model_dir": str(manifest.root), "format_version": data["format_version"], "dtype": data["dtype"],
            "spec": data["spec"], "files": sizes, "bundle_bytes": manifest.layout.bundle_bytes,
            "bundle_stride": manifest.layout.stride, "checksums_verified": "all" if args.verify else "small files"}
    if args.json:
        print(json.dumps(info))
        return
    s = manifest.spec
    print(f"{manifest.root}: {s.family}, {s.n_layers} layers, d_model {s.d_model}, FFN {s.d_ffn} "
          f"({s.activation}{', gated' if s.gated_ffn else ''}), heads {s.n_heads}/{s.n_kv_heads} kv, "
          f"vocab {s.vocab_size}, context {s.max_positions}, {data['dtype']}")
    print(f"bundle: {'+'.join(manifest.layout.parts)} = {manifest.layout.bundle_bytes} bytes, "
          f"stride {manifest.layout.stride}")
    for key, size in sizes.items():
        print(f"  {data['files'][key]['path']:<28} {size / 2**20:10.2f} MiB")
    print("checksums verified: " + info["checksums_verified"])


def cmd_demo(args) -> None:
    from . import demo

    result = demo.run(max_new_tokens=args.max_new_tokens)
    print(json.dumps(result) if args.json else demo.report(result))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashllm", description="Run LLMs larger than memory by streaming FFN "
                                "neurons from flash (LLM in a flash).")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF checkpoint directory into a flashllm model directory",
                       description="Rewrite an HF checkpoint (config.json + safetensors or .bin) into flashllm's "
                       "layout: resident tensors plus FFN row-column bundles. Streams tensor by tensor; "
                       "writes into a temporary directory and renames it at the end.")
    c.add_argument("src", help="HF checkpoint directory")
    c.add_argument("out", help="output model directory (must not exist unless --force)")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="storage dtype (default: the checkpoint's)")
    c.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight quantization (only none is implemented)")
    c.add_argument("--group-size", type=int, default=64, help="quantization group size (reserved)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--no-bundle", action="store_true", help="store up rows and down columns in separate "
                   "regions (the paper's baseline without bundling; for benchmarks)")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text. Modes: dense (all weights resident), naive (every layer read "
                       "from flash per token), hybrid (part of each FFN resident), sparse (predicted neurons "
                       "streamed into a sliding-window cache).")
    g.add_argument("model_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    add_load_options(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stats", action="store_true", help="print per-token stats to stderr")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect", help="describe a model directory", description="Validate a model directory "
                       "(sizes; checksums of small files, or of all with --verify) and describe it.")
    i.add_argument("model_dir")
    i.add_argument("--verify", action="store_true", help="checksum every file (reads the whole model)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("demo", help="convert the embedded small model and run it at half its size",
                       description="Convert the embedded small ReLU model (into $FLASHLLM_CACHE or "
                       "~/.cache/flashllm), generate in sparse mode at a DRAM budget of 50%% of the model, "
                       "and compare bytes read and latency per token with naive mode.")
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--json", action="store_true", help="print one JSON object: model_dir, text, stats")
    d.set_defaults(func=cmd_demo)

    pr = sub.add_parser("predictors", help="train and evaluate the low-rank activation predictors",
                        description="Predictors decide which FFN neurons each token needs (sparse mode).")
    from .predictors.cli import add_parsers as add_predictor_parsers  # train, eval and their handlers

    add_predictor_parsers(pr.add_subparsers(dest="predictors_command", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except FlashLLMError as exc:
        print(f"flashllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flashllm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
