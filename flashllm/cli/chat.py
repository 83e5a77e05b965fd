"""`flashllm chat`: a multi-turn conversation in the terminal, streamed as it is generated.

The whole conversation goes through the model's chat template each turn. Ctrl-C stops a reply
(what was shown stays in the conversation); Ctrl-C or Ctrl-D at the prompt, or /exit, ends the chat.
"""

from __future__ import annotations

import sys

from flashllm.cli.args import add_load_options, add_model_dir, add_sampling_options, load_options, warn_if_context_cut
from flashllm.cli.stats_text import format_stats
from flashllm.errors import FlashLLMError

HELP = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def add_parser(sub) -> None:
    """The `flashllm chat` subcommand."""
    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="An interactive multi-turn chat through the model's chat template, streamed "
                       "as it is generated. " + HELP + ".")
    add_model_dir(c)
    c.add_argument("--system", help="system prompt that opens the conversation (default: none)")
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file, or 'plain' (role-prefixed "
                   "turns, for base models) (default: the checkpoint's own)")
    c.add_argument("--stats", action="store_true", help="print per-token stats after each reply (to stderr) (default: off)")
    add_sampling_options(c)
    c.set_defaults(max_new_tokens=256, func=command)
    add_load_options(c, skip=("batch_size",))  # one conversation: no batches


def command(args) -> None:
    from flashllm import load
    from flashllm.text.chat_template import ChatTemplate
    from flashllm.format.manifest import read_manifest

    # a model without a template (or a bad --chat-template) fails here, before the weights are loaded
    template = ChatTemplate.resolve(read_manifest(args.model_dir, verify=False).root, args.chat_template)
    model = load(args.model_dir, load_options(args))
    warn_if_context_cut(args, model)
    model.chat_template = template
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    print(f"flashllm chat: {model.manifest.root.name} ({model.mode} mode, context {model.context} tokens); {HELP}",
          file=sys.stderr, flush=True)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = list(opening)
            print("flashllm: conversation reset" + (" (the --system prompt stays)" if opening else ""), file=sys.stderr,
                  flush=True)
            continue
        messages = history + [{"role": "user", "content": line}]
        reply = []
        try:
            for piece in model.stream_chat(messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           top_p=args.top_p, seed=args.seed, stop=args.stop):
                print(piece, end="", flush=True)
                reply.append(piece)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        except FlashLLMError as exc:
            print(f"flashllm: error: {exc.cli_message()} (/reset starts a new conversation)", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        history = messages + [{"role": "assistant", "content": "".join(reply)}]
        if model.last_stop_reason == "context":
            print(f"flashllm: note: the conversation filled the context ({model.context} tokens); /reset to go on",
                  file=sys.stderr, flush=True)
        if args.stats:
            print(format_stats(model.stats), file=sys.stderr, flush=True)
