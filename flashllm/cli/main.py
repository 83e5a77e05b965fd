"""The `flashllm` command: one parser built from the command modules (each adds its subcommand and handler), and
`main`, which runs the chosen command and turns a user error into one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import sys

from flashllm import __version__
from flashllm.cli import chat, console, convert, demo, generate, inspect, plan, predictors, serve
from flashllm.cli.args import PROG, Parser
from flashllm.errors import FlashLLMError

COMMANDS = (convert, generate, inspect, demo, predictors, plan, chat, serve)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Run LLMs larger than memory by streaming FFN neurons from flash "
               "(LLM in a flash).")
    p.add_argument("--version", action="version", version=f"flashllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with console.flashllm_warnings():
        try:
            args.func(args)
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        except FlashLLMError as exc:
            print(f"flashllm: error: {exc.cli_message()}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # `flashllm ... | head`: the reader left; stop quietly like other tools
            console.discard_stdout()
            return 141
        except KeyboardInterrupt:
            print("flashllm: interrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
