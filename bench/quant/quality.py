"""Quality and flash bytes of quantized storage on the embedded model, against float32 in one run.

    python -m bench models corpus --split heldout --out heldout.txt
    python -m bench quant quality --data heldout.txt [--max-tokens 4096] [--groups 64 32] [--out FILE.md]

Converts flashllm/data/tiny-opt (or --model) to float32, float16, and int8/int4 bundles for each
group size (resident tensors float32 on flash) into a temporary directory, removed at the end; the
rows marked "+ resident" / "KV int8" load a model with `quantize_resident` / `kv_bits=8`. Per row:
- perplexity over the held-out tokens (dense mode, teacher-forced; sparse mode with the oracle
  predictor computes exactly the same), ratio to float32;
- greedy top-1 agreement: float32 generates `--gen-tokens` tokens greedily from a held-out prompt;
  the quantized model reads the same tokens and predicts each next one (fraction equal);
- flash bytes per decode token in sparse mode (oracle predictor, window 4, unlimited cache) over
  that same sequence, and its ratio to float16 bundles;
- with --budget (the demo's setting: 0.5, bfloat16 compute, context 256 + the prompt): sparse mode
  with the oracle predictor at that budget, twice: a fraction of the float32 model (the demo's
  bytes, the same for every row) and of each model's own size on flash (`--dram-budget 0.5` on
  that model). Per budget: perplexity over the first --budget-tokens held-out tokens, each sequence
  decoded token by token, and greedy top-1 agreement with float32 (dense) over the same generated
  tokens as above: what quantization costs where the user runs it (neurons the caches cannot hold
  are dropped; quantized resident matrices leave more room for the caches). --budget-only skips
  the unlimited-memory columns (dense perplexity over --max-tokens, flash bytes).
- with --train-data (and --budget): `flashllm predictors train` on each stored model of the run (float32
  and the quantized conversions, one recipe: --train-rank, --train-recall, --train-tokens), and the
  budget columns use those trained low-rank predictors instead of the oracle: quantization's cost
  where the user runs it, predictor misses included (a "+ resident" row uses the predictors trained
  on its stored model, whose resident matrices are float32).
"""
import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np


import flashllm
from flashllm.budget import BudgetTooSmall
from flashllm.cli.main import main as cli_main
from flashllm.converters import convert
from flashllm.cli.demo import SETTINGS as DEMO  # bfloat16, context 256
from flashllm.predictors import collect
from flashllm.predictors.evaluate import _greedy as greedy, _nll as nll  # the same measures
from bench.harness import ROOT


def measure(model_dir: Path, chunks, prompt, gen, window: int, opts: dict, with_bytes: bool = True) -> dict:
    """Dense perplexity and top-1 agreement; flash bytes per token for stored variants (load options do
    not change what is read)."""
    dense = flashllm.load(model_dir, **opts)
    losses = np.concatenate([nll(dense.logits(c)[:-1], c[1:]) for c in chunks])
    seq = prompt + gen
    follow = np.argmax(dense.logits(seq[:-1])[len(prompt) - 1:], axis=1) == np.array(gen)
    out = {"ppl": float(math.exp(losses.mean())), "top1_agreement": float(follow.mean()),
           "ffn_file_bytes": (model_dir / "ffn.bin").stat().st_size, "scored_tokens": int(len(losses)),
           "dram_bytes_dense": dense.stats["dram_bytes"]}
    if not opts and with_bytes:
        sparse = flashllm.load(model_dir, mode="sparse", predictor="oracle", window=window)
        sparse.logits(seq, prefill=len(prompt))
        out.update(bytes_per_token=sparse.stats["bytes_read"], decode_tokens=sparse.stats["decode_tokens"])
    return out


def score_loaded(model, chunks, max_tokens: int) -> tuple[float, int, float]:
    """Teacher-forced perplexity of a loaded model over `chunks` (up to `max_tokens` scored), the tokens
    scored, and the neurons it dropped per token (sparse mode at a budget)."""
    scored, dropped, n = [], 0.0, 0
    for c in chunks:
        if n >= max_tokens:
            break
        scored.append(nll(model.logits(c, prefill=1)[:-1], c[1:]))
        dropped += model.stats["neurons_dropped"] * model.stats["decode_tokens"]
        n += len(c) - 1
    return float(math.exp(np.concatenate(scored).mean())), n, dropped / n


def at_budget(model_dir: Path, chunks, prompt, gen, window: int, opts: dict, budget, budget_tokens: int,
              predictor: str = "oracle") -> dict:
    """Sparse mode (`predictor`) at `budget` (bytes, or a fraction of this model) in the demo's dtype, token by
    token: perplexity over the first `budget_tokens` held-out tokens, greedy top-1 agreement on `gen`."""
    seq = prompt + gen
    try:
        at = flashllm.load(model_dir, mode="sparse", predictor=predictor, window=window, dram_budget=budget,
                           **{**DEMO, "context": max(DEMO["context"], len(seq))}, **opts)
    except BudgetTooSmall as exc:
        return {"error": "does not fit: " + str(exc).split(";")[0]}
    ppl, n, dropped_per_token = score_loaded(at, chunks, budget_tokens)
    follow = np.argmax(at.logits(seq[:-1], prefill=len(prompt))[len(prompt) - 1:], axis=1) == np.array(gen)
    return {"ppl": ppl, "tokens": n, "top1_agreement": float(follow.mean()),
            "dropped_per_token": dropped_per_token, "cache_rows": int(sum(at.mode_impl.capacities)),
            "budget_bytes": int(at.dram_budget or 0), "predictor": at.stats.get("predictor", predictor)}


def chosen(rows: str, name: str) -> bool:
    """Whether `name` is in a comma-separated row list ("all": every row)."""
    return rows == "all" or name in rows.split(",")


def parse_row(name: str) -> tuple[str, dict]:
    """A row name -> (its stored model: "float32", "float16" or "intB gG", its load options):
    "int4 g32 + resident int8 + KV int8", "KV int8" (the float32 model with an int8 KV cache)."""
    parts = [p.strip() for p in name.split("+")]
    stored, opts = ("float32", {}) if parts[0] == "KV int8" else (parts[0], {})
    for p in parts[1:] + (["KV int8"] if parts[0] == "KV int8" else []):
        if p.startswith("resident ") and p[9:] in ("int8", "int4"):
            opts["quantize_resident"] = p[9:]
        elif p == "KV int8":
            opts["kv_bits"] = 8
        else:
            raise SystemExit(f"row {name!r}: {p!r} is not 'resident int8|int4' or 'KV int8'")
    q = stored.split()
    if stored not in ("float32", "float16") and not (len(q) == 2 and q[0] in ("int8", "int4") and q[1][:1] == "g"
                                                      and q[1][1:].isdigit()):
        raise SystemExit(f"row {name!r}: the stored model must be float32, float16 or 'int8|int4 gN'")
    return stored, opts


def train_predictors(model_dir: Path, args) -> None:
    """`flashllm predictors train` on a stored model (writes its predictors into model_dir)."""
    argv = ["predictors", "train", str(model_dir), "--data", str(args.train_data), "--rank", str(args.train_rank),
            "--recall-target", str(args.train_recall), "--max-tokens", str(args.train_tokens), "--quiet"]
    if cli_main(argv):
        raise SystemExit(f"flashllm {' '.join(argv)} failed")


def add_heldout_args(ap: argparse.ArgumentParser) -> None:
    """The held-out text options every quality bench on the embedded model takes (this one, compute_dtype)."""
    ap.add_argument("--model", type=Path, default=ROOT / "flashllm/data/tiny-opt", help="HF checkpoint")
    ap.add_argument("--data", type=Path, required=True, help="held-out text file")
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens scored (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=256, help="greedy tokens compared (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="(default: %(default)s)")


def heldout(ref, args) -> tuple[list, list, list]:
    """The held-out chunks, the greedy prompt and `ref`'s greedy continuation of it, from those options."""
    chunks = collect.chunk_text(ref, collect.read_data(args.data, args.max_tokens), args.seq_len,
                                args.max_tokens, str(args.data))
    prompt = chunks[0][:args.prompt_tokens]
    return chunks, prompt, greedy(ref, prompt, min(args.gen_tokens, ref.context - len(prompt)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_heldout_args(ap)
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 32], help="group sizes (default: %(default)s)")
    ap.add_argument("--window", type=int, default=4, help="sparse window (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=None, help="also measure sparse mode (oracle) at this DRAM "
                    "budget in bfloat16, as the demo runs (e.g. 0.5) (default: off)")
    ap.add_argument("--budget-tokens", type=int, default=256, help="held-out tokens scored at --budget "
                    "(default: %(default)s)")
    ap.add_argument("--budget-only", action="store_true", help="only the --budget table (default: off)")
    ap.add_argument("--unlimited", default="", help="comma-separated rows (or 'all') also measured in sparse mode "
                    "with no budget (every neuron pinned: dense), the quantization's cost apart from the budget's "
                    "(default: none)")
    ap.add_argument("--own-only", default="", help="comma-separated rows (or 'all') measured only at --budget of "
                    "their own size, not also of float32's (default: none)")
    ap.add_argument("--rows", help="comma-separated row names to measure (float32 always), e.g. \"int4 g32 + "
                    "resident int8\", \"int8 g64 + KV int8\" (default: the groups' stored rows, then g{first} + "
                    "resident and KV rows)")
    ap.add_argument("--no-bytes", action="store_true", help="skip the flash-bytes measurement (default: off)")
    ap.add_argument("--train-data", type=Path, help="calibration text: train predictors on every stored model and "
                    "use them (not the oracle) at --budget (default: off)")
    ap.add_argument("--train-rank", type=int, default=64, help="(default: %(default)s, the embedded predictors')")
    ap.add_argument("--train-recall", type=float, default=0.975, help="(default: %(default)s, the embedded predictors')")
    ap.add_argument("--train-tokens", type=int, default=60000, help="(default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and JSON beside it)")
    args = ap.parse_args(argv)
    if args.budget_only and not args.budget:
        ap.error("--budget-only needs --budget")
    if args.train_data and not args.budget:
        ap.error("--train-data needs --budget")

    g = args.groups[0]
    names = ["float32", "float16", *(f"{q} g{g}" for q in ("int8", "int4") for g in args.groups),
             f"int8 g{g} + resident int8", f"int4 g{g} + resident int4", "KV int8",
             f"int4 g{g} + resident int4 + KV int8"]
    if args.rows:
        names = list(dict.fromkeys(["float32", *args.rows.split(",")]))
    rows = {name: parse_row(name) for name in names}  # row -> (stored model, load options)
    work = Path(tempfile.mkdtemp(prefix="quant-quality-"))
    try:
        dirs = {}
        for stored, _ in rows.values():
            if stored not in dirs:
                q, g = ("none", 64) if stored.startswith("float") else (stored.split()[0], int(stored.split()[1][1:]))
                dtype = "float16" if stored == "float16" else "float32"
                dirs[stored] = convert(args.model, work / stored.replace(" ", "-"), dtype=dtype, quantize=q,
                                       group_size=g, progress=False)
        variants = {name: (dirs[stored], opts) for name, (stored, opts) in rows.items()}
        predictor = "oracle"
        if args.train_data:
            predictor = "lowrank"
            for d in dict.fromkeys(d for d, _ in variants.values()):
                print(f"training predictors on {d.name}", file=sys.stderr, flush=True)
                train_predictors(d, args)
        ref = flashllm.load(dirs["float32"])
        chunks, prompt, gen = heldout(ref, args)
        results, budgets = {}, {}
        for name, (d, opts) in variants.items():
            print(f"measuring {name}", file=sys.stderr, flush=True)
            if not args.budget_only:
                results[name] = measure(d, chunks, prompt, gen, args.window, opts, not args.no_bytes)
            if args.budget:  # the float32 model's bytes (the demo's), and this model's own size
                kinds = {"unlimited": None} if chosen(args.unlimited, name) else {}
                if name == "float32" or not chosen(args.own_only, name):
                    kinds["of float32"] = int(args.budget * ref.model_bytes)
                if name != "float32":
                    kinds["of its own size"] = args.budget
                budgets[name] = {kind: at_budget(d, chunks, prompt, gen, args.window, opts, b, args.budget_tokens,
                                                 predictor) for kind, b in kinds.items()}
            print(f"{name}: {json.dumps({'dense': results.get(name), 'budget': budgets.get(name)})}",
                  file=sys.stderr, flush=True)
        if args.budget:  # the reference on the budget's tokens: float32, dense, all in memory
            scored, n = [], 0
            for c in chunks:
                if n >= args.budget_tokens:
                    break
                scored.append(nll(ref.logits(c)[:-1], c[1:]))
                n += len(c) - 1
            ref_ppl = float(math.exp(np.concatenate(scored).mean()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [] if args.budget_only else unlimited_table(args, results, gen)
    if args.budget:
        lines += budget_table(args, budgets, ref_ppl, len(gen), predictor)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"unlimited": results, "budget": budgets,
                                                             "budget_reference_ppl": ref_ppl if args.budget else None},
                                                            indent=1))


def budget_table(args, budgets: dict, ref_ppl: float, n_gen: int, predictor: str) -> list[str]:
    ref_rows = budgets["float32"]
    base = ref_rows["of float32"]
    how = (f"low-rank predictors trained on each stored model: rank {args.train_rank}, recall target "
           f"{args.train_recall}, {args.train_tokens} tokens of {args.train_data.name}") if predictor == "lowrank" \
        else "oracle predictor"
    lines = ["", f"{args.model.name}: sparse mode ({how}, window {args.window}) at --dram-budget "
             f"{args.budget}, bfloat16 compute, context {max(256, args.prompt_tokens + n_gen)}: perplexity over "
             f"{base['tokens']} held-out tokens decoded one by one (float32 dense: {ref_ppl:.4f}); top-1 agreement "
             f"with float32 dense over its {n_gen} greedy tokens", "",
             "| storage (+ load options) | budget | budget MiB | cache rows | dropped/token | perplexity | "
             "vs float32 dense | vs float32 at this budget (unlimited: unlimited) | top-1 agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for name, by in budgets.items():
        for kind, r in by.items():
            label = "unlimited" if kind == "unlimited" else f"{args.budget} {kind}"
            if "error" in r:
                lines.append(f"| {name} | {label} | | {r['error']} |" + " |" * 5)
                continue
            same = ref_rows.get(kind, base)  # float32 at the same kind of budget (its own size: 50% of float32)
            mib = f"{r['budget_bytes'] / 2**20:.2f}" if r["budget_bytes"] else "none"
            lines.append(f"| {name} | {label} | {mib} | {r['cache_rows']} | "
                         f"{r['dropped_per_token']:.0f} | {r['ppl']:.4f} | {(r['ppl'] / ref_ppl - 1) * 100:+.2f}% | "
                         f"{(r['ppl'] / same['ppl'] - 1) * 100:+.2f}% | {r['top1_agreement']:.3f} |")
    return lines


def unlimited_table(args, results: dict, gen) -> list[str]:
    base, f16 = results["float32"], results.get("float16", {})
    lines = [f"{args.model.name}: {base['scored_tokens']} held-out tokens ({args.data.name}), greedy agreement over "
             f"{len(gen)} tokens" + (f", sparse oracle window {args.window} over {base['decode_tokens']} decode tokens"
                                     if "decode_tokens" in base else ""),
             "", "| storage (+ load options) | ffn.bin MiB | DRAM dense MiB | perplexity | ppl vs float32 | top-1 "
             "agreement | flash bytes/token | vs float16 |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        r["ppl_ratio"] = r["ppl"] / base["ppl"]
        cells = [name, f"{r['ffn_file_bytes'] / 2**20:.2f}", f"{r['dram_bytes_dense'] / 2**20:.2f}", f"{r['ppl']:.4f}",
                 f"{(r['ppl_ratio'] - 1) * 100:+.2f}%", f"{r['top1_agreement']:.3f}"]
        if "bytes_per_token" in r and "bytes_per_token" in f16:
            r["bytes_vs_float16"] = r["bytes_per_token"] / f16["bytes_per_token"]
            cells += [f"{r['bytes_per_token'] / 1024:.1f} KiB", f"{r['bytes_vs_float16']:.3f}"]
        else:
            cells += ["as stored" if not args.no_bytes else "not measured", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
