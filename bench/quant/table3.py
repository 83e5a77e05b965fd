"""The Table 3 analogue with quantized storage: float16 vs int4 bundles vs int4 bundles + int4 resident
matrices, side by side in one run, at the same DRAM budget fraction.

    python -m bench quant table3 [--shape opt-1.3b] [--work-dir DIR] [--out bench/results/quant/table3.md]

1. held-out text and an activation trace of the embedded model (as bench/paper/run.py makes them);
2. the random model of `--shape` twice (bench/models/make_model.py, same seed), one on disk at a time:
   float16 bundles, and int4 bundles (groups of 64; resident tensors float16 on flash in both);
3. bench/paper/tables.py on each (naive, hybrid and the sparse "all" row; each run in a child
   process inside a cgroup v1 memory limit, page cache evicted before each run), the third variant
   loading the int4 model with `--quantize-resident int4`;
4. one table: per variant and mode, flash bytes per token, I/O (`io_ms`: the reads), memory
   management (`mem_ms`: placing, casting, dequantizing rows), compute, predictor, total, DRAM;
5. the model files are deleted afterwards (unless --keep-models).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import GB, RESULTS, ROOT, cache_dir, code_version, command_line, load, machine_desc

DATA = ROOT / "flashllm" / "data"
# (label, FFN bundles, resident matrices); --variants picks by label
VARIANTS = [("float16", "none", "none"), ("int4 bundles", "int4", "none"),
            ("int4 bundles + int4 resident", "int4", "int4"), ("int8 bundles + int8 resident", "int8", "int8")]


def sh(argv: list) -> None:
    print("+", " ".join(map(str, argv)), file=sys.stderr, flush=True)
    subprocess.run([str(a) for a in argv], check=True, cwd=ROOT)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="opt-1.3b", help="bench/models/make_model.py shape (default: %(default)s)")
    p.add_argument("--work-dir", default=str(cache_dir("quant-table3")), help="models, trace and text (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "quant" / "table3.md"),
                   help="markdown report; JSON beside it (default: %(default)s)")
    p.add_argument("--dram-budget", default="0.5", help="fraction of each model's flash size (default: %(default)s)")
    p.add_argument("--tokens", default="32", help="measured sparse decode tokens (default: %(default)s)")
    p.add_argument("--warmup", default="8", help="sparse warm-up tokens (default: %(default)s)")
    p.add_argument("--naive-tokens", default="3", help="(default: %(default)s)")
    p.add_argument("--hybrid-tokens", default="4", help="(default: %(default)s)")
    p.add_argument("--torch-threads", default="2", help="(default: %(default)s)")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                   help="comma-separated labels (default: %(default)s)")
    p.add_argument("--only", default="naive,hybrid,all", help="paper_tables.py rows (default: %(default)s)")
    p.add_argument("--keep-models", action="store_true", help="keep the model files afterwards")
    p.add_argument("--float16-model", default=None, help="an existing float16 model of --shape (bench/models/make_model.py, "
                   "seed 0) to use read-only instead of writing one; the quantized variants hard-link its resident "
                   "file (default: write the models)")
    p.add_argument("--lock", default=None, help="run each timed run (one mode of one variant) under flock on this "
                   "file, modes interleaved across the variants (default: no lock, variant by variant)")
    return p


def trace_file(work: Path) -> Path:
    """The held-out text and the embedded model's activation trace (made once per work dir)."""
    py, heldout, trace = sys.executable, work / "heldout.txt", work / "trace-auto.npz"
    if not heldout.is_file():
        sh([py, "-m", "bench.models.stdlib_corpus", "--split", "heldout", "--out", heldout, "--max-bytes", "4000000"])
    if not trace.is_file():
        cmd = [py, "-m", "bench.models.activation_trace", "record", DATA / "tiny-opt", "--data", heldout, "--out", trace,
               "--tokens", "2048", "--predictor", "auto"]
        if (DATA / "tiny-opt-predictors" / "predictors.json").is_file():
            cmd += ["--predictors", DATA / "tiny-opt-predictors"]
        sh(cmd)
    return trace


def rows_of(report: dict, label: str, configs=("naive", "hybrid", "all")) -> list[dict]:
    runs, out = report["runs"], []
    for config in configs:
        r = runs.get(config)
        if r is None or "error" in r:
            out.append({"variant": label, "config": config, "error": (r or {}).get("error", "not run")})
            continue
        out.append({"variant": label, "config": config, "flash_gb_per_token": r["bytes_read"] / GB,
                    "io_ms": r["io_ms"], "read_ms": r["read_ms"], "mem_ms": r["mem_ms"],
                    "compute_ms": r["compute_ms"], "predictor_ms": r["predictor_ms"], "total_ms": r["total_ms"],
                    "dram_gb": r["dram_in_use"] / GB, "budget_gb": r["dram_budget"] / GB,
                    "model_gb": r["model_bytes"] / GB, "compute_dtype": r["compute_dtype"],
                    "neurons_dropped": r["neurons_dropped"], "tokens": r["decode_tokens"]})
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    L = [f"# Table 3 analogue with quantized storage ({meta['shape']} shape, random weights)", "",
         f"- command: `{meta['command']}`", f"- machine: {meta['machine']}", f"- code: {meta['code']}",
         f"- models: {meta['models']}", f"- DRAM budget: {meta['budget']} of each model's size on flash; "
         "cgroup v1 limit per run (see the per-variant JSON)", f"- active neurons: {meta['active']}",
         f"- tokens: {meta['tokens']}",
         "- load average (1 min) before / after each timed run: " + "; ".join(
             f"{k} {v[0]} / {v[1]}" for k, v in meta.get("load_average", {}).items()), "- units: GB = 10^9 bytes; ms per decode token. `I/O` is io_ms (the "
         "flash reads only); `memory mgmt` is mem_ms (placing rows: staging copy, cast to the compute dtype, "
         "int4 dequantization on insert, cache bookkeeping); compute is the rest of the token's time "
         "(attention, FFN, lm_head) minus the predictor", "",
         "| variant | mode | flash→DRAM (GB/token) | I/O (ms) | memory mgmt (ms) | compute (ms) | predictor (ms) | "
         "total (ms) | DRAM in use (GB) | budget (GB) | dropped neurons/token | tokens |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            L.append(f"| {r['variant']} | {r['config']} | error: {r['error']} |" + " |" * 9)
            continue
        L.append(f"| {r['variant']} | {r['config']} | {r['flash_gb_per_token']:.3f} | {r['io_ms']:,.0f} | "
                 f"{r['mem_ms']:,.1f} | {r['compute_ms']:,.0f} | {r['predictor_ms']:.1f} | {r['total_ms']:,.0f} | "
                 f"{r['dram_gb']:.2f} | {r['budget_gb']:.2f} | {r['neurons_dropped']:,.0f} | {r['tokens']} |")
    by = {(r["variant"], r["config"]): r for r in rows if "error" not in r}
    base = by.get(("float16", "all"))
    L.append("")
    for label, _, _ in VARIANTS[1:]:
        r = by.get((label, "all"))
        if base and r:
            L.append(f"- {label} vs float16, sparse \"all\": {base['total_ms'] / r['total_ms']:.2f}x end-to-end, "
                     f"flash bytes/token {r['flash_gb_per_token'] / base['flash_gb_per_token']:.3f} of float16's, "
                     f"memory management {r['mem_ms'] / r['total_ms']:.1%} of the token (float16: "
                     f"{base['mem_ms'] / base['total_ms']:.1%})")
    return "\n".join(L) + "\n"


def main(argv=None) -> None:
    args = setup_arg_parser().parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not starve the I/O threads
    work, out = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    py, trace = sys.executable, trace_file(work)
    rows, reports, loads, setting = [], {}, {}, machine_desc()
    chosen = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    modes = args.only.split(",")

    def run(label: str, d: Path, resident: str, only: list[str]) -> None:
        """paper_tables.py on model `d` for the modes `only` (under --lock), into reports[label][mode]."""
        js = work / f"{label.replace(' ', '_').replace('+', 'and')}-{'_'.join(only)}.json"
        lock = ["flock", args.lock] if args.lock else []
        loads[f"{label}, {','.join(only)}"] = [round(os.getloadavg()[0], 1)]
        sh([*lock, py, "-m", "bench.paper.tables", d, "--dram-budget", args.dram_budget, "--tokens", args.tokens,
            "--warmup", args.warmup, "--naive-tokens", args.naive_tokens, "--hybrid-tokens", args.hybrid_tokens,
            "--only", ",".join(only), "--fig8-tokens", "0", "--trace", trace, "--isolate", "--cgroup",
            "--torch-threads", args.torch_threads, "--quantize-resident", resident, "--json-out", js, "--quiet"])
        loads[f"{label}, {','.join(only)}"].append(round(os.getloadavg()[0], 1))
        report = json.loads(js.read_text())
        reports.setdefault(label, {}).update({m: report for m in only})

    if args.float16_model:  # every model on disk at once: one mode of every variant, then the next mode
        made = []
        try:
            dirs = {"none": Path(args.float16_model)}
            for q in dict.fromkeys(v[1] for v in chosen if v[1] != "none"):
                dirs[q] = work / f"{args.shape}-{q}"
                if not (dirs[q] / "flashllm.json").is_file():
                    made.append(dirs[q])
                    sh([py, "-m", "bench.models.make_model", "--shape", args.shape, "--dtype", "float16", "--out", dirs[q],
                        "--quantize", q, "--link-resident", args.float16_model, "--quiet"])
            for mode in modes:
                for label, q, resident in chosen:
                    run(label, dirs[q], resident, [mode])
        finally:
            if not args.keep_models:  # only what this run wrote
                for d in made:
                    shutil.rmtree(d, ignore_errors=True)
    else:
        for q in dict.fromkeys(v[1] for v in chosen):  # one model on disk at a time
            d = work / f"{args.shape}-{'float16' if q == 'none' else q}"
            try:
                if not (d / "flashllm.json").is_file():
                    sh([py, "-m", "bench.models.make_model", "--shape", args.shape, "--dtype", "float16", "--out", d,
                        "--quantize", q, "--quiet"])
                for label, _, resident in [v for v in chosen if v[1] == q]:
                    run(label, d, resident, modes)
            finally:
                if not args.keep_models:
                    shutil.rmtree(d, ignore_errors=True)
    for label, by_mode in reports.items():
        rows += [r for m in modes if m in by_mode for r in rows_of(by_mode[m], label, [m])]
    first = next(iter(next(iter(reports.values())).values()))["meta"]
    model_gb = {r["variant"]: r["model_gb"] for r in rows if "model_gb" in r}
    sizes = ", ".join(f"{label}: {gb:.2f} GB" for label, gb in model_gb.items())
    meta = {"shape": args.shape, "command": command_line("bench.quant.table3", argv),
            "machine": f"{setting}; load average at the end {load():.1f}", "code": code_version(),
            "models": f"bench/models/make_model.py --shape {args.shape} --dtype float16 --seed 0 [--quantize int4|int8] "
                      f"(resident tensors float16 on flash; sizes on flash {sizes}); compute (first variant) "
                      f"{first['compute']}",
            "budget": args.dram_budget, "active": first["active_method"], "tokens": first["tokens_desc"],
            "load_average": loads}
    text = markdown(rows, meta)
    print(text)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "reports": reports}, indent=1))


if __name__ == "__main__":
    main()
