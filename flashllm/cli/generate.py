"""`flashllm generate`: text from a prompt (or, with --batch-file, from many prompts decoded together), with
per-token stats on request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashllm.cli import console
from flashllm.cli.args import add_load_options, add_model_dir, add_sampling_options, load_options, warn_if_context_cut
from flashllm.cli.stats_text import format_stats
from flashllm.errors import FlashLLMError


def add_parser(sub) -> None:
    """The `flashllm generate` subcommand."""
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
    g.set_defaults(func=command)


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


def command(args) -> None:
    from flashllm import load

    if args.batch_file is not None:
        from flashllm.cli.batch import generate_batch

        return generate_batch(args)

    prompt = read_prompt(args)
    model = load(args.model_dir, load_options(args))
    warn_if_context_cut(args, model)
    pieces = model.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.json:
        text, result = "".join(pieces), model.last_generation
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
                          "stats": model.stats}))
        return
    wrote = False  # text, or a finished generation (an empty text's line too); not an error before any text
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
            wrote = True
            if piece:
                console.text_line_open = not piece.endswith("\n")
        wrote = True
    finally:
        console.text_line_open = False
        if wrote:
            print()  # the text's line ends before anything else is written, an error included
    if model.last_stop_reason == "context":
        further = "the model has no more positions" if model.context >= model.spec.context_limit else \
            "load with a larger --context to continue further"
        print(f"flashllm: note: generation stopped at the end of the context ({model.context} tokens); {further}",
              file=sys.stderr)
    if args.stats:
        print(format_stats(model.stats), file=sys.stderr)
