"""`flashllm profile` and `flashllm plan`: thin CLI over flashllm.planner (profile, auto, solver)."""

from __future__ import annotations

import json
import sys

from flashllm.cli.args import add_model_dir, budget
from flashllm.errors import FlashLLMError
from flashllm.planner import auto


def _log(quiet: bool):
    """Progress lines on stderr, or none."""
    return (lambda msg: None) if quiet else (lambda msg: print(f"flashllm: {msg}", file=sys.stderr, flush=True))


def add_parser(sub) -> None:
    from flashllm.options import DTYPES
    from flashllm.planner.solver import CALIBRATE_TOKENS, MAX_DROPPED, SAMPLE_TOKENS

    p = sub.add_parser("profile", help="measure this machine once (disk, DRAM, matvec) and cache it",
                       description="Measure what reads, copies and matrix-vector products cost on this machine: "
                       "random-read throughput and latency per request size and reads in flight on the disk of "
                       "PATH, DRAM copy and cast bandwidth, matvec throughput per compute dtype, and the "
                       "runtime's fixed cost per layer. Cached per machine (and per disk); --refresh measures again.")
    p.add_argument("path", nargs="?", default=".", help="a file or directory on the disk to profile "
                   "(a model directory) (default: the current directory)")
    p.add_argument("--backend", default="torch", choices=["torch"], help="compute backend profiled")
    p.add_argument("--device", default="cpu", help="compute device profiled")
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=profile_command)

    q = sub.add_parser("plan", help="choose mode, window, per-layer caches and dtype for a DRAM budget",
                       description="Solve a small MILP on the cost model (docs/cost_model.md) with this machine's "
                       "profile and the model's predictor statistics, print the chosen settings and the predicted "
                       "decode-token latency with its parts, and save the plan as plan.json in the model "
                       "directory (used by `--plan auto` on generate, serve and chat).")
    add_model_dir(q)
    q.add_argument("--dram-budget", type=budget, required=True, metavar="BUDGET",
                   help="a fraction of the model (0.5 or 50%%), a size (6GiB, 700MiB) or bytes")
    q.add_argument("--dtypes", default=None, metavar="D1,D2",
                   help=f"compute dtypes the plan may choose from ({', '.join(DTYPES)}; default: the storage dtype "
                   "only, so results stay as without a plan)")
    q.add_argument("--context", type=int, default=None, help="KV cache length (default: min(model, 4096))")
    q.add_argument("--data", default=None, help="sample text for the predictor statistics (default: this "
                   "Python's standard library sources)")
    q.add_argument("--sample-tokens", type=int, default=SAMPLE_TOKENS, help="sample tokens replayed")
    q.add_argument("--max-dropped", type=float, default=MAX_DROPPED,
                   help="share of predicted neurons the caches may drop (a quality cost; 0 forbids)")
    q.add_argument("--calibrate-tokens", type=int, default=CALIBRATE_TOKENS,
                   help="decode tokens the runtime itself runs per mode to calibrate the cost model (0: the cost "
                   "model alone, less accurate; see docs/cost_model.md)")
    q.add_argument("--refresh", action="store_true", help="measure the machine again first")
    q.add_argument("--quiet", action="store_true", help="no progress lines")
    q.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    q.set_defaults(func=plan_command)


def profile_command(args) -> None:
    from flashllm.planner import profile

    log = _log(args.json)
    disk = auto.disk(args.path, args.refresh, log)
    aio = auto.disk(args.path, args.refresh, log, "aio")  # what sparse mode's reads go through where AIO works
    machine = profile.profile(args.backend, args.device, refresh=args.refresh, progress=log)
    if args.json:
        print(json.dumps({"machine": machine.to_dict(), "disk": disk.to_dict(), "disk_aio": aio.to_dict()}))
        return
    print(disk.table())
    print(aio.table())
    print(machine.table())


def _dtypes(text: str | None) -> list[str] | None:
    from flashllm.options import DTYPES

    if text is None:
        return None
    bad = [d for d in text.split(",") if d not in DTYPES]
    if bad:
        raise FlashLLMError(f"--dtypes {text}: {bad[0]!r} is not one of {', '.join(DTYPES)}")
    return text.split(",")


def plan_command(args) -> None:
    plan = auto.plan_for(args.model_dir, args.dram_budget, _dtypes(args.dtypes), args.context, args.data,
                         args.sample_tokens, args.max_dropped, args.refresh, _log(args.quiet or args.json),
                         args.calibrate_tokens)
    print(json.dumps(plan.to_dict()) if args.json else plan.describe())
