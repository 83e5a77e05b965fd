"""`flashllm predictors train|order|eval`: train the low-rank activation predictors, order neurons by co-activation,
and measure what sparse mode costs in quality (thin CLI over flashllm.predictors)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashllm.cli.args import DEFAULT_DTYPE_HELP, add_load_options, add_model_dir, budget, load_options
from flashllm.progress import log_line

TRAIN_DESCRIPTION = """\
Run the model densely over the calibration text, record per layer the FFN input and the true
activation mask (spilled to zstd-compressed per-layer shards in a temporary directory), then train
per layer a low-rank predictor sigmoid(B(Ax)+b) with a class-balanced BCE. Whole calibration
sequences are held out: each layer's threshold is the largest reaching the recall target on them,
and its rank the one of the ladder with the lowest DRAM cost at that recall (predictor weights +
the cache rows a window of predicted sets needs; --rank N forces one). Writes predictors.safetensors
(with per-neuron activation frequencies) and predictors.json into MODEL_DIR."""


ORDER_DESCRIPTION = """\
Reorder each layer's FFN neurons so that neurons the predictors select together are adjacent in
ffn.bin: the flash engine reads adjacent bundles in one request, so a decode token needs fewer
reads. The order maximises, per layer, how often neighbouring neurons are loaded by the same token
on the calibration text (a greedy maximum-weight path; exact objective for reads without gap
filling). Permuting neurons leaves the model's function unchanged: ffn.bin, the FFN biases and
every per-neuron predictor tensor are rewritten in the new order (temporary files, then renamed),
so the runtime needs no id mapping; the permutation is kept in neuron_order.safetensors and the
manifest's "neuron_order" entry. Without trained predictors the true activations are used."""


def _train_epilog() -> str:
    from flashllm.predictors.train import describe_estimate

    return ("Active neurons: pre-activation > threshold for relu/fatrelu models. Dense activations "
            "(silu, gelu) need --sparsity S (or --ffn-error E, or --activation-threshold T): per-layer "
            "thresholds t on |act(pre)| (pre = gate for gated FFNs, up otherwise) are calibrated and written "
            "to MODEL_DIR/sparsity.json; sparse mode then skips the neurons with |act(pre)| <= t (a quality "
            "cost that `predictors eval` measures); dense mode stays the unmodified model. Memory: one "
            "layer's shard in RAM at a time. " + describe_estimate())


def _budgets(text: str) -> list:
    return [None if v == "unlimited" else budget(v) for v in text.split(",")]  # every load option's budget syntax


def _dtypes(text: str) -> list[str]:
    from flashllm.options import DTYPES

    bad = [v for v in text.split(",") if v not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"dtype {bad[0]!r}: expected one of {', '.join(DTYPES)}")
    return text.split(",")


def add_parser(sub) -> None:
    """The `flashllm predictors` subcommand and its own subcommands."""
    pr = sub.add_parser("predictors", help="train and evaluate the low-rank activation predictors",
                        description="Predictors decide which FFN neurons each token needs (sparse mode).")
    commands = pr.add_subparsers(dest="predictors_command", required=True)
    add_parsers(commands)
    commands.metavar = "{" + ",".join(commands.choices) + "}"  # named so in "required" errors, not by its dest


def add_parsers(sub) -> None:
    """Add `train`, `order` and `eval` to the subparsers of `flashllm predictors`."""
    from flashllm.predictors.train import DEFAULT_MAX_TOKENS, RANK_LADDER, TrainSettings

    d = TrainSettings()
    t = sub.add_parser("train", help="collect calibration data and train the predictors",
                       description=TRAIN_DESCRIPTION, epilog=_train_epilog())
    add_model_dir(t)
    t.add_argument("--data", required=True, help="calibration text file (UTF-8)")
    t.add_argument("--rank", type=int, default=None,
                   help=f"force this rank in every layer (default: by cost, from {list(RANK_LADDER)})")
    t.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"calibration tokens at most (default {DEFAULT_MAX_TOKENS:,}: collection time and temporary "
                   "disk grow with it, predictor quality hardly does beyond)")
    t.add_argument("--recall-target", type=float, default=d.recall_target,
                   help=f"recall on held-out sequences each layer's threshold is tuned for (default {d.recall_target})")
    t.add_argument("--window", type=int, default=d.window,
                   help=f"rank cost: cache rows for the union of this many tokens' predicted sets (default {d.window})")
    t.add_argument("--seed", type=int, default=d.seed, help=f"data split and initialisation (default {d.seed})")
    dense = t.add_mutually_exclusive_group()
    dense.add_argument("--sparsity", type=float, default=None, metavar="S",
                       help="dense activations (silu, gelu): calibrate per-layer thresholds on |act(pre)| that skip "
                       "this mean share of FFN neurons per token, allocated greedily over layers by FFN output error "
                       "(e.g. 0.4; default: none, required for such models unless --ffn-error or "
                       "--activation-threshold)")
    dense.add_argument("--ffn-error", type=float, default=None, metavar="E",
                       help="instead: in each layer the largest sparsity whose relative FFN output error is <= E")
    dense.add_argument("--activation-threshold", type=float, default=None, metavar="T",
                       help="instead: the same threshold T on |act(pre)| in every layer")
    t.add_argument("--epochs", type=int, default=d.epochs, help="training passes over each layer's samples (more on "
                   "small calibration sets, for at least 400 steps) (default: %(default)s)")
    t.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per optimizer step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=d.lr, help="Adam's learning rate, decayed on a cosine (default: %(default)s)")
    add_calibration_args(t, "cpu or cuda (calibration pass and training)")
    t.add_argument("--workdir", default=None, help="directory for the temporary shards (default $FLASHLLM_TMPDIR "
                   "or the system temp dir)")
    t.add_argument("--order", choices=["none", "coactivation"], default="none",
                   help="coactivation: afterwards rewrite the model with each layer's neurons ordered so that those "
                   "the new predictors select together are adjacent on flash (see `predictors order --help`)")
    t.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    t.add_argument("--json", action="store_true", help="print predictors.json's content as one JSON object")
    t.set_defaults(func=cmd_train)

    from flashllm.predictors.coactivation import DEFAULT_NEIGHBOURS, STATISTICS
    from flashllm.predictors.order import DEFAULT_MAX_TOKENS as ORDER_TOKENS, DEFAULT_WINDOW

    o = sub.add_parser("order", help="rewrite the model with neurons that are read together stored adjacently",
                       description=ORDER_DESCRIPTION)
    add_model_dir(o)
    o.add_argument("--data", required=True, help="calibration text file (UTF-8)")
    o.add_argument("--max-tokens", type=int, default=ORDER_TOKENS, help="calibration tokens at most")
    o.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="the runtime window whose loads are counted (--statistic loads)")
    o.add_argument("--statistic", choices=STATISTICS, default="loads",
                   help="count neurons loaded by the same decode token (loads) or active in it (active)")
    o.add_argument("--neighbours", type=int, default=DEFAULT_NEIGHBOURS,
                   help="candidate partners per neuron for the greedy path")
    add_calibration_args(o, "cpu or cuda")
    o.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    o.add_argument("--json", action="store_true", help="print the manifest's new neuron_order entry as JSON")
    o.set_defaults(func=cmd_order)

    e = sub.add_parser("eval", help="evaluate trained predictors on held-out text, at a DRAM budget or a sweep",
                       description="Quality of sparse mode with the trained predictors, loaded with the given options "
                       "(dtype, window, DRAM budget, backend, device, threads) against the dense model in the same "
                       "dtype: perplexity, greedy top-1 agreement, per-layer recall/precision of the predictors and "
                       "of what the FFN computed at that budget, neurons dropped, flash bytes and latency per token. "
                       "--sweep-budget evaluates several budgets (and --sweep-dtype several dtypes) and, with --out, "
                       "writes the quality-vs-memory table, JSON and plot.")
    add_model_dir(e)
    e.add_argument("--data", required=True, help="held-out text file (UTF-8)")
    e.add_argument("--max-tokens", type=int, default=2048, help="held-out tokens to score (default 2048)")
    e.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens for the top-1 agreement (default 256)")
    e.add_argument("--prompt-tokens", type=int, default=32, help="held-out prompt length for generation (default 32)")
    e.add_argument("--seq-len", type=int, default=None, help="tokens per scored sequence (default 256)")
    e.add_argument("--sweep-budget", type=_budgets, default=None, metavar="B1,B2,...",
                   help="evaluate these DRAM budgets in turn, e.g. 0.4,0.5,0.6,0.8,1.0,unlimited (replaces --dram-budget)")
    e.add_argument("--sweep-dtype", type=_dtypes, default=None, metavar="D1,D2,...",
                   help="evaluate these compute dtypes in turn, e.g. float32,bfloat16 (replaces --dtype)")
    e.add_argument("--out", default=None, help="write PREFIX.json, PREFIX.md and PREFIX.png (the quality-vs-memory "
                   "table and plot), e.g. out/quality_vs_memory")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    add_load_options(e, skip=("mode", "plan", "batch_size"))  # the same options, help and defaults as generate
    e.set_defaults(func=cmd_eval)


def _chatter(args) -> dict:
    """`progress` and `log` for a long command: nothing with --quiet or --json; else a bar where stderr is a
    terminal, and log lines written above it."""
    if args.quiet or args.json:
        return {"progress": False, "log": None}
    return {"progress": None, "log": log_line}


def cmd_train(args) -> None:
    from flashllm.predictors.calibrate import Target
    from flashllm.predictors.train import TrainSettings, train_predictors

    target = next((Target(method, value) for method, value in (("sparsity", args.sparsity),
                   ("ffn_error", args.ffn_error), ("explicit", args.activation_threshold)) if value is not None), None)
    settings = TrainSettings(rank=args.rank, recall_target=args.recall_target,
                             window=args.window, epochs=args.epochs,
                             batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device)
    chatter = _chatter(args)
    meta = train_predictors(args.model_dir, args.data, settings, max_tokens=args.max_tokens, seq_len=args.seq_len,
                            target=target, low_memory=args.low_memory,
                            dtype=args.dtype, workdir=args.workdir, **chatter)
    if args.order == "coactivation":
        from flashllm.modes.sparse.predictor import PREDICTOR_META
        from flashllm.predictors.order import DEFAULT_MAX_TOKENS as ORDER_TOKENS, order_model

        order_model(args.model_dir, args.data, max_tokens=min(args.max_tokens, ORDER_TOKENS), seq_len=args.seq_len,
                    low_memory=args.low_memory, dtype=args.dtype, device=args.device, window=args.window,
                    **chatter)
        meta = json.loads((Path(args.model_dir) / PREDICTOR_META).read_text())
    if args.json:
        print(json.dumps(meta))
        return
    s = meta["summary"]
    print(f"wrote predictors for {len(meta['layers'])} layers into {args.model_dir}: mean held-out recall "
          f"{s['recall']:.4f}, predicted/true {s['predicted_over_true']:.2f}, ranks {s['ranks']} "
          f"({meta['calibration']['tokens']} calibration tokens)")
    if "sparsity" in meta:
        sp = meta["sparsity"]
        print(f"wrote calibrated thresholds into {args.model_dir}/{sp['file']}: sparse mode skips "
              f"{sp['mean_sparsity']:.0%} of the FFN per token on calibration text, FFN output error "
              f"{sp['mean_ffn_error']:.1%} (relative RMS); measure the perplexity cost with `flashllm predictors "
              f"eval {args.model_dir} --data HELDOUT`")


def cmd_order(args) -> None:
    from flashllm.predictors.order import order_model

    info = order_model(args.model_dir, args.data, max_tokens=args.max_tokens, window=args.window,
                       statistic=args.statistic, neighbours=args.neighbours, seq_len=args.seq_len,
                       low_memory=args.low_memory, dtype=args.dtype, device=args.device, **_chatter(args))
    if args.json:
        print(json.dumps(info))
        return
    print(f"reordered {len(info['layers'])} layers of {args.model_dir} by co-activation ({info['statistic']}, window "
          f"{info['window']}, {info['tokens']} tokens): reads per decode token on that text, without gap filling, "
          f"{info['runs_per_token_before']} -> {info['runs_per_token_after']} (all layers)")


def cmd_eval(args) -> None:
    from flashllm.predictors.evaluate import evaluate
    from flashllm.predictors.report import check_out_prefix, format_report, write_sweep

    if args.out:
        check_out_prefix(args.out)
    options = load_options(args)
    results = [evaluate(args.model_dir, args.data, options.replace(dtype=dtype), budgets=args.sweep_budget,
                        max_tokens=args.max_tokens, gen_tokens=args.gen_tokens, prompt_tokens=args.prompt_tokens,
                        seq_len=args.seq_len, progress=_chatter(args)["progress"])
               for dtype in (args.sweep_dtype or [options.dtype])]
    if args.out:
        paths = write_sweep(results, args.out, "flashllm " + " ".join(sys.argv[1:]))
        note = "" if len(paths) == 3 else " (no plot: matplotlib is not installed; pip install matplotlib)"
        print("wrote " + ", ".join(map(str, paths)) + note, file=sys.stderr)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else {"results": results}))
    else:
        print("\n\n".join(format_report(r) for r in results))


def add_calibration_args(p, device_help: str) -> None:
    """The calibration pass's options, shared by `predictors train` and `predictors order`."""
    p.add_argument("--seq-len", type=int, default=None, help="tokens per calibration sequence (default 256)")
    p.add_argument("--low-memory", action="store_true",
                   help="collect in naive mode: only one layer's weights in DRAM at a time (large models)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help=f"compute dtype of the calibration pass (default: as flashllm.load: {DEFAULT_DTYPE_HELP})")
    p.add_argument("--device", default="cpu", help=device_help)
