"""Regenerate bench/results/paper/tables.md, its JSON and the plots with one command.

1. held-out text: bench/models/stdlib_corpus.py --split heldout (files never seen in training);
2. activation trace: bench/models/activation_trace.py record on the embedded model flashllm/data/tiny-opt (converted
   to a work directory, with the trained predictors of flashllm/data/tiny-opt-predictors when
   present: the trace says which predictor it used);
3. the 7B-shaped random model (bench/models/make_model.py --shape opt-6.7b, float16, seed 0) and its
   unbundled copy (same seed, --no-bundle) in the work directory;
4. bench/paper/tables.py on it at a 50% DRAM budget, in a cgroup memory limit where possible,
   writing the report, the JSON and the PNGs into bench/results/paper/;
5. the model files are deleted afterwards (unless --keep-models).

    python -m bench paper all [--work-dir DIR] [--shape opt-6.7b] [--tokens 32]

Takes about an hour on a 2-core machine with a ~0.8 GiB/s disk (naive alone is ~17 s per token).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from bench.harness import RESULTS, ROOT, cache_dir, command_line

DATA = ROOT / "flashllm" / "data"


def sh(argv: list[str]) -> None:
    print("+", " ".join(shlex.quote(str(a)) for a in argv), file=sys.stderr, flush=True)
    subprocess.run([str(a) for a in argv], check=True, cwd=ROOT)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=str(cache_dir("paper")), help="models, trace and text go here (default: %(default)s)")
    p.add_argument("--results", default=str(RESULTS / "paper"), help="where the report is written")
    p.add_argument("--name", default="tables", help="report file stem: NAME.md, NAME.json (plots: "
                   "*.png for the default name, else NAME_*.png)")
    p.add_argument("--predictor", choices=["auto", "lowrank", "oracle"], default="auto",
                   help="for the trace: auto = the embedded predictors if trained on this model, else oracle")
    p.add_argument("--shape", default="opt-6.7b")
    p.add_argument("--dtype", default="float16", help="storage dtype of the random model")
    p.add_argument("--dram-budget", default="0.5")
    p.add_argument("--tokens", default="32", help="measured decode tokens per sparse run")
    p.add_argument("--warmup", default="8")
    p.add_argument("--naive-tokens", default="3")
    p.add_argument("--hybrid-tokens", default="4")
    p.add_argument("--fig7-tokens", default="16")
    p.add_argument("--fig8-tokens", default="1000")
    p.add_argument("--trace-tokens", default="2048")
    p.add_argument("--torch-threads", default=None)
    p.add_argument("--retrace", action="store_true", help="record the trace again even if the work dir has one")
    p.add_argument("--keep-models", action="store_true", help="keep the 7B-shaped model files afterwards")
    p.add_argument("--no-cgroup", action="store_true")
    p.add_argument("--extra", default="", help="more paper_tables.py arguments (one string)")
    return p


def main(argv=None) -> None:
    args = setup_arg_parser().parse_args(argv)
    # Idle OpenMP threads sleep instead of spinning: on 2 cores a spinning torch thread starves the I/O threads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    work, results = Path(args.work_dir), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    heldout = work / "heldout.txt"
    if not heldout.is_file():
        sh([py, "-m", "bench.models.stdlib_corpus", "--split", "heldout", "--out", heldout, "--max-bytes", "4000000"])
    trace = work / f"trace-{args.predictor}.npz"
    if args.retrace or not trace.is_file():
        if not (DATA / "tiny-opt" / "config.json").is_file():
            raise SystemExit(f"{DATA / 'tiny-opt'}: the embedded model is missing (bench/models/train_dense.py)")
        cmd = [py, "-m", "bench.models.activation_trace", "record", DATA / "tiny-opt", "--data", heldout, "--out", trace,
               "--tokens", args.trace_tokens, "--predictor", args.predictor]
        if (DATA / "tiny-opt-predictors" / "predictors.json").is_file():
            cmd += ["--predictors", DATA / "tiny-opt-predictors"]
        sh(cmd)
    sh([py, "-m", "bench.models.activation_trace", "info", trace, "--json"])
    model, unbundled = work / args.shape, work / f"{args.shape}-unbundled"
    created = []
    for out, extra in ((model, []), (unbundled, ["--no-bundle"])):
        if not (out / "flashllm.json").is_file():
            sh([py, "-m", "bench.models.make_model", "--shape", args.shape, "--dtype", args.dtype, "--out", out, *extra])
            created.append(out)
    this = command_line("bench.paper.run", argv)
    cmd = [py, "-m", "bench.paper.tables", model, "--dram-budget", args.dram_budget, "--tokens", args.tokens,
           "--warmup", args.warmup, "--naive-tokens", args.naive_tokens, "--hybrid-tokens", args.hybrid_tokens,
           "--fig7-tokens", args.fig7_tokens, "--fig8-tokens", args.fig8_tokens, "--trace", trace,
           "--unbundled-dir", unbundled, "--plot", results, "--markdown", results / f"{args.name}.md",
           "--plot-prefix", "" if args.name == "tables" else f"{args.name}_",
           "--json-out", results / f"{args.name}.json", "--isolate", "--profile"]
    if not args.no_cgroup:
        cmd.append("--cgroup")
    if args.torch_threads:
        cmd += ["--torch-threads", args.torch_threads]
    cmd += shlex.split(args.extra)
    inner = " ".join(shlex.quote(str(a)) for a in ["python", *cmd[1:]])
    cmd += ["--command", f"{this}   [which ran: {inner}]"]
    try:
        sh(cmd)
    finally:
        if not args.keep_models:
            for d in (model, unbundled):
                shutil.rmtree(d, ignore_errors=True)
    summary = json.loads((results / f"{args.name}.json").read_text())
    print(json.dumps({"table3": summary["table3"], "ratios": summary["ratios"], "targets": summary["targets"]},
                     indent=1))


if __name__ == "__main__":
    main()
