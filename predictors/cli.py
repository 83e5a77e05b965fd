"""`flashllm predictors train|eval`: argument parsers and handlers (flashllm/cli.py mounts them)."""

from __future__ import annotations

import json
import sys

TRAIN_DESCRIPTION = """\
Run the model densely over the calibration text, record per layer the FFN input and the true
activation mask (spilled to zstd-compressed per-layer shards in a temporary directory), then train
per layer a low-rank predictor sigmoid(B(Ax)+b) with a class-balanced BCE. The rank is the smallest
of the ladder reaching the recall target on held-out calibration tokens with at most 3x as many
predicted as truly active neurons (--rank N forces one); the threshold is tuned for the recall
target. Writes predictors.safetensors (with per-neuron activation frequencies) and predictors.json
into MODEL_DIR."""


def _train_epilog() -> str:
    from .train import describe_estimate

    return ("Active neurons: pre-activation > threshold for relu/fatrelu models. Dense activations "
            "(silu, gelu) need --activation-threshold T: a neuron counts as active iff |act(pre)| > T "
            "(pre = gate for gated FFNs, up otherwise). Memory: one layer's shard in RAM at a time. "
            + describe_estimate())


def add_parsers(sub) -> None:
    """Add `train` and `eval` to the subparsers of `flashllm predictors`."""
    from flashllm.cli import _budget  # the same budget syntax as `flashllm generate`

    from .train import RANK_LADDER, TrainSettings

    d = TrainSettings()
    t = sub.add_parser("train", help="collect calibration data and train the predictors",
                       description=TRAIN_DESCRIPTION, epilog=_train_epilog())
    t.add_argument("model_dir")
    t.add_argument("--data", required=True, help="calibration text file (UTF-8)")
    t.add_argument("--rank", type=int, default=None,
                   help=f"force this rank in every layer (default: adaptive from {list(RANK_LADDER)})")
    t.add_argument("--max-tokens", type=int, default=None, help="cap the calibration tokens")
    t.add_argument("--recall-target", type=float, default=d.recall_target,
                   help=f"held-out recall each layer's threshold is tuned for (default {d.recall_target})")
    t.add_argument("--max-predicted-over-true", type=float, default=d.max_predicted_over_true,
                   help="adaptive rank: accept the smallest rank predicting at most this many times the true "
                   f"active neurons (default {d.max_predicted_over_true})")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--activation-threshold", type=float, default=None,
                   help="opt-in rule for dense activations (silu, gelu): active iff |act(pre)| > T")
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--batch-size", type=int, default=d.batch_size)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--seq-len", type=int, default=None, help="tokens per calibration sequence (default 256)")
    t.add_argument("--low-memory", action="store_true",
                   help="collect in naive mode: only one layer's weights in DRAM at a time (large models)")
    t.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype of the calibration pass")
    t.add_argument("--device", default="cpu", help="cpu or cuda (calibration pass and training)")
    t.add_argument("--workdir", default=None, help="directory for the temporary shards (default $FLASHLLM_TMPDIR "
                   "or the system temp dir)")
    t.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    t.add_argument("--json", action="store_true", help="print predictors.json's content as one JSON object")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate trained predictors on held-out text",
                       description="Per-layer recall/precision/predicted fraction against the true masks, "
                       "perplexity dense vs sparse(lowrank, window) teacher-forced token by token, greedy top-1 "
                       "agreement over generated tokens, and flash bytes read per decode token vs naive mode.")
    e.add_argument("model_dir")
    e.add_argument("--data", required=True, help="held-out text file (UTF-8)")
    e.add_argument("--max-tokens", type=int, default=2048, help="held-out tokens to score (default 2048)")
    e.add_argument("--window", type=int, default=4, help="sparse mode: neurons of the last K tokens stay cached")
    e.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens for the top-1 agreement")
    e.add_argument("--prompt-tokens", type=int, default=32, help="held-out prompt length for generation")
    e.add_argument("--seq-len", type=int, default=None, help="tokens per scored sequence (default 256)")
    e.add_argument("--dram-budget", type=_budget, default=None,
                   help="sparse mode DRAM budget: a fraction of the model size or bytes, e.g. 0.5 or 512MiB "
                   "(default: unlimited)")
    e.add_argument("--threads", type=int, default=4, help="flash reader threads")
    e.add_argument("--device", default="cpu")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)


def cmd_train(args) -> None:
    from .train import TrainSettings, train_predictors

    settings = TrainSettings(rank=args.rank, recall_target=args.recall_target,
                             max_predicted_over_true=args.max_predicted_over_true, epochs=args.epochs,
                             batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device)
    quiet = args.quiet or args.json
    meta = train_predictors(args.model_dir, args.data, settings, max_tokens=args.max_tokens, seq_len=args.seq_len,
                            activation_threshold=args.activation_threshold, low_memory=args.low_memory,
                            dtype=args.dtype, workdir=args.workdir, progress=not quiet,
                            log=None if quiet else lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(meta))
        return
    s = meta["summary"]
    print(f"wrote predictors for {len(meta['layers'])} layers into {args.model_dir}: mean held-out recall "
          f"{s['recall']:.4f}, predicted/true {s['predicted_over_true']:.2f}, ranks {s['ranks']} "
          f"({meta['calibration']['tokens']} calibration tokens)")


def cmd_eval(args) -> None:
    from .evaluate import evaluate, format_report

    result = evaluate(args.model_dir, args.data, max_tokens=args.max_tokens, window=args.window,
                      gen_tokens=args.gen_tokens, prompt_tokens=args.prompt_tokens, seq_len=args.seq_len,
                      dram_budget=args.dram_budget, threads=args.threads, device=args.device,
                      progress=not (args.quiet or args.json))
    print(json.dumps(result) if args.json else format_report(result))
