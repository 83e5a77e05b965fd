"""`flashllm serve`: load a model once and answer OpenAI-compatible HTTP requests (flashllm.serve.app)."""

from __future__ import annotations

import os
import sys

from flashllm.cli.args import add_load_options, add_model_dir, checked, count, load_options, positive
from flashllm.serve.app import MAX_BODY_BYTES, Server, listen, require, run


def add_parser(sub) -> None:
    """The `flashllm serve` subcommand."""
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Load MODEL once and answer POST /v1/chat/completions, POST /v1/completions "
                       "(OpenAI-compatible, stream: true as server-sent events), GET /v1/models and GET /health. "
                       "One request decodes at a time; others wait in a bounded queue (503 when full).")
    add_model_dir(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback unless you open it up)")
    s.add_argument("--port", type=checked(int, lambda v: 0 <= v <= 65535, "a TCP port, 0-65535"), default=8080,
                   help="TCP port (0: any free one, printed at start)")
    s.add_argument("--api-key", default=os.environ.get("FLASHLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request (default: $FLASHLLM_API_KEY, else none)")
    s.add_argument("--model-name", help="the model id clients send (default: the model directory's name)")
    s.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file, or 'plain' (role-prefixed "
                   "turns, for base models) (default: the checkpoint's own; without one, only /v1/completions)")
    s.add_argument("--max-queue", type=count, default=8, help="requests that may wait while one decodes")
    s.add_argument("--max-body", type=positive, default=MAX_BODY_BYTES, help="largest request body in bytes")
    add_load_options(s, skip=("batch_size",))  # requests decode one at a time
    s.set_defaults(func=command)


def command(args) -> None:
    from flashllm import load

    require()
    sock = listen(args.host, args.port)
    try:
        server = Server(load(args.model_dir, load_options(args)), args.model_name, args.max_queue, args.api_key,
                        args.chat_template, args.max_body)
    except BaseException:
        sock.close()
        raise
    print(f"flashllm serve: {server.name} ({server.model.mode} mode, context {server.model.context}, chat template: "
          f"{server.template.origin if server.template else 'none'}) on http://{args.host}:{sock.getsockname()[1]}/v1 "
          f"(one decode at a time, {args.max_queue} may wait)", file=sys.stderr, flush=True)
    run(server, sock)
