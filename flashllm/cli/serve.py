"""`flashllm serve`: load a model once and answer OpenAI-compatible HTTP requests (flashllm.serve)."""

from __future__ import annotations

import dataclasses
import os
import sys

from flashllm.cli.args import add_load_options, add_model_dir, checked, count, load_options, positive
from flashllm.errors import FlashLLMError
from flashllm.serve.app import MAX_BODY_BYTES, READ_TIMEOUT, Server, require
from flashllm.serve.http import is_loopback, listen, run

MAX_BATCH = 16  # the default's ceiling: beyond it a step's attention (per sequence) outweighs the shared weights
KV_SHARE = 4  # the default batch's KV caches take at most 1/KV_SHARE of the DRAM budget (or of physical memory)


def add_parser(sub) -> None:
    """The `flashllm serve` subcommand."""
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Load MODEL once and answer POST /v1/chat/completions, POST /v1/completions "
                       "(OpenAI-compatible, stream: true as server-sent events), GET /v1/models and GET /health. "
                       "Up to --max-batch requests decode together (continuous batching); others wait in a "
                       "bounded queue (503 when full).")
    add_model_dir(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback unless you open it up)")
    s.add_argument("--port", type=checked(int, lambda v: 0 <= v <= 65535, "a TCP port, 0-65535"), default=8080,
                   help="TCP port (0: any free one, printed at start)")
    s.add_argument("--api-key", default=os.environ.get("FLASHLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request (default: $FLASHLLM_API_KEY, else none)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page origin (https://app.example) allowed to call this server from a browser; "
                   "repeat for several, '*' for any (default: none: requests carrying another site's Origin get 403)")
    s.add_argument("--model-name", help="the model id clients send (default: the model directory's name)")
    s.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file, or 'plain' (role-prefixed "
                   "turns, for base models) (default: the checkpoint's own; without one, only /v1/completions)")
    s.add_argument("--max-batch", type=positive, help=f"requests decoded together, each with its own KV cache "
                   f"(default: up to {MAX_BATCH}, as many as keep their KV caches within 1/{KV_SHARE} of the DRAM "
                   f"budget, or of physical memory without one)")
    s.add_argument("--max-queue", type=count, default=64, help="requests that may wait while the batch is full "
                   "(default: %(default)s)")
    s.add_argument("--max-body", type=positive, default=MAX_BODY_BYTES, help="largest request body in bytes")
    s.add_argument("--read-timeout", type=checked(float, lambda v: v > 0, "a positive number of seconds"),
                   default=READ_TIMEOUT, help="seconds a client may take to send a request's headers, then its body "
                   "(default: %(default)s)")
    add_load_options(s, skip=("batch_size", "speculative"))  # --max-batch sets it; its steps do not speculate
    s.set_defaults(func=command)


def command(args) -> None:
    from flashllm import load

    require()
    if args.api_key is not None and not args.api_key.strip():
        raise FlashLLMError("the API key is empty (--api-key or $FLASHLLM_API_KEY): set a key, or unset "
                            "FLASHLLM_API_KEY to serve without one")
    sock = listen(args.host, args.port)
    try:
        options = load_options(args)
        max_batch = args.max_batch or default_max_batch(args.model_dir, options)
        model = load(args.model_dir, dataclasses.replace(options, batch_size=max_batch))
        server = Server(model, args.model_name, args.max_queue, args.api_key, args.chat_template, args.max_body,
                        max_batch, tuple(args.allow_origin), args.read_timeout)
    except BaseException:
        sock.close()
        raise
    print(f"flashllm serve: {server.name} ({model.mode} mode, context {model.context}, chat template: "
          f"{server.template.origin if server.template else 'none'}) on http://{args.host}:{sock.getsockname()[1]}/v1 "
          f"(up to {max_batch} decoding together, {args.max_queue} may wait)", file=sys.stderr, flush=True)
    if args.api_key is None and not is_loopback(sock):
        print(f"flashllm: warning: listening on {args.host}, reachable from other machines, without an API key: "
              f"anyone who can reach it can use it; set --api-key or $FLASHLLM_API_KEY", file=sys.stderr, flush=True)
    run(server, sock)


def default_max_batch(model_dir, options) -> int:
    """Up to MAX_BATCH sequences whose KV caches take at most 1/KV_SHARE of the DRAM budget (of physical memory
    without one); at least 1."""
    from flashllm.budget import budget_bytes
    from flashllm.format import manifest as fmt
    from flashllm.model import DEFAULT_CONTEXT

    manifest = fmt.read_manifest(model_dir)
    spec = manifest.spec
    context = min(options.context or DEFAULT_CONTEXT, spec.context_limit)
    itemsize = 1 if options.kv_bits == 8 else 4 if (options.dtype or manifest.dtype) == "float32" else 2
    per_sequence = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * context * itemsize
    model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
    budget = budget_bytes(options.dram_budget, model_bytes) or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(MAX_BATCH, budget // KV_SHARE // per_sequence))
