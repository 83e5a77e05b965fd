"""Batch mode's throughput: the same prompts decoded one at a time and in batches, at one DRAM budget.

For each mode and batch size B, the P prompts are decoded B at a time (`Model.generate_batch_ids`; B = 1 is
one-at-a-time) by a model loaded with `batch_size=B` at the same budget (its B KV caches count against
it), in interleaved rounds. Reported per configuration: decode tokens/s (decode time only) and end to
end (prompts included), flash bytes and reads per generated token, neurons dropped per token, and how
many sequences came out token-for-token equal to B = 1 (sparse with trained predictors computes each
sequence over the union of the batch's predicted neurons, so it may differ; dense-equivalent modes
must not).

Models: the embedded model at the demo's settings (bfloat16 compute, 50% budget), prompts from held-out
standard-library lines; with --opt13 DIR an OPT-1.3B-shaped model (bench/models/make_model.py; random weights,
random rank-16 predictors selecting ~16% per token as in bench/plan.py), random prompt ids.

    python -m bench batch [--opt13 DIR] [--out bench/results/batch/throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import flashllm
from flashllm.cli import demo

from bench.models import stdlib_corpus
from bench.harness import command_line

MODES = {"sparse": dict(mode="sparse", predictor="lowrank", window=4), "naive": dict(mode="naive"),
         "hybrid": dict(mode="hybrid")}


def text_prompts(n: int) -> list[str]:
    """`n` held-out standard-library lines of 20-120 characters, in a fixed order."""
    out = []
    for _, text in stdlib_corpus.texts("heldout"):
        out += [line.strip() for line in text.splitlines() if 20 <= len(line.strip()) <= 120]
        if len(out) >= n:
            return out[:n]
    return out


def run_batches(model, prompts, batch: int, tokens: int) -> dict:
    """Decode `prompts` `batch` at a time; totals of decode time, prompt time, tokens, bytes and reads."""
    out = {"tokens": 0, "decode_ms": 0.0, "prompt_ms": 0.0, "bytes": 0.0, "reads": 0.0, "dropped": 0.0, "ids": []}
    for k in range(0, len(prompts), batch):
        model.generate_batch_ids(prompts[k:k + batch], max_new_tokens=tokens)  # ids: a made model has no tokenizer
        s, n = model.stats, model.stats["decode_tokens"]
        out["tokens"] += n
        out["decode_ms"] += s["total_ms"] * n
        out["prompt_ms"] += s["prompt"]["total_ms"]
        out["bytes"] += s["bytes_read"] * n
        out["reads"] += s["reads"] * n
        out["dropped"] += s["neurons_dropped"] * n
        out["ids"] += [g.token_ids for g in model.last_generations]
    return out


def measure(model_dir, prompts: list[list[int]], budget, modes, batches, tokens, rounds, settings) -> list[dict]:
    rows = []
    context = max(len(p) for p in prompts) + tokens
    for mode in modes:
        runs, caps, dram = {}, {}, {}
        for _ in range(rounds):
            for b in batches:  # interleaved: the machine's load changes between rounds; one model held at a time
                try:
                    model = flashllm.load(model_dir, dram_budget=budget, batch_size=b, context=context, **settings,
                                          **MODES[mode])
                except flashllm.FlashLLMError as exc:  # e.g. b KV caches do not fit the budget: say so in the table
                    if b not in caps:
                        caps[b] = None
                        rows.append({"model": Path(model_dir).name, "budget": budget, "mode": mode, "batch": b,
                                     "error": str(exc).split(";")[0]})
                    continue
                caps[b], dram[b] = sum(model.stats.get("cache_capacity") or [0]), model.dram_bytes()
                runs.setdefault(b, []).append(run_batches(model, prompts, b, tokens))
                del model
        one = runs[batches[0]][0]["ids"] if batches[0] in runs else None
        for b in runs:
            rs = runs[b]
            dec = [r["tokens"] / r["decode_ms"] * 1e3 for r in rs]
            e2e = [(r["tokens"] + len(prompts)) / (r["decode_ms"] + r["prompt_ms"]) * 1e3 for r in rs]
            first = rs[0]
            rows.append({"model": Path(model_dir).name, "budget": budget, "mode": mode, "batch": b,
                         "decode_tok_s": float(np.median(dec)), "decode_tok_s_range": [min(dec), max(dec)],
                         "e2e_tok_s": float(np.median(e2e)), "bytes_per_token": first["bytes"] / first["tokens"],
                         "reads_per_token": first["reads"] / first["tokens"], "dropped_per_token": first["dropped"] / first["tokens"],
                         "same_as_one_at_a_time": None if one is None else sum(a == c for a, c in zip(first["ids"], one)),
                         "prompts": len(prompts),
                         "cache_rows": caps[b], "dram_bytes": dram[b]})
            print(json.dumps({k: rows[-1][k] for k in ("model", "mode", "batch", "decode_tok_s", "bytes_per_token")}),
                  file=sys.stderr, flush=True)
    return sorted(rows, key=lambda r: (r["budget"], list(modes).index(r["mode"]), r["batch"]))


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| model | budget | mode | batch | decode tok/s (range) | vs batch 1 | end-to-end tok/s | "
             "KiB read / token | reads / token | dropped / token | cache rows | same tokens as batch 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['budget']} | {r['mode']} | {r['batch']} | not run: {r['error']} |"
                         + " |" * 7)
            continue
        key = (r["model"], r["budget"], r["mode"])
        base.setdefault(key, r["decode_tok_s"])
        lo, hi = r["decode_tok_s_range"]
        lines.append(f"| {r['model']} | {r['budget']} | {r['mode']} | {r['batch']} | {r['decode_tok_s']:.2f} "
                     f"({lo:.2f}-{hi:.2f}) | {r['decode_tok_s'] / base[key]:.2f}x | {r['e2e_tok_s']:.2f} | "
                     f"{r['bytes_per_token'] / 1024:,.0f} | {r['reads_per_token']:.1f} | {r['dropped_per_token']:.1f} | "
                     f"{r['cache_rows']} | {r['same_as_one_at_a_time']}/{r['prompts']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="prompts decoded (default 16)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per prompt (default 16)")
    p.add_argument("--batches", default="1,4,16", help="batch sizes (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--modes", default="sparse,naive,hybrid", help="modes (default sparse,naive,hybrid)")
    p.add_argument("--budgets", default="0.5,0.6", help="DRAM budgets of the embedded model (default 0.5,0.6)")
    p.add_argument("--opt13", default=None, help="also an OPT-1.3B-shaped model directory (bench/models/make_model.py)")
    p.add_argument("--opt13-budget", default="2.6GiB", help="its DRAM budget (default 2.6GiB)")
    p.add_argument("--opt13-tokens", type=int, default=4, help="its new tokens per prompt (default 4)")
    p.add_argument("--opt13-modes", default="sparse,naive", help="its modes (default sparse,naive)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    batches = [int(b) for b in args.batches.split(",")]
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashllm-batch-") as tmp:
        if not args.budgets:  # --budgets "": only the --opt13 model
            args.budgets, args.modes = "", ""
        model_dir = demo.prepare(Path(tmp) / "tiny-opt")
        tokenizer = flashllm.load(model_dir).tokenizer
        prompts = [tokenizer.encode(t) for t in text_prompts(args.prompts)]
        for budget in filter(None, args.budgets.split(",")):
            rows += measure(model_dir, prompts, float(budget), args.modes.split(","), batches,
                            args.tokens, args.rounds, {k: v for k, v in demo.SETTINGS.items() if k != "context"})
    if args.opt13:
        from bench.plan import random_predictors

        d = Path(args.opt13)
        random_predictors(d)
        vocab = flashllm.format.manifest.read_manifest(d, verify=False).spec.vocab_size
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in rng.integers(4, 17, args.prompts)]
        rows += measure(d, prompts, args.opt13_budget, args.opt13_modes.split(","), batches, args.opt13_tokens,
                        args.rounds, {})
    load = f"load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores, shared)"
    command = command_line("bench.batch", argv)
    text = table(rows, f"`{command}`\n\n{args.rounds} interleaved rounds, medians; torch threads {args.torch_threads}; "
                       f"{load}. Embedded model: demo settings (bfloat16 compute), {args.prompts} prompts x "
                       f"{args.tokens} new tokens.")
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"command": command, "rows": [
            {k: v for k, v in r.items()} for r in rows]}, indent=1) + "\n")
        Path(args.out + ".md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
