"""Argument helpers every `flashllm` command shares: the parser class (defaults in every option's help, one-line
errors), checked argparse types, the MODEL_DIR argument, the load and sampling options, and `load_options(args)`."""

from __future__ import annotations

import argparse
import copy
import math
import sys

from flashllm.errors import FlashLLMError

# what backends.base.default_compute_dtype picks when --dtype is not given
DEFAULT_DTYPE_HELP = ("the storage dtype; bfloat16 on torch CPU for int8/int4 FFN bundles with float16 resident "
                      "tensors; float32 for float16 files on MLX's CPU build")


PROG = "flashllm"


class HelpFormatter(argparse.HelpFormatter):
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


class Parser(argparse.ArgumentParser):
    """argparse with defaults in every option's help and a one-line error (the usage is one --help away)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
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


def checked(convert, ok, what: str):
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


count = checked(int, lambda v: v >= 0, "an integer of 0 or more")
fraction = checked(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
temperature = checked(float, lambda v: math.isfinite(v) and v >= 0, "a number of 0 (greedy) or more")
top_p = checked(float, lambda v: 0 < v <= 1, "a probability in (0, 1]")



row_count = checked(int, lambda v: v >= 1, "whole numbers of at least 1, one per layer")
positive = checked(int, lambda v: v >= 1, "an integer of 1 or more")


def rows(text: str) -> tuple[int, ...]:
    """argparse type for --cache-rows: comma-separated row counts."""
    return tuple(row_count(v) for v in text.split(","))


def budget(text: str):
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
    g.add_argument("--dram-budget", type=budget, default=d.dram_budget, metavar="BUDGET",
                   help="DRAM for weights, caches and KV: a fraction of the model (0.5 or 50%%), a size (6GiB, "
                   "700MiB, 20M) or bytes (default: unlimited, as in the Python API)")
    g.add_argument("--gpu-budget", type=budget, default=d.gpu_budget, metavar="BUDGET",
                   help="with --device cuda: device memory for weights, KV and caches, same forms; refused off a GPU "
                   "(default: unlimited)")
    g.add_argument("--window", type=positive, default=d.window,
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
    g.add_argument("--hybrid-fraction", type=fraction, default=d.hybrid_fraction,
                   help="hybrid mode: share of each FFN kept resident (default: sized by the budget)")
    g.add_argument("--threads", type=positive, default=d.threads, help="flash reads in flight (default: %(default)s)")
    g.add_argument("--aio-depth", type=count, default=d.aio_depth,
                   help="Linux, direct I/O: serve the reads with native AIO, this many in flight "
                        "(less CPU per read; 0: one blocking read per thread) (default: native AIO for sparse "
                        "mode's FFN reads, else 0)")
    g.add_argument("--gap-bytes", type=gap_bytes, default=d.gap_bytes,
                   help="sparse mode: read through gaps of up to this many bytes between needed bundles instead "
                        "of issuing another read; 'auto': from the disk's measured per-read cost and bandwidth "
                        "(flashllm.io.disk_profile) (default: %(default)s: off; docs/sparsity.md says when gap "
                        "reads pay)")
    g.add_argument("--prefetch", action=argparse.BooleanOptionalAction, dest="read_ahead", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the former spelling of --read-ahead
    g.add_argument("--read-ahead", action=argparse.BooleanOptionalAction, default=d.read_ahead,
                   help="read layer l+1's weights while layer l computes (sparse: the neurons layer l+1's "
                        "predictor picks from layer l's residual stream; misses are read when l+1 runs) "
                        "(default: on for naive and hybrid; for sparse, on where its reads land in cache rows through "
                        "native AIO)")
    g.add_argument("--context", type=positive, default=d.context,
                   help="KV cache length (default: min(model, 4096))")
    g.add_argument("--quantize-resident", default=d.quantize_resident, choices=QUANTIZE_RESIDENT,
                   help="hold the attention, embedding and lm_head matrices quantized in DRAM (at load; torch CPU "
                   "and MLX; quality cost: docs/quantization.md) (default: %(default)s)")
    g.add_argument("--kv-bits", type=int, default=d.kv_bits, choices=KV_BITS,
                   help="8: KV cache in int8 groups along the head dim (quality cost: docs/quantization.md); 16: in "
                   "the compute dtype, unquantized (default: %(default)s)")
    g.add_argument("--cache-rows", type=rows, default=d.cache_rows, metavar="N1,N2,...",
                   help="sparse mode: neuron cache rows per layer, one number per layer (what `flashllm plan` "
                   "chooses) (default: sized by the budget)")
    g.add_argument("--kernels", default=d.kernels, choices=KERNELS,
                   help="tuned: q/k/v and gate/up fused at load, the fastest kernel per dtype (same math); "
                   "plain: the file's tensors with torch's default kernels, for comparison (default: %(default)s)")
    g.add_argument("--batch-size", type=positive, default=None,
                   help="sequences decoded together, each with its own KV cache (--batch-file) (default: every "
                   "prompt of --batch-file at once, else 1)")
    g.add_argument("--compute-threads", type=positive, default=d.compute_threads, metavar="N",
                   help="intra-op threads of the math (torch CPU) (default: every core the process may run on; OpenMP "
                   "workers sleep at barriers and decode attention runs in one thread; the result is the same bits at "
                   "any count)")
    if "speculative" not in skip:
        add_speculative_options(parser)
    g.add_argument("--plan", default="none", choices=["none", "auto"],
                   help="auto: mode, dtype, window and per-layer caches from `flashllm plan` for this --dram-budget "
                   "(the saved plan.json when it matches, else planned now and saved) (default: %(default)s)")


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """--prompt-lookup, --draft-model, --num-draft-tokens: LoadOptions.speculative (see `speculation`)."""
    from flashllm.options import PROMPT_LOOKUP, Speculation

    spec = parser.add_argument_group("speculative decoding (exact: greedy output unchanged; docs/speculative.md)")
    draft = spec.add_mutually_exclusive_group()
    draft.add_argument("--prompt-lookup", action="store_const", const=PROMPT_LOOKUP, dest="speculative", help="draft tokens by n-gram lookup in the prompt and "
                       "the text so far, verified several per forward pass (strong on code, quoting, editing) "
                       "(default: off)")
    draft.add_argument("--draft-model", metavar="DIR", dest="speculative", help="draft tokens with this converted small model of the "
                       "same tokenizer, held in memory (charged to the budget) (default: none)")
    spec.add_argument("--num-draft-tokens", type=positive, default=Speculation.num_draft_tokens, metavar="K",
                      help="the most tokens drafted per verification (the draft length adapts to what was accepted) "
                      "(default: %(default)s)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """How tokens are picked and when generation stops (generate, serve, chat); see Model.stream."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=count, default=32, help="stop after this many new tokens "
                   "(default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop before this text appears, taken literally (a newline in bash: $'\\n'; "
                   "repeatable; default: only the end-of-sequence tokens)")
    g.add_argument("--temperature", type=temperature, default=0.0,
                   help="sampling temperature; 0 picks the most likely token (default: %(default)s)")
    g.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling: sample from the smallest set "
                   "of tokens whose probability reaches P; 1 keeps all (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")


def gap_bytes(text: str) -> int | None:
    """argparse type for --gap-bytes: a byte count, or None for `auto`."""
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
    values["speculative"] = speculation(args)
    options = LoadOptions(**values)
    if getattr(args, "plan", "none") == "auto":
        from flashllm.planner.auto import auto_options

        options = auto_options(args.model_dir, options,
                               log=lambda msg: print(f"flashllm: {msg}", file=sys.stderr, flush=True))
    return options


def speculation(args: argparse.Namespace):
    """The Speculation of --prompt-lookup / --draft-model (None: neither given); --num-draft-tokens alone is refused."""
    from flashllm.options import Speculation

    draft = getattr(args, "speculative", None)  # --prompt-lookup or --draft-model DIR
    k = getattr(args, "num_draft_tokens", Speculation.num_draft_tokens)
    if draft is None:
        if k != Speculation.num_draft_tokens:
            raise FlashLLMError(f"--num-draft-tokens {k}: speculative decoding is off; add --prompt-lookup or "
                                f"--draft-model DIR")
        return None
    return Speculation(draft=draft, num_draft_tokens=k)


def warn_if_context_cut(args, model) -> None:
    """A --context beyond the model's positions runs at the model's: said on stderr, not silently."""
    if getattr(args, "context", None) and args.context > model.context:
        print(f"flashllm: warning: --context {args.context}: the model has {model.context} positions; the KV cache "
              f"holds {model.context}", file=sys.stderr)
