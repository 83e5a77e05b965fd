"""Mixture-of-experts streaming at a memory limit: tokens/s, bytes/token, expert-cache and prefetch hit rates.

Writes an MoE model with bench/models/make_model.py (random weights; --layers cuts the shape's layer
count, --quantize stores the experts int8/int4) unless --model-dir is given, then decodes in sparse
mode at --budget of the model's size, once per expert-cache policy and once with prefetch, for each
routing: `model` (the model's own router: random on random weights), `uniform` (k experts drawn
uniformly per token and layer) or `replay:TRACE.npz` (the trained small MoE's recorded routing,
mapped onto this model by bench/models/routing_trace.py's ReplayRouting; the method is in its docstring).
Routing is given through `flashllm.load(..., expert_routing=...)`; nothing is patched. Each run is
a child process inside a cgroup v1 memory group limited to the budget plus the measured
interpreter/torch baseline and --cgroup-slack (page cache is charged to the group, so it cannot
hold the model). Model files are dropped from the page cache before each run. The model this
script wrote is removed at the end (--keep keeps it).

    python -m bench moe run --shape qwen3-30b-a3b --layers 20 --quantize int4 --work moe-work \\
        --budget 0.25 --routing replay:bench/results/models/tiny_moe_routing.npz,uniform [--json] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flashllm.format import manifest as fmt
from bench import harness
from bench.harness import GB, ROOT, command_line, MemoryGroup, MiB, module_argv
from bench.models import make_model as mm
from bench.models import routing_trace

# idle OpenMP threads of the runs sleep instead of spinning: on a loaded 2-core machine a spinning pool
# made one float16 768x2048 mat-vec take 17 ms instead of 0.3 ms (measured; bench/paper/run.py does the same)
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def uniform_routing(n_experts: int, top_k: int, seed: int):
    """An `expert_routing` that draws k distinct experts uniformly per token and layer (guesses too)."""
    rng = np.random.default_rng(seed)
    return lambda layer, logits, early: np.stack([rng.choice(n_experts, top_k, replace=False) for _ in logits])


def routing_for(run: dict):
    """The run's `expert_routing`: None (the model's router), uniform, or a replayed trace."""
    manifest = fmt.read_manifest(run["model_dir"], verify=False)
    s = manifest.spec
    if run["routing"] == "uniform":
        return uniform_routing(s.n_experts, s.top_k, run["seed"] + 1)
    if run["routing"].startswith("replay:"):
        trace = routing_trace.load(Path(run["routing"].split(":", 1)[1]))
        return routing_trace.ReplayRouting(trace, s.n_layers, s.n_experts, s.top_k, run["seed"])
    if run["routing"] != "model":
        raise SystemExit(f"--routing {run['routing']!r}: expected model, uniform or replay:TRACE.npz")
    return None


def run_one(run: dict) -> dict:
    """One measured run in this process: load, prefill, decode; the stats that matter here."""
    import torch

    import flashllm

    torch.set_num_threads(run["torch_threads"])
    t0 = time.perf_counter()
    model = flashllm.load(run["model_dir"], mode="sparse", dram_budget=run["budget_bytes"], dtype=run["dtype"],
                          expert_policy=run["policy"], expert_read_ahead=run["prefetch"], window=run["window"],
                          threads=run["threads"], context=run["prompt"] + run["tokens"], kernels=run["kernels"],
                          compute_threads=run["torch_threads"],  # as asked, whatever the load
                          quantize_resident=run.get("quantize_resident", "none"), expert_routing=routing_for(run))
    load_s = time.perf_counter() - t0
    from flashllm.stats import PartTimer

    ids = np.random.default_rng(run["seed"]).integers(3, model.spec.vocab_size, run["prompt"] + run["tokens"]).tolist()
    timer = PartTimer(model.backend.sync)
    model._costs = []  # as model.logits(ids, prefill=prompt) does, with the compute parts timed on decode tokens
    model.forward(ids[:run["prompt"]], 0)
    model.backend.parts = timer
    cpu0 = time.process_time()  # this process's CPU time: on a shared machine wall time also counts waiting for a core
    for i, t in enumerate(ids[run["prompt"]:]):
        model.forward([t], run["prompt"] + i)
    cpu_ms = (time.process_time() - cpu0) * 1e3 / run["tokens"]
    model.backend.parts = None
    st = model.stats
    parts = {k: v / run["tokens"] for k, v in timer.ms.items()}
    keys = ("total_ms", "io_ms", "mem_ms", "compute_ms", "predictor_ms", "bytes_read", "reads", "expert_hits",
            "expert_misses", "expert_hit_rate", "expert_read_ahead_recall", "experts_read_ahead", "experts_read_ahead_unused",
            "dram_bytes", "cache_capacity", "tokens_per_s", "expert_slots")
    return {**{k: st.get(k) for k in keys}, "prompt": st["prompt"], "load_s": load_s, "label": run["label"],
            "parts_ms": parts, "cpu_ms": cpu_ms}


def child(run: dict, group) -> dict:
    with tempfile.TemporaryDirectory(prefix="flashllm-moe-bench-") as tmp:
        spec, res = Path(tmp) / "run.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(run))
        argv = module_argv("bench.moe.run", "--run-one", spec, "--result", res)
        if group is not None:
            group.reset_peak()
            argv = group.command(argv)
        rc = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, OMP_WAIT_POLICY=OMP_WAIT_POLICY)).returncode
        usage = group.usage() if group is not None else None
        if rc != 0 or not res.is_file():
            return {"label": run["label"], "error": f"exit status {rc}", "cgroup_usage": usage}
        return {**json.loads(res.read_text()), "cgroup_usage": usage}


def markdown(report: dict) -> str:
    lines = [f"# MoE streaming: {report['model']}", "", f"Command: `{report['command']}`", "",
             f"- model: {report['model_bytes'] / GB:.2f} GB on flash ({report['dtype']}); budget "
             f"{report['budget']:.0%} = {report['budget_bytes'] / GB:.2f} GB; expert slots per layer "
             f"{report['slots']} of {report['n_experts']} (top-{report['top_k']}), {report['expert_slots']}",
             f"- memory limit: {report['memory_limit']}",
             f"- routing: {report['routing']}",
             f"- tokens: {report['prompt']}-token prompt, then {report['tokens']} decode tokens averaged; "
             f"load average at start {report['load_average']:.1f}; OMP_WAIT_POLICY={report['omp_wait_policy']}; "
             f"torch threads {report['torch_threads']}; "
             f"code {report['code']}", "",
             "| run | ms/token | CPU ms/token | tokens/s | GB read/token | io ms | mem ms | compute ms (experts, attention, head) | "
             "expert hit rate | prefetch recall | prefetched/token (wasted) | peak cgroup GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} |" + "  |" * 10)
            continue
        pre = "" if r.get("expert_read_ahead_recall") is None else f"{r['expert_read_ahead_recall']:.3f}"
        pf = "" if r.get("experts_read_ahead") is None else f"{r['experts_read_ahead']:.1f} ({r['experts_read_ahead_unused']:.1f})"
        peak = (r.get("cgroup_usage") or {}).get("peak_bytes")
        parts = r.get("parts_ms") or {}
        split = f" ({parts['ffn']:.0f}, {parts['attn_proj'] + parts['attention']:.0f}, {parts['logits']:.0f})" if parts else ""
        cpu = "" if r.get("cpu_ms") is None else f"{r['cpu_ms']:.0f}"
        lines.append(f"| {r['label']} | {r['total_ms']:.0f} | {cpu} | {r['tokens_per_s']:.2f} | {r['bytes_read'] / GB:.3f} | "
                     f"{r['io_ms']:.0f} | {r['mem_ms']:.0f} | {r['compute_ms']:.0f}{split} | {r['expert_hit_rate']:.3f} | "
                     f"{pre} | {pf} | "
                     f"{'' if peak is None else f'{peak / GB:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b-4l", help="bench/models/make_model.py shape (default: %(default)s)")
    p.add_argument("--model-dir", help="an existing MoE model directory instead of writing one")
    p.add_argument("--layers", type=int, help="cut the shape to this many layers (default: the shape's)")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="store the experts quantized (default: %(default)s)")
    p.add_argument("--work", default=None, help="where to write the model (default: a temporary directory)")
    p.add_argument("--budget", type=float, default=0.25, help="DRAM budget, fraction of the model (default: %(default)s)")
    p.add_argument("--dtype", default="float16", help="storage and compute dtype (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=4, help="prompt tokens (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=24, help="decode tokens averaged (default: %(default)s)")
    p.add_argument("--window", type=int, default=4, help="window of the lfu/window policies (default: %(default)s)")
    p.add_argument("--threads", type=int, default=32, help="flash reads in flight (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch compute threads (default: %(default)s; on this loaded 2-core machine a second "
                   "thread made an int4 expert 50x slower, bench/results/moe/expert_kernels.md)")
    p.add_argument("--policies", default="lru,lfu,window", help="expert-cache policies (default: %(default)s)")
    p.add_argument("--routing", default="model,uniform",
                   help="model: the model's own router; uniform: k experts drawn uniformly per token and layer, "
                   "the worst case for a cache; replay:TRACE.npz: a recorded trace (bench/models/routing_trace.py) "
                   "(default: %(default)s)")
    p.add_argument("--kernels", default="tuned",
                   help="comma list: tuned (int4 experts in torch's int4 kernel layout), plain (dequantized; the "
                   "reference) (default: %(default)s)")
    p.add_argument("--quantize-resident", default="none", choices=["none", "int8", "int4"],
                   help="hold attention, embedding and lm_head quantized (flashllm.load's quantize_resident) "
                   "(default: %(default)s)")
    p.add_argument("--no-prefetch-run", action="store_true", help="skip the lru + prefetch run of each routing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cgroup", action="store_true", help="no memory group (the budget is then only accounting)")
    p.add_argument("--cgroup-slack", type=int, default=512, help="MiB above budget + baseline (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the model this script wrote")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", help="also write the markdown report here")
    p.add_argument("--run-one", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_one:
        Path(args.result).write_text(json.dumps(run_one(json.loads(Path(args.run_one).read_text()))))
        return {}

    log = (lambda m: print(m, file=sys.stderr, flush=True))
    wrote, made_work, group = None, None, None
    try:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            made_work = None if args.work else Path(tempfile.mkdtemp(prefix="flashllm-moe-"))
            work = Path(args.work) if args.work else made_work
            model_dir = work / args.shape
            if model_dir.exists():
                log(f"{model_dir}: exists, reused (not removed at the end)")
            else:
                t0 = time.perf_counter()
                spec = mm.spec_for(args.shape)
                if args.layers:
                    spec = dataclasses.replace(spec, n_layers=args.layers)
                wrote = mm.write_model(spec, model_dir, args.dtype, args.seed, shape_name=args.shape,
                                       quantize=args.quantize)
                log(f"wrote {model_dir} in {time.perf_counter() - t0:.0f} s")
        manifest = fmt.read_manifest(model_dir, verify=False)
        spec = manifest.spec
        if not spec.is_moe:
            raise SystemExit(f"{model_dir}: not a mixture-of-experts model")
        model_bytes = sum(e["size"] for k, e in manifest.data["files"].items() if k in ("resident", "ffn"))
        budget_bytes = int(args.budget * model_bytes)
        memory_limit = "none (--no-cgroup): the budget is the runtime's own accounting"
        if not args.no_cgroup:
            why = MemoryGroup.available()
            if why:
                memory_limit = f"not active: {why}"
            else:
                base = harness.baseline_rss()
                group = MemoryGroup(budget_bytes + base + args.cgroup_slack * MiB)
                memory_limit = (f"cgroup v1 memory.limit_in_bytes {group.limit / GB:.2f} GB = budget "
                                f"{budget_bytes / GB:.2f} GB + interpreter/torch baseline RSS {base / GB:.2f} GB "
                                f"(measured) + {args.cgroup_slack} MiB slack")
        log(f"memory limit: {memory_limit}")
        base_run = dict(model_dir=str(model_dir), budget_bytes=budget_bytes, dtype=args.dtype, window=args.window,
                        threads=args.threads, torch_threads=args.torch_threads, seed=args.seed, prompt=args.prompt,
                        tokens=args.tokens, quantize_resident=args.quantize_resident)
        runs = []
        for kernels in args.kernels.split(","):
            tag = "" if kernels == "tuned" else f" [{kernels} kernels]"
            for routing in args.routing.split(","):
                name = routing.split(":", 1)[0]
                runs += [dict(base_run, routing=routing, policy=pol, prefetch=False, kernels=kernels,
                              label=f"{name}: {pol}{tag}") for pol in args.policies.split(",")]
                if not args.no_prefetch_run:
                    runs.append(dict(base_run, routing=routing, policy="lru", prefetch=True, kernels=kernels,
                                     label=f"{name}: lru + prefetch{tag}"))
        results = []
        for run in runs:
            harness.drop_page_cache(harness.model_files(model_dir))
            log(f"run {run['label']} ...")
            results.append(child(run, group))
            log(f"  {json.dumps({k: results[-1].get(k) for k in ('total_ms', 'bytes_read', 'expert_hit_rate', 'error')})}")
        slots = next((r["cache_capacity"][0] for r in results if r.get("cache_capacity")), None)
        routings = {"model": "`model`: the model's own router (random weights, random token ids: random routing)",
                    "uniform": "`uniform`: top-k drawn uniformly at random per token and layer",
                    "replay": "`replay`: the trained small MoE's routing on held-out stdlib text "
                              f"({', '.join(r.split(':', 1)[1] for r in args.routing.split(',') if r.startswith('replay:'))}"
                              "), replayed by bench/models/routing_trace.py's ReplayRouting: layer j follows small layer j mod 4 "
                              "(trace shifted 131 tokens per block of 4 layers), each small expert becomes k/2 fixed "
                              "big experts (so 16 * k/2 of a layer's experts are ever routed to), prefetch guesses are "
                              "the small router's recorded guesses (its router on the previous layer's FFN input)"}
        report = {"model": f"{manifest.data['source'].get('path', model_dir)} ({spec.n_layers} layers)",
                  "model_bytes": model_bytes, "dtype": args.dtype + ("" if manifest.data.get("quantization", "none") ==
                                                                   "none" else f", experts {manifest.data['quantization']}"),
                  "budget": args.budget, "budget_bytes": budget_bytes, "slots": slots,
                  "expert_slots": next((r["expert_slots"] for r in results if r.get("expert_slots")), None),
                  "n_experts": spec.n_experts, "top_k": spec.top_k, "memory_limit": memory_limit,
                  "routing": "; ".join(routings[r.split(":", 1)[0]] for r in args.routing.split(",")),
                  "prompt": args.prompt, "tokens": args.tokens, "load_average": os.getloadavg()[0],
                  "omp_wait_policy": OMP_WAIT_POLICY, "torch_threads": args.torch_threads, "code": harness.code_version(),
                  "command": command_line("bench.moe.run", argv),
                  "runs": results}
    finally:
        if group is not None:
            group.remove()
        if wrote is not None and not args.keep:
            shutil.rmtree(wrote, ignore_errors=True)
            if made_work is not None:
                made_work.rmdir()  # the temporary directory this script made, now empty
    text = markdown(report)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps(report) if args.json else text)
    return report


if __name__ == "__main__":
    main()
