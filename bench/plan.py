"""`flashllm plan` checked: predicted vs measured decode-token latency, and the plan vs the hand defaults.

In one run: the machine and the model's disk are profiled afresh; then for each model and budget the
plan is made, and the planned settings and the hand defaults (sparse, window 4, default dtype and
threads, same budget) decode the same held-out tokens in interleaved rounds. Measured = the typical decode
token of all rounds pooled (calibration.typical: the mean over tokens whose latency lies in the interquartile
range, the planner's own estimator; two warm-up tokens per round not counted); noise = half that range over
the median.

Models: the embedded model (converted into a temporary directory, its shipped predictors) and, with
--opt13 DIR, an OPT-1.3B-shaped model written by `bench/models/make_model.py --shape opt-1.3b` (random weights;
random rank-16 predictors selecting about 16% of the neurons per token are written into it, since random
weights have nothing to learn: the check is of the cost model, not of quality).

    python -m bench plan [--opt13 DIR] [--tokens 16] [--rounds 3] [--out bench/results/plan/check]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import flashllm
from flashllm.planner import calibration
from flashllm.cli import demo
from flashllm.io import disk_profile
from flashllm.planner import solver as planner
from flashllm.planner import profile
from flashllm.format import manifest as fmt

from bench.models import stdlib_corpus
from bench.harness import command_line

PARTS = ("total_ms", "compute_ms", "predictor_ms", "io_ms", "mem_ms")


def random_predictors(model_dir: Path, rank: int = 16, bias: float = -4.0, seed: int = 0) -> None:
    """Rank-`rank` predictors with N(0,1) weights: logits ~ N(bias, rank), so about 16% predicted at bias -4."""
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_FORMAT, PREDICTOR_META, PREDICTOR_VERSION
    from flashllm.format.safetensors_io import write_safetensors

    spec = fmt.read_manifest(model_dir, verify=False).spec
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(spec.n_layers):
        tensors[f"layers.{i}.A"] = (rng.standard_normal((rank, spec.d_model)) / spec.d_model ** 0.5).astype(np.float32)
        tensors[f"layers.{i}.B"] = rng.standard_normal((spec.d_ffn, rank)).astype(np.float32)
        tensors[f"layers.{i}.b"] = np.full(spec.d_ffn, bias, np.float32)
    write_safetensors(str(model_dir / PREDICTOR_FILE), [(n, t.dtype, t.shape) for n, t in tensors.items()],
                      tensors.__getitem__)
    meta = {"format": PREDICTOR_FORMAT, "format_version": PREDICTOR_VERSION, "created_by": "bench/plan.py",
            "layers": [{"rank": rank, "threshold": 0.5} for _ in range(spec.n_layers)]}
    (model_dir / PREDICTOR_META).write_text(json.dumps(meta))


def token_ids(model_dir: Path, n: int, text: str) -> list[int]:
    m = fmt.read_manifest(model_dir, verify=False)
    if m.has("tokenizer.json"):
        from flashllm.text.tokenizer import Tokenizer

        return Tokenizer(model_dir, m.spec.bos_token_id).encode(text)[:n]
    return [int(i) for i in np.random.default_rng(1).integers(3, m.spec.vocab_size, n)]


def decode_stats(model, rounds_rows: list[dict]) -> dict:
    """The typical decode token over every round (calibration.typical: the planner's own estimator)."""
    m = calibration.typical(rounds_rows)
    return {**{k: getattr(m, k) for k in PARTS + ("bytes_read", "reads", "spread")},
            "neurons_dropped": float(np.mean([r["neurons_dropped"] for r in rounds_rows]))}


def check(model_dir: Path, budget, machine, disk, ids, prefill: int, rounds: int, context: int, data,
          dtype: str | None, max_dropped: float, sample_tokens: int, min_seconds: float) -> dict:
    load_before = os.getloadavg()[:1]
    t0 = time.perf_counter()
    plan = planner.make_plan(model_dir, budget, machine, disk, data=data, context=context,
                             dtypes=[dtype] if dtype else None, max_dropped=max_dropped, sample_tokens=sample_tokens)
    plan_s = time.perf_counter() - t0
    hand_opts = {"mode": "sparse", "dram_budget": budget, "window": 4, "dtype": dtype}
    models = {"plan": flashllm.load(model_dir, context=context, **plan.load_options()),
              "hand": flashllm.load(model_dir, context=context, **hand_opts)}
    models_caps = models["hand"].stats.get("cache_capacity")
    same = plan.mode == "sparse" and plan.window == 4 and plan.cache_rows == models_caps and \
        plan.predictor == models["hand"].stats.get("predictor") and \
        models["plan"].backend.dtype_name == models["hand"].backend.dtype_name
    if same:  # the plan is the hand defaults: one configuration, measured once (plan / hand is 1 by identity)
        del models["hand"]
    runs = {k: [] for k in models}
    for r in range(rounds):
        for name, m in models.items():  # the first round warms each model up as the planner's calibration does
            runs[name] += calibration.token_costs(m, ids, prefill, planner.CALIBRATE_WARMUP, min_seconds,
                                                  planner.CALIBRATE_WARM_PASSES if r == 0 else 0)
    med = {name: decode_stats(models[name], rs) for name, rs in runs.items()}
    med.setdefault("hand", med["plan"])
    spread = {name: [round(r["total_ms"], 1) for r in rs] for name, rs in runs.items()}
    del models
    pred, meas = plan.predicted, med["plan"]
    hand_pred = next((a for a in plan.alternatives if "runtime default" in a["what"]), None)
    if hand_pred is None and same:
        hand_pred = pred
    model_ms = pred.get("model_ms", pred["total_ms"])
    return {"model": model_dir.name, "budget": budget, "plan": {k: v for k, v in plan.to_dict().items()
                                                               if k in ("mode", "dtype", "window", "cache_rows",
                                                                        "hybrid_fraction")},
            "load": [round(x, 1) for x in load_before + os.getloadavg()[:1]], "notes": plan.notes, "plan_is_hand": same,
            "model_ms": model_ms, "model_error": meas["total_ms"] / model_ms - 1,
            "plan_seconds": round(plan_s, 1), "predicted": pred, "measured": meas, "hand": med["hand"],
            "rounds_total_ms": spread, "error": meas["total_ms"] / pred["total_ms"] - 1,
            "plan_over_hand": meas["total_ms"] / med["hand"]["total_ms"], "alternatives": plan.alternatives,
            "hand_predicted": hand_pred,
            "hand_error": None if hand_pred is None else med["hand"]["total_ms"] / hand_pred["total_ms"] - 1,
            # the plan's latency relative to the hand defaults measured in the same rounds, against the predicted
            # ratio: the machine's load drifting between the calibration and the check cancels out
            "ratio_error": None if hand_pred is None else
            (meas["total_ms"] / med["hand"]["total_ms"]) / (pred["total_ms"] / hand_pred["total_ms"]) - 1}


def table(results: list[dict], header: str) -> str:
    lines = [header, "", f"{'model':<10}{'budget':>8}  {'plan':<30}{'model ms':>9}{'error':>8}{'pred ms':>9}"
             f"{'meas ms':>9}{'noise':>7}{'error':>8}"
             f"{'hand ms':>9}{'(pred)':>8}{'h.error':>8}{'plan/hand':>10}{'ratio err':>10}{'dropped p/h':>13}{'KiB/tok p/m':>15}{'reads p/m':>13}"
             f"{'load':>11}   predicted / measured parts (compute, predictor, io, mem ms)"]
    for r in results:
        p = r["plan"]
        what = p["mode"] + (f" w{p['window']}" if p["mode"] == "sparse" else
                            f" {p['hybrid_fraction']:.2f}" if p["mode"] == "hybrid" else "") + f" {p['dtype']}" + \
            (" (= hand)" if r["plan_is_hand"] else "")
        pr, me = r["predicted"], r["measured"]
        parts = " / ".join(", ".join(f"{x[k]:.1f}" for k in PARTS[1:]) for x in (pr, me))
        lines.append(f"{r['model']:<10}{str(r['budget']):>8}  {what:<30}{r['model_ms']:>9.1f}{r['model_error']:>+8.0%}"
                     f"{pr['total_ms']:>9.1f}{me['total_ms']:>9.1f}{me['spread']:>7.0%}"
                     f"{r['error']:>+8.0%}{r['hand']['total_ms']:>9.1f}"
                     f"{(r['hand_predicted'] or {}).get('total_ms', float('nan')):>8.1f}"
                     f"{r['hand_error'] if r['hand_error'] is not None else float('nan'):>+8.0%}"
                     f"{r['plan_over_hand']:>10.2f}"
                     f"{r['ratio_error'] if r['ratio_error'] is not None else float('nan'):>+10.0%}"
                     f"{me['neurons_dropped']:>7.0f}/{r['hand']['neurons_dropped']:<5.0f}"
                     f"{pr.get('bytes_per_token', 0) / 1024:>8.0f}/{me['bytes_read'] / 1024:<6.0f}"
                     f"{pr.get('reads_per_token', 0):>7.0f}/{me['reads']:<5.0f}{'-'.join(map(str, r['load'])):>11}"
                     f"   {parts}")
        lines += [f"    note: {n}" for n in r["notes"] if n.startswith(("kept", "calibrated"))]
        runs = [("profile-only", pr.get("model_parts")), ("calibration run", pr.get("calibration_run")), ("check", me)]
        lines.append("    parts (compute, predictor, io, mem ms; KiB, reads per token): " + "; ".join(
            f"{name} " + ", ".join(f"{x[k]:.1f}" for k in PARTS[1:]) +
            (f" ({x['bytes_read'] / 1024:.0f} KiB, {x['reads']:.0f})" if "reads" in x else "")
            for name, x in runs if x))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opt13", default=None, help="an OPT-1.3B-shaped model directory (bench/models/make_model.py)")
    p.add_argument("--opt13-budgets", default="1.4GiB,1.8GiB", help="its budgets (default 1.4GiB,1.8GiB)")
    p.add_argument("--no-embedded", action="store_true", help="skip the embedded model (one locked run per model)")
    p.add_argument("--tokens", type=int, default=16, help="decode tokens per round (default 16)")
    p.add_argument("--prefill", type=int, default=4, help="prompt tokens (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="each round decodes its tokens again until this long, per configuration (default 1.0; the "
                   "planner calibrates for planner.CALIBRATE_SECONDS)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--max-dropped", type=float, default=0.05,
                   help="share of predicted neurons the plan may drop (the hand defaults drop at small budgets; "
                   "both are reported) (default 0.05)")
    p.add_argument("--sample-tokens", type=int, default=256, help="tokens the plan replays (default 256)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="flashllm-plancheck-") as tmp:
        tmp = Path(tmp)
        sample = tmp / "sample.txt"
        stdlib_corpus.write_text("train", sample, max_bytes=64_000)
        text = "\n\n".join(t for _, (_, t) in zip(range(3), stdlib_corpus.texts("heldout")))
        # the demo's settings for the embedded model (bfloat16 compute, context 256)
        targets = [] if args.no_embedded else [(demo.prepare(tmp / "tiny-opt"), (0.5, 0.7), 256, "bfloat16")]
        if args.opt13:
            d = Path(args.opt13)
            random_predictors(d)
            targets.append((d, tuple(args.opt13_budgets.split(",")), 256, None))
        # fresh, in this run: the disks first (a small model's is profiled on a 1 GiB scratch file the VM's host
        # then writes back for a while), then the machine's compute and memory (some seconds), then the checks
        disks = [{e: disk_profile.profile(t[0], refresh=True, engine=e) for e in ("preadv", "aio")}.__getitem__
                 for t in targets]  # engine -> profile (sparse reads go through AIO where it works)
        machine = profile.measure()
        profile.save(machine)
        for (model_dir, budgets, context, dtype), disk in zip(targets, disks):
            ids = token_ids(model_dir, args.prefill + args.tokens, text)
            for budget in budgets:
                r = check(model_dir, budget, machine, disk, ids, args.prefill, args.rounds, context, sample, dtype,
                          args.max_dropped, args.sample_tokens, args.min_seconds)
                print(json.dumps({k: r[k] for k in ("model", "budget", "plan", "error", "plan_over_hand")}),
                      file=sys.stderr, flush=True)
                results.append(r)
    command = command_line("bench.plan", argv)
    text = table(results, f"{command}\nmachine: {machine.host}, torch threads {machine.torch_threads}; "
                          f"{args.rounds} interleaved rounds of {args.tokens} decode tokens (repeated for {args.min_seconds:g} s), typical token "
                          f"(interquartile mean); load = load average before/after each check (2 cores)")
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"command": command, "machine": machine.to_dict(),
                                                        "results": results}, indent=1) + "\n")
        Path(args.out + ".md").write_text(f"```\n{text}\n```\n")
    return results


if __name__ == "__main__":
    main()
