"""The `flashllm` command: a thin layer over the Python API (convert, generate, inspect, ...)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import warnings
from pathlib import Path

from flashllm import __version__
from flashllm.errors import FlashLLMError

# what backends.base.default_compute_dtype picks when --dtype is not given
DEFAULT_DTYPE_HELP = ("the storage dtype; bfloat16 on torch CPU for int8/int4 FFN bundles with float16 resident "
                      "tensors; float32 for float16 files on MLX's CPU build")


PROG = "flashllm"


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless its text already states one; a required option
    says so instead."""

    def _format_action(self, action):
        if action.option_strings and action.default is not argparse.SUPPRESS and action.help is not argparse.SUPPRESS \
                and "default" not in (action.help or "") and "required" not in (action.help or ""):
            shown = "off" if action.default is False else "none" if action.default is None else action.default
            action = copy.copy(action)
            action.help = f"{action.help or ''} " + ("(required)" if action.required else
                                                     f"(default: {str(shown).replace('%', '%%')})")
            action.help = action.help.strip()
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    """argparse with defaults in every option's help and a one-line error (the usage is one --help away)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """A subcommand refuses what it does not know itself, so that the error names it (`flashllm generate:
        error: unrecognized arguments: --bogus`) rather than the top-level parser that argparse hands extras to."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self.prog != PROG:
            self.error("unrecognized arguments: " + " ".join(extras))
        return namespace, extras


def _checked(convert, ok, what: str):
    """An argparse type: `convert(text)` that must satisfy `ok`, else the error says `what`."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return value
    parse.__name__ = convert.__name__
    return parse


_count = _checked(int, lambda v: v >= 0, "an integer of 0 or more")
_fraction = _checked(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
_temperature = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number of 0 (greedy) or more")
_top_p = _checked(float, lambda v: 0 < v <= 1, "a probability in (0, 1]")



_row_count = _checked(int, lambda v: v >= 1, "whole numbers of at least 1, one per layer")
_positive = _checked(int, lambda v: v >= 1, "an integer of 1 or more")


def _rows(text: str) -> tuple[int, ...]:
    """argparse type for --cache-rows: comma-separated row counts."""
    return tuple(_row_count(v) for v in text.split(","))


def _budget(text: str):
    """argparse type for budgets: see flashllm.budget for the accepted forms."""
    from flashllm.budget import parse_budget

    try:
        return parse_budget(text)
    except FlashLLMError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_dir(parser: argparse.ArgumentParser) -> None:
    """The MODEL_DIR argument every command on a converted model takes."""
    parser.add_argument("model_dir", help="a model directory written by `flashllm convert`")


def add_load_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Every LoadOptions field (but those named in `skip`) as a CLI option, with its default and a line
    of help (generate, serve, chat, predictors eval)."""
    from flashllm.modes.registry import MODES
    from flashllm.options import (BACKENDS, DTYPES, EXPERT_POLICIES, KERNELS, KV_BITS, ON_OVERFLOW, PREDICTORS,
                                  QUANTIZE_RESIDENT, LoadOptions)

    d = LoadOptions()
    group = parser.add_argument_group("loading")
    g = argparse.Namespace(add_argument=lambda flag, **kw: None if flag[2:].replace("-", "_") in skip
                           else group.add_argument(flag, **kw))
    g.add_argument("--backend", default=d.backend, choices=BACKENDS, help="array library (default: %(default)s)")
    g.add_argument("--device", default=d.device,
                   help="cpu, cuda or gpu (default: torch cpu, mlx Metal where present)")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help=f"compute dtype (default: {DEFAULT_DTYPE_HELP})")
    g.add_argument("--mode", default=d.mode, choices=list(MODES), help="how layer weights are obtained: " + "; ".join(
        f"{name}: {cls.summary}" for name, cls in MODES.items())
        + " (default: %(default)s)")
    g.add_argument("--predictor", default=d.predictor, choices=list(PREDICTORS),
                   help="sparse mode: trained low-rank predictors, the true activations (oracle), or a gated "
                   "model's own gate rows kept resident (gate: exact; neurons are read without their gate row); "
                   "auto: gate for a gated FFN made sparse by calibrated thresholds when the budget holds its "
                   "rows, else lowrank (default: %(default)s)")
    g.add_argument("--dram-budget", type=_budget, default=d.dram_budget, metavar="BUDGET",
                   help="DRAM for weights, caches and KV: a fraction of the model (0.5 or 50%%), a size (6GiB, "
                   "700MiB, 20M) or bytes (default: unlimited, as in the Python API)")
    g.add_argument("--gpu-budget", type=_budget, default=d.gpu_budget, metavar="BUDGET",
                   help="with --device cuda: device memory for weights, KV and caches, same forms; refused off a GPU "
                   "(default: unlimited)")
    g.add_argument("--window", type=_positive, default=d.window,
                   help="sparse mode: keep neurons active in the last K tokens (default: %(default)s)")
    g.add_argument("--pin-hot", action=argparse.BooleanOptionalAction, default=d.pin_hot,
                   help="sparse mode: keep each layer's most frequently active neurons cached for good, as many as "
                   "its cache holds beside the window's expected need (needs the activation frequencies "
                   "`predictors train` saves) (default: %(default)s)")
    g.add_argument("--on-overflow", default=d.on_overflow, choices=ON_OVERFLOW,
                   help="sparse mode, when a token's predicted neurons exceed a layer's cache: drop the "
                   "lowest-scored ones (warned once on stderr) or stop with an error (default: %(default)s)")
    g.add_argument("--expert-policy", default=d.expert_policy, choices=EXPERT_POLICIES,
                   help="mixture-of-experts sparse mode: which cached expert a newly read one replaces when a "
                   "layer's slots are full: least recently used, least frequently used, or the paper's window "
                   "(experts unused for --window tokens are dropped first) (default: %(default)s)")
    g.add_argument("--expert-prefetch", action="store_true", dest="expert_read_ahead", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the former spelling of --expert-read-ahead
    g.add_argument("--expert-read-ahead", action="store_true", default=d.expert_read_ahead,
                   help="mixture-of-experts sparse mode: while layer l computes, read the experts layer l+1's "
                   "router picks for layer l's input (exact either way; costs reads when wrong) (default: off)")
    g.add_argument("--hybrid-fraction", type=_fraction, default=d.hybrid_fraction,
                   help="hybrid mode: share of each FFN kept resident (default: sized by the budget)")
    g.add_argument("--threads", type=_positive, default=d.threads, help="flash reads in flight (default: %(default)s)")
    g.add_argument("--aio-depth", type=_count, default=d.aio_depth,
                   help="Linux, direct I/O: serve the reads with native AIO, this many in flight "
                        "(less CPU per read; 0: one blocking read per thread) (default: native AIO for sparse "
                        "mode's FFN reads, else 0)")
    g.add_argument("--gap-bytes", type=_gap_bytes, default=d.gap_bytes,
                   help="sparse mode: read through gaps of up to this many bytes between needed bundles instead "
                        "of issuing another read; 'auto': from the disk's measured per-read cost and bandwidth "
                        "(flashllm.io.disk_profile) (default: %(default)s, off: measured slower here, see "
                        "bench/results/io_pipeline.md)")
    g.add_argument("--prefetch", action=argparse.BooleanOptionalAction, dest="read_ahead", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the former spelling of --read-ahead
    g.add_argument("--read-ahead", action=argparse.BooleanOptionalAction, default=d.read_ahead,
                   help="read layer l+1's weights while layer l computes (sparse: the neurons layer l+1's "
                        "predictor picks from layer l's residual stream; misses are read when l+1 runs) "
                        "(default: naive and hybrid; sparse where the reads land in cache rows through native AIO, "
                        "where it measured faster)")
    g.add_argument("--context", type=_positive, default=d.context,
                   help="KV cache length (default: min(model, 4096))")
    g.add_argument("--quantize-resident", default=d.quantize_resident, choices=QUANTIZE_RESIDENT,
                   help="hold the attention, embedding and lm_head matrices quantized in DRAM (at load; torch CPU "
                   "and MLX; quality cost measured in the README) (default: %(default)s)")
    g.add_argument("--kv-bits", type=int, default=d.kv_bits, choices=KV_BITS,
                   help="8: KV cache in int8 groups along the head dim (quality cost in the README); 16: in the "
                   "compute dtype, unquantized (default: %(default)s)")
    g.add_argument("--cache-rows", type=_rows, default=d.cache_rows, metavar="N1,N2,...",
                   help="sparse mode: neuron cache rows per layer, one number per layer (what `flashllm plan` "
                   "chooses) (default: sized by the budget)")
    g.add_argument("--kernels", default=d.kernels, choices=KERNELS,
                   help="tuned: q/k/v and gate/up fused at load, the fastest measured kernel per dtype (same math); "
                   "plain: the file's tensors with torch's default kernels, for comparison (default: %(default)s)")
    g.add_argument("--batch-size", type=_positive, default=None,
                   help="sequences decoded together, each with its own KV cache (--batch-file) (default: every "
                   "prompt of --batch-file at once, else 1)")
    g.add_argument("--compute-threads", type=_positive, default=d.compute_threads, metavar="N",
                   help="intra-op threads of the math (torch CPU) (default: every core the process may run on; OpenMP "
                   "workers sleep at barriers and decode attention runs in one thread; the result is the same bits at "
                   "any count)")
    g.add_argument("--plan", default="none", choices=["none", "auto"],
                   help="auto: mode, dtype, window and per-layer caches from `flashllm plan` for this --dram-budget "
                   "(the saved plan.json when it matches, else planned now and saved) (default: %(default)s)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """How tokens are picked and when generation stops (generate, serve, chat); see Model.stream."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=_count, default=32, help="stop after this many new tokens "
                   "(default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop before this text appears, taken literally (a newline in bash: $'\\n'; "
                   "repeatable; default: only the end-of-sequence tokens)")
    g.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature; 0 picks the most likely token (default: %(default)s)")
    g.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling: sample from the smallest set "
                   "of tokens whose probability reaches P; 1 keeps all (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")


def _gap_bytes(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a byte count >= 0 or auto")
    return value


def load_options(args: argparse.Namespace):
    """The LoadOptions that `add_load_options` parsed."""
    import dataclasses

    from flashllm.options import LoadOptions

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LoadOptions) if hasattr(args, f.name)}
    if values.get("batch_size", 1) is None:  # not given: one sequence (--batch-file sets it to its prompts)
        del values["batch_size"]
    options = LoadOptions(**values)
    if getattr(args, "plan", "none") == "auto":
        from flashllm.cli.plan import auto_options

        options = auto_options(args.model_dir, options)
    return options


def warn_if_context_cut(args, model) -> None:
    """A --context beyond the model's positions runs at the model's: said on stderr, not silently."""
    if getattr(args, "context", None) and args.context > model.context:
        print(f"flashllm: warning: --context {args.context}: the model has {model.context} positions; the KV cache "
              f"holds {model.context}", file=sys.stderr)


def cmd_convert(args) -> None:
    from flashllm.converters import convert

    old = Path(args.out)
    before = set(os.listdir(old)) if args.force and old.is_dir() else set()
    out = convert(args.src, args.out, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size, force=args.force,
                  bundled=not args.no_bundle, expert_layout=args.expert_layout)
    print(f"wrote {out}")
    gone = sorted(before - set(os.listdir(out)))  # e.g. predictors trained for the replaced model
    if gone:
        print(f"flashllm: note: removed with the replaced model: {', '.join(gone)}", file=sys.stderr)
    if not (out / "tokenizer.json").is_file():  # text in and out (generate, chat, serve) goes through it
        print(f"flashllm: note: no tokenizer.json in {args.src}, so none was copied: text prompts (generate, chat, "
              f"serve) will fail until the model's tokenizer.json (and tokenizer_config.json) is copied into {out}; "
              f"without it, give token ids from Python (Model.generate_ids)", file=sys.stderr)


def read_prompt(args) -> str:
    """The prompt text: --prompt, --prompt-file PATH, or stdin for `-` in either (read verbatim). An empty one
    is refused: generating from nothing (e.g. `git diff | ...` with no diff) is rarely what was meant."""
    option = "--prompt-file" if args.prompt_file is not None else "--prompt"
    source = args.prompt_file if args.prompt_file is not None else args.prompt
    if source == "-":
        text, where = sys.stdin.read(), "stdin"
    elif args.prompt_file is None:
        text, where = args.prompt, "the text given"
    else:
        try:
            text, where = Path(source).read_text(), source
        except (OSError, UnicodeDecodeError) as exc:
            raise FlashLLMError(f"--prompt-file {source}: cannot read ({getattr(exc, 'strerror', None) or exc})") \
                from None
    if not text:
        raise FlashLLMError(f"{option}: the prompt is empty ({where} held no text)")
    return text


def cmd_generate(args) -> None:
    from flashllm import load

    if args.batch_file is not None:
        from flashllm.cli.batch import cmd_generate_batch

        return cmd_generate_batch(args)

    prompt = read_prompt(args)
    model = load(args.model_dir, load_options(args))
    warn_if_context_cut(args, model)
    pieces = model.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.json:
        text, run = "".join(pieces), model.last_generation
        print(json.dumps({"text": text, "token_ids": run.token_ids, "stop_reason": run.stop_reason,
                          "stats": model.stats}))
        return
    global _text_line_open
    wrote = False  # text, or a finished generation (an empty text's line too); not an error before any text
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
            wrote = True
            if piece:
                _text_line_open = not piece.endswith("\n")
        wrote = True
    finally:
        _text_line_open = False
        if wrote:
            print()  # the text's line ends before anything else is written, an error included
    if model.last_stop_reason == "context":
        further = "the model has no more positions" if model.context >= model.spec.context_limit else \
            "load with a larger --context to continue further"
        print(f"flashllm: note: generation stopped at the end of the context ({model.context} tokens); {further}",
              file=sys.stderr)
    if args.stats:
        print(format_stats(model.stats), file=sys.stderr)


def format_stats(stats: dict) -> str:
    """A few human-readable lines of the per-token stats."""
    predictor = f"  predictor {stats['predictor']}" if stats.get("predictor") else ""
    lines = [f"mode {stats['mode']}{predictor}  backend {stats['backend']}  decode tokens {stats['decode_tokens']}  "
             f"DRAM {stats['dram_bytes'] / 2**20:.1f} MiB"]
    if stats.get("kernels"):
        lines.append(f"kernels: {stats['kernels']}")
    lines.append("per decode token: " + "  ".join(
        f"{k.removesuffix('_ms')} {stats[k]:.2f} ms" for k in ("total_ms", "io_ms", "mem_ms", "compute_ms", "predictor_ms")))
    lines.append(f"flash read per token: {stats['bytes_read'] / 2**20:.3f} MiB in {stats['reads']:.0f} reads")
    q = stats.get("quantization") or {}
    if any(q.get(k) not in (None, "none", 16) for k in ("ffn", "resident", "kv_bits")):
        lines.append(f"quantized: FFN bundles {q['ffn']}, resident matrices {q['resident']}, KV cache "
                     f"{'int8' if q['kv_bits'] == 8 else 'unquantized'} (lossy; measured cost: README, Quantization)")
    if stats.get("expert_hit_rate") is not None:
        lines.append(f"experts per token: {stats['expert_hits']:.2f} cached, {stats['expert_misses']:.2f} read "
                     f"(hit rate {stats['expert_hit_rate']:.3f})")
    if stats.get("activation_sparsity"):
        sp = stats["activation_sparsity"]
        lines.append(f"calibrated activation sparsity: {sp['sparsity']:.0%} of FFN neurons skipped per token on "
                     f"calibration text, FFN output error {sp['ffn_error']:.1%} ({sp['method']} {sp['target']:g}; "
                     f"sparsity.json)")
    if stats.get("neurons_dropped"):
        n, share = stats["neurons_dropped"], stats.get("dropped_mass_share")
        count = f"{n:.0f}" if n >= 10 else f"{n:.2g}"  # a few drops over many tokens: 0.13, not 0
        mass = "unknown share" if share is None else "<0.1%" if 0 < share < 0.0005 else f"{share:.1%}"
        lines.append(f"neurons dropped per token: {count} (caches too small for the predicted set; {mass} of the "
                     f"predicted score mass)")
    return "\n".join(lines)


def cmd_demo(args) -> None:
    from flashllm.cli import demo

    if args.max_new_tokens < 2:  # the first new token comes from the prompt's forward: no decode token to compare
        raise FlashLLMError(f"--max-new-tokens {args.max_new_tokens}: the demo compares decode tokens, so it needs at "
                            "least 2 (the first new token comes from the prompt)")
    if args.moe:
        result = demo.run_moe(max_new_tokens=args.max_new_tokens, backend=args.backend)
        print(json.dumps(result) if args.json else demo.report_moe(result))
        return
    result = demo.run(max_new_tokens=args.max_new_tokens, swiglu=args.swiglu, backend=args.backend)
    print(json.dumps(result) if args.json else demo.report(result))
    note = demo.dropped_note(result)
    if args.json and note:  # the report ends with it; with --json it goes to stderr
        print(f"flashllm: warning: {note}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run LLMs larger than memory by streaming FFN "
                "neurons from flash (LLM in a flash).")
    p.add_argument("--version", action="version", version=f"flashllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert an HF checkpoint directory into a flashllm model directory",
                       description="Rewrite an HF checkpoint (config.json + safetensors or .bin) into flashllm's "
                       "layout: resident tensors plus FFN row-column bundles. Streams tensor by tensor; "
                       "writes into a temporary directory and renames it at the end.")
    c.add_argument("src", help="HF checkpoint directory")
    c.add_argument("out", help="output model directory (must not exist unless --force)")
    c.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="storage dtype (default: the checkpoint's)")
    c.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="store FFN bundles group-wise quantized (asymmetric min/max, float16 scales; "
                   "resident tensors stay in --dtype) (default: %(default)s)")
    c.add_argument("--group-size", type=int, default=64,
                   help="values per quantization group along d_model; must divide d_model, even for int4 "
                   "(default: %(default)s)")
    c.add_argument("--expert-layout", default="portable", choices=["portable", "torch-cpu"],
                   help="MoE int4 experts: `portable` rows (every backend), or `torch-cpu`: torch's CPU int4 kernel "
                   "layout of this machine, read straight into the expert cache with no repack (other backends "
                   "and CPUs unpack it on insert) (default: %(default)s)")
    c.add_argument("--force", action="store_true", help="replace OUT if it is empty or a flashllm model directory "
                   "holding only flashllm's files (its predictors, thresholds and plan go with it); anything else "
                   "is refused (default: off)")
    c.add_argument("--no-bundle", action="store_true", help="store up rows and down columns in separate "
                   "regions (the paper's baseline without bundling; for benchmarks) (default: off)")
    c.set_defaults(func=cmd_convert)

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text. Modes: dense (all weights resident), naive (every layer read "
                       "from flash per token), hybrid (part of each FFN resident), sparse (predicted neurons "
                       "streamed into a sliding-window cache).")
    add_model_dir(g)
    src = g.add_mutually_exclusive_group(required=True)
    one_of = " (one of --prompt, --prompt-file, --batch-file is required)"
    src.add_argument("--prompt", help="the prompt text; - reads it from stdin" + one_of)
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file (verbatim, trailing "
                     "newline included); - reads stdin" + one_of)
    src.add_argument("--batch-file", metavar="PATH", help="one prompt per line (blank lines skipped; - reads stdin): "
                     "decode them together, --batch-size at a time, each layer's weights read once per step for "
                     "the whole batch (sparse: the union of their predicted neurons); --json prints `results`" + one_of)
    add_sampling_options(g)
    add_load_options(g)
    g.add_argument("--stats", action="store_true", help="print per-token stats to stderr (default: off)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids (every new token, "
                   "those of a --stop string included: text ends before it), stop_reason (eos, stop, length or "
                   "context), stats (default: off)")
    g.set_defaults(func=cmd_generate)

    from flashllm.cli import inspect as inspect_cli  # inspect

    inspect_cli.add_parser(sub)

    d = sub.add_parser("demo", help="convert the embedded small model and run it at half its size",
                       description="Convert the embedded small ReLU model (into $FLASHLLM_CACHE, else "
                       "$XDG_CACHE_HOME/flashllm or ~/.cache/flashllm), generate in sparse mode at a DRAM budget of "
                       "50% of the model, and compare bytes read and latency per token with naive mode (--moe, "
                       "--swiglu: the other embedded models).")
    d.add_argument("--max-new-tokens", type=_count, default=48, help="tokens to generate in sparse mode, at "
                   "least 2 (default: %(default)s)")
    d.add_argument("--json", action="store_true", help="print one JSON object: model_dir, text, stats "
                   "(default: off)")
    from flashllm.options import BACKENDS, LoadOptions

    d.add_argument("--backend", default=LoadOptions.backend, choices=BACKENDS, help="array library: torch (CPU), "
                   "or mlx (Metal on Apple silicon; on Linux its CPU build, 10-30x slower than torch) "
                   "(default: %(default)s)")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--moe", action="store_true", help="the embedded mixture-of-experts model instead (4 layers, "
                   "16 experts, top-2): experts streamed at 50%% of its size, compared with dense (default: off)")
    which.add_argument("--swiglu", action="store_true", help="the embedded SwiGLU (Llama-style) model instead, "
                   "sparse through its shipped thresholds (--sparsity 0.4), at 50%% of its size (default: off)")
    d.set_defaults(func=cmd_demo)

    pr = sub.add_parser("predictors", help="train and evaluate the low-rank activation predictors",
                        description="Predictors decide which FFN neurons each token needs (sparse mode).")
    from flashllm.predictors.cli import add_parsers as add_predictor_parsers  # train, eval and their handlers

    commands = pr.add_subparsers(dest="predictors_command", required=True)
    add_predictor_parsers(commands)
    commands.metavar = "{" + ",".join(commands.choices) + "}"  # named so in "required" errors, not by its dest
    from flashllm.cli import chat  # each adds its subcommand
    from flashllm.serve import app as serve
    from flashllm.cli import plan as plan_cli  # profile and plan

    plan_cli.add_parsers(sub)

    chat.add_parser(sub)
    serve.add_parser(sub)
    return p


_text_line_open = False  # generate has streamed text whose line is not ended yet


def _same_terminal() -> bool:
    """stdout and stderr are the one terminal (where a warning would be glued to the streamed text)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty() and os.path.samestat(os.fstat(1), os.fstat(2))
    except (OSError, ValueError):
        return False


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    """Runtime warnings (dropped neurons, buffered I/O) as one `flashllm: warning:` line, no source line, on a
    line of its own in a terminal that shows streamed text too; the options a warning names are spelled as flags."""
    lead = "\n" if _text_line_open and _same_terminal() else ""
    return f"{lead}flashllm: warning: {message.cli_message() if hasattr(message, 'cli_message') else message}\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except FlashLLMError as exc:
        print(f"flashllm: error: {exc.cli_message()}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `flashllm ... | head`: the reader left; stop quietly like other tools
        _discard_stdout()
        return 141
    except KeyboardInterrupt:
        print("flashllm: interrupted", file=sys.stderr)
        return 130
    return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout without a file descriptor (tests, embedding)
        pass


if __name__ == "__main__":
    sys.exit(main())
