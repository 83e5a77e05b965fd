"""Plans made for the CLI and `--plan auto`: measure what is missing, solve, save plan.json; or reuse the
saved plan when it was made for this model, machine, budget and context (flashllm.planner.solver does the solving)."""

from __future__ import annotations

import warnings
from pathlib import Path

from flashllm.errors import FlashLLMError


def disk(model_dir, refresh: bool, log, engine: str = "preadv"):
    """The profile of the model's disk read with `engine` (reader threads, or native AIO as sparse reads)."""
    from flashllm.io import disk_profile

    p = disk_profile.profile(model_dir, refresh=refresh, progress=log, engine=engine)
    if p.call_us is None:  # cached before engine calls were costed (the cost model needs them): measure again
        p = disk_profile.profile(model_dir, refresh=True, progress=log, engine=engine)
    return p


def disks(model_dir, refresh: bool, log):
    """engine -> the disk profile measured with it, each measured (or read from the cache) once when asked."""
    got = {}

    def disk_for(engine: str):
        if engine not in got:
            got[engine] = disk(model_dir, refresh, log, engine)
        return got[engine]
    return disk_for


def plan_for(model_dir, budget, dtypes=None, context=None, data=None, sample_tokens=None, max_dropped=None,
             refresh: bool = False, log=None, calibrate_tokens: int | None = None):
    """A plan for `model_dir` at `budget` (profiles measured when missing), saved into the directory where it
    can be written."""
    from flashllm.format import manifest as fmt
    from flashllm.planner import solver as planner
    from flashllm.planner import profile

    fmt.read_manifest(model_dir, verify=False)  # not a model directory: say so before minutes of profiling
    if not 0 <= (max_dropped or 0) < 1:
        raise FlashLLMError(f"--max-dropped {max_dropped}: must be in [0, 1)")
    if calibrate_tokens is not None and calibrate_tokens < 0:
        raise FlashLLMError(f"--calibrate-tokens {calibrate_tokens}: must be 0 or more")
    log = log or (lambda msg: None)
    disk_for = disks(model_dir, refresh, log)
    disk_for("preadv")
    machine = profile.profile(refresh=refresh, progress=log)
    plan = planner.make_plan(model_dir, budget, machine, disk_for, data=data, dtypes=dtypes, context=context,
                             sample_tokens=sample_tokens or planner.SAMPLE_TOKENS,
                             max_dropped=max_dropped or 0.0, log=log,
                             calibrate_tokens=planner.CALIBRATE_TOKENS if calibrate_tokens is None else calibrate_tokens)
    try:
        planner.save_plan(model_dir, plan)
    except OSError as exc:  # a read-only model directory: the plan is still printed and used
        warnings.warn(f"{model_dir}: {planner.PLAN_FILE} not saved ({exc.strerror or exc}); `--plan auto` plans "
                      f"again on each load", RuntimeWarning, stacklevel=2)
    return plan


def auto_options(model_dir, options, log=None):
    """`--plan auto`: the saved plan when it was made for this model, predictors, machine, budget and
    context, or for a larger context (what it holds fits: the KV cache only shrinks, and a line says so);
    else a new one (saved; where the saved plan differs only in its context, a line says that too).
    Returns `options` with the plan's settings."""
    from flashllm.format import manifest as fmt
    from flashllm.planner import solver as planner
    from flashllm.planner import profile

    log = log or (lambda msg: None)
    saved = planner.saved_plan(model_dir)
    if saved is not None:
        try:
            manifest = fmt.read_manifest(model_dir, verify=False)
            machine = profile.profile()
            disk_now = disk(model_dir, False, None)
            context = min(options.context or 4096, manifest.spec.context_limit)
            key = planner._key(manifest, machine, disk_now, options.dram_budget, context)
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
    kept = (Path(model_dir) / planner.PLAN_FILE).is_file()
    log(plan.describe().splitlines()[0] + (f" (saved in {model_dir}/{planner.PLAN_FILE})" if kept else ""))
    return options.replace(**plan.load_options())
