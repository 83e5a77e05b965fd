"""`flashllm profile`, `flashllm plan` and `--plan auto`: thin CLI over flashllm/planner/profile.py and flashllm/planner/solver.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashllm.errors import FlashLLMError


def _disk(model_dir, refresh: bool, log, engine: str = "preadv"):
    """The profile of the model's disk read with `engine` (reader threads, or native AIO as sparse reads)."""
    try:
        from flashllm.io import disk_profile
    except ImportError:
        raise FlashLLMError("this flashllm has no disk profiler (flashllm.io.disk_profile)") from None
    p = disk_profile.profile(model_dir, refresh=refresh, progress=log, engine=engine)
    if p.call_us is None:  # cached before engine calls were costed (the cost model needs them): measure again
        p = disk_profile.profile(model_dir, refresh=True, progress=log, engine=engine)
    return p


def _disks(model_dir, refresh: bool, log):
    """engine -> the disk profile measured with it, each measured (or read from the cache) once when asked."""
    got = {}

    def disk_for(engine: str):
        if engine not in got:
            got[engine] = _disk(model_dir, refresh, log, engine)
        return got[engine]
    return disk_for


def _log(quiet: bool):
    return (lambda msg: None) if quiet else (lambda msg: print(f"flashllm: {msg}", file=sys.stderr, flush=True))


def add_parsers(sub) -> None:
    from flashllm.cli.main import _budget, add_model_dir
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
    p.set_defaults(func=cmd_profile)

    q = sub.add_parser("plan", help="choose mode, window, per-layer caches and dtype for a DRAM budget",
                       description="Solve a small MILP on the cost model (docs/cost_model.md) with this machine's "
                       "profile and the model's predictor statistics, print the chosen settings and the predicted "
                       "decode-token latency with its parts, and save the plan as plan.json in the model "
                       "directory (used by `--plan auto` on generate, serve and chat).")
    add_model_dir(q)
    q.add_argument("--dram-budget", type=_budget, required=True, metavar="BUDGET",
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
    q.set_defaults(func=cmd_plan)


def cmd_profile(args) -> None:
    from flashllm.planner import profile

    log = _log(args.json)
    disk = _disk(args.path, args.refresh, log)
    aio = _disk(args.path, args.refresh, log, "aio")  # what sparse mode's reads go through where AIO works
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


def plan_for(model_dir, budget, dtypes=None, context=None, data=None, sample_tokens=None, max_dropped=None,
             refresh: bool = False, log=None, calibrate_tokens: int | None = None):
    """A plan for `model_dir` at `budget` (profiles measured when missing), saved into the directory."""
    from flashllm.format import manifest as fmt
    from flashllm.planner import solver as planner
    from flashllm.planner import profile

    fmt.read_manifest(model_dir, verify=False)  # not a model directory: say so before minutes of profiling
    if not 0 <= (max_dropped or 0) < 1:
        raise FlashLLMError(f"--max-dropped {max_dropped}: must be in [0, 1)")
    if calibrate_tokens is not None and calibrate_tokens < 0:
        raise FlashLLMError(f"--calibrate-tokens {calibrate_tokens}: must be 0 or more")
    log = log or (lambda msg: None)
    disks = _disks(model_dir, refresh, log)
    disks("preadv")
    machine = profile.profile(refresh=refresh, progress=log)
    plan = planner.make_plan(model_dir, budget, machine, disks, data=data, dtypes=dtypes, context=context,
                             sample_tokens=sample_tokens or planner.SAMPLE_TOKENS,
                             max_dropped=max_dropped or 0.0, log=log,
                             calibrate_tokens=planner.CALIBRATE_TOKENS if calibrate_tokens is None else calibrate_tokens)
    planner.save_plan(model_dir, plan)
    return plan


def cmd_plan(args) -> None:
    plan = plan_for(args.model_dir, args.dram_budget, _dtypes(args.dtypes), args.context, args.data,
                    args.sample_tokens, args.max_dropped, args.refresh, _log(args.quiet or args.json),
                    args.calibrate_tokens)
    print(json.dumps(plan.to_dict()) if args.json else plan.describe())


def auto_options(model_dir, options):
    """`--plan auto`: the saved plan when it was made for this model, predictors, machine, budget and
    context, or for a larger context (what it holds fits: the KV cache only shrinks, and a line says so);
    else a new one (saved; where the saved plan differs only in its context, a line says that too).
    Returns `options` with the plan's settings."""
    from flashllm.format import manifest as fmt
    from flashllm.planner import solver as planner
    from flashllm.planner import profile

    log = _log(False)
    saved = planner.saved_plan(model_dir)
    if saved is not None:
        try:
            manifest = fmt.read_manifest(model_dir, verify=False)
            machine = profile.profile()
            disk = _disk(model_dir, False, None)
            context = min(options.context or 4096, manifest.spec.context_limit)
            key = planner._key(manifest, machine, disk, options.dram_budget, context)
            if saved.key == key:
                return options.replace(**saved.load_options())
            made_for, path = saved.key.get("context"), Path(model_dir) / planner.PLAN_FILE
            if isinstance(made_for, int) and saved.key == {**key, "context": made_for}:  # only the context differs
                if context < made_for:
                    log(f"--plan auto: using {path}, made for --context {made_for}, at --context {context} (a "
                        f"smaller KV cache: it still fits its budget)")
                    return options.replace(**saved.load_options())
                log(f"--plan auto: {path} was made for --context {made_for}, not {context} (too little room for "
                    f"this KV cache): planning again for --context {context}, which replaces it (`flashllm plan "
                    f"{model_dir} --context {context}` with your other plan options to choose them)")
        except FlashLLMError:
            pass
    try:
        plan = plan_for(model_dir, options.dram_budget, [options.dtype] if options.dtype else None, options.context,
                        log=log)
    except planner.NothingFits as exc:  # its advice names `flashllm plan`'s options: say how to use them here
        raise FlashLLMError(f"--plan auto: {exc}. `flashllm plan {model_dir}` with the same --dram-budget takes "
                            f"those options and saves a plan that --plan auto then uses; or pass --dtype or a "
                            f"smaller --context here") from None
    log(plan.describe().splitlines()[0] + f" (saved in {model_dir}/{planner.PLAN_FILE})")
    return options.replace(**plan.load_options())
