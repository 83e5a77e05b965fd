"""Speculative decoding by prompt lookup on the embedded models: tokens/s and flash bytes per generated token with
and without it, acceptance rate, for K = 2, 4, 8 drafted tokens per verification, and whether the tokens equal
plain greedy decoding's (checked in the run).

Models, at the demo's settings: tiny-opt in sparse mode at a DRAM budget of 50% of its size (bfloat16 compute,
its shipped low-rank predictors, window 4) and tiny-moe with its experts streamed at 50% (float16, router
read-ahead). Prompts: `code` (a module with one function and the start of a similar one: text to copy),
`code-short` (the demo's prompt) and `prose` (an English paragraph). Each configuration is run in `--rounds`
interleaved rounds; tokens/s is decode tokens over the generation's wall time less the prompt's forward pass
(drafting, verification and the accept/reject loop included). Each K runs with a fixed draft length and with
the adaptive one (Speculation.adaptive). Also for sparse mode, at --policy-k (adaptive): the window policy after
a verification, "accepted" (the paper's: the accepted positions' neurons) against "verified" (every verified
position's, rejected drafts included), in flash bytes per generated token.

Exactness: MoE routing is exact, so its tokens must equal plain greedy decoding's. Sparse mode with learned
predictors computes each position over its window's neurons, and a verification's window holds every verified
position's predicted neurons, so its tokens may differ from plain sparse decoding's (not from what an exact
predictor gives: tests/test_speculative.py); the table says where they first differ.

    python -m bench speculative [--tokens 96] [--rounds 3] [--out bench/results/speculative/embedded]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

import flashllm
from flashllm.cli import demo
from flashllm.errors import DroppedNeuronsWarning
from flashllm.options import Speculation

from bench.harness import command_line

CODE = '''import os


def read_config(path):
    """Read a configuration file and return its values as a dictionary."""
    values = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def read_config_lines(path):
    """Read a configuration file and return its lines as a list."""
'''
PROSE = ("Flash memory keeps its contents without power, and it is much larger than the memory a phone or a laptop "
         "computes from. A language model that does not fit in memory can still run if its weights are read from "
         "flash as they are needed. The cost of that is the time spent waiting for the reads, and the")
PROMPTS = {"code": CODE, "code-short": demo.PROMPT, "prose": PROSE}
MODELS = {
    "tiny-opt sparse 50%": dict(mode="sparse", predictor="lowrank", dram_budget=0.5, window=4, **demo.SETTINGS),
    "tiny-moe streamed 50%": dict(mode="sparse", dram_budget=0.5, expert_read_ahead=True, **demo.MOE_SETTINGS),
}


def run(model, ids: list[int], tokens: int, speculative) -> dict:
    """One greedy generation: its tokens, decode tokens/s by wall time, and the stats."""
    t0 = time.perf_counter()
    out = list(model.generate_ids(ids, tokens, speculative=speculative))
    wall = time.perf_counter() - t0
    s = model.stats
    decode_s = wall - s["prompt"]["total_ms"] / 1e3
    return {"ids": out, "tok_s": s["decode_tokens"] / decode_s, "stats": s}


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def cases(ks: list[int], policy_k: int | None, min_ngram: int) -> dict:
    """(K, adaptive, window policy) -> the speculative= argument: plain; each K with fixed and adaptive draft
    lengths; at `policy_k` (adaptive) also the "verified" window policy."""
    out: dict = {(0, False, None): False}
    for k in ks:
        for adaptive in (False, True):
            out[(k, adaptive, "accepted")] = dict(num_draft_tokens=k, adaptive=adaptive, min_ngram=min_ngram)
    if policy_k:
        out[(policy_k, True, "verified")] = dict(num_draft_tokens=policy_k, adaptive=True, min_ngram=min_ngram,
                                                 window_policy="verified")
    return out


def measure(name: str, model_dir: Path, options: dict, prompt: str, tokens: int, todo: dict, rounds: int) -> list[dict]:
    model = flashllm.load(model_dir, **options)
    ids = model.tokenizer.encode(prompt)
    runs: dict = {c: [] for c in todo}
    for _ in range(rounds):  # interleaved: the machine's load drifts between rounds
        for case, speculative in todo.items():
            runs[case].append(run(model, ids, tokens, speculative))
    plain_runs = runs[(0, False, None)]
    plain = plain_runs[0]
    rows = []
    for (k, adaptive, policy), rs in runs.items():
        s, speeds = rs[0]["stats"], [r["tok_s"] for r in rs]
        ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(rs, plain_runs)]  # each round against its own plain
        diff = first_difference(rs[0]["ids"], plain["ids"])
        rows.append({"model": name, "prompt": prompt_name(prompt), "prompt_tokens": len(ids), "k": k,
                     "adaptive": adaptive, "policy": policy, "tok_s": float(np.median(speeds)), "tok_s_range": [min(speeds), max(speeds)],
                     "speedup": float(np.median(ratios)), "speedup_range": [min(ratios), max(ratios)],
                     "bytes_per_token": s.get("bytes_per_generated_token", s["bytes_read"]),
                     "acceptance_rate": s.get("acceptance_rate"), "tokens_per_forward": s.get("tokens_per_forward", 1.0),
                     "same_as_plain": diff is None, "first_difference": diff,
                     "same_every_round": all(r["ids"] == rs[0]["ids"] for r in rs),
                     "decode_tokens": s["decode_tokens"], "neurons_dropped": s.get("neurons_dropped", 0.0)})
        print(json.dumps({k2: rows[-1][k2] for k2 in ("model", "prompt", "k", "adaptive", "policy", "speedup", "bytes_per_token",
                                                      "acceptance_rate", "same_as_plain")}), file=sys.stderr, flush=True)
    return rows


class Planted:
    """Drafts plain greedy decoding's own continuation, each drafted token kept with probability `rate` and else
    replaced by another token: acceptance modelled as independent per drafted token (a draft after a wrong one
    is rejected whatever it is), so bytes per token can be read against the acceptance rate."""

    def __init__(self, prompt: list[int], plain: list[int], rate: float, vocab: int, seed: int = 0):
        self.prompt, self.plain, self.rate, self.vocab = prompt, plain, rate, vocab
        self.rng = np.random.default_rng(seed)

    def draft(self, ids, k, temperature, top_p, rng):
        done = len(ids) - len(self.prompt)
        out = [int(t) for t in self.plain[done:done + k]]
        for i, t in enumerate(out):
            if self.rng.random() >= self.rate:
                out[i] = int((t + 1 + self.rng.integers(self.vocab - 1)) % self.vocab)
        return out, [None] * len(out)


def acceptance_sweep(name: str, model_dir: Path, options: dict, prompt: str, tokens: int, rates: list[float],
                     k: int) -> list[dict]:
    """Flash bytes per generated token against a planted acceptance rate, K fixed and adaptive."""
    model = flashllm.load(model_dir, **options)
    ids = model.tokenizer.encode(prompt)
    plain = list(model.generate_ids(ids, tokens, speculative=False))
    base = model.stats["bytes_read"]
    rows = []
    for rate in rates:
        for adaptive in (False, True):
            drafter = Planted(ids, plain, rate, model.spec.vocab_size)
            out = list(model.generate_ids(ids, tokens, speculative=dict(draft=drafter, num_draft_tokens=k,
                                                                         adaptive=adaptive)))
            s = model.stats
            rows.append({"model": name, "prompt": prompt_name(prompt), "k": k, "adaptive": adaptive, "rate": rate,
                         "acceptance_rate": s["acceptance_rate"], "tokens_per_forward": s["tokens_per_forward"],
                         "bytes_per_token": s["bytes_per_generated_token"], "plain_bytes_per_token": base,
                         "same_as_plain": out == plain})
    return rows


def sweep_table(rows: list[dict]) -> str:
    lines = ["| model | prompt | K | draft length | planted rate | acceptance | tokens / pass | KiB read / token | "
             "vs plain | same tokens as plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['prompt']} | {r['k']} | {'adaptive' if r['adaptive'] else 'fixed'} | "
                     f"{r['rate']:.2f} | {r['acceptance_rate']:.2f} | {r['tokens_per_forward']:.2f} | "
                     f"{r['bytes_per_token'] / 1024:,.1f} | {r['bytes_per_token'] / r['plain_bytes_per_token']:.2f} | "
                     f"{'yes' if r['same_as_plain'] else 'no'} |")
    return "\n".join(lines)


def prompt_name(prompt: str) -> str:
    return next(n for n, p in PROMPTS.items() if p == prompt)


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| model | prompt | K | draft length | window policy | tok/s (range) | speedup (range) | "
             "KiB read / token | vs plain | acceptance | tokens / pass | same tokens as plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(r["model"], r["prompt"]): r["bytes_per_token"] for r in rows if not r["k"]}
    for r in rows:
        lo, hi = r["tok_s_range"]
        slo, shi = r["speedup_range"]
        same = "yes" if r["same_as_plain"] else f"no (from token {r['first_difference']})"
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        base = plain[(r["model"], r["prompt"])]
        length = "-" if not r["k"] else "adaptive" if r["adaptive"] else "fixed"
        lines.append(f"| {r['model']} | {r['prompt']} ({r['prompt_tokens']} tokens) | {r['k'] or 'plain'} | {length} | "
                     f"{r['policy'] or '-'} | {r['tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | {r['speedup']:.2f}x "
                     f"({slo:.2f}-{shi:.2f}) | {r['bytes_per_token'] / 1024:,.1f} | "
                     f"{r['bytes_per_token'] / base if base else 1:.2f} | {acc} | "
                     f"{r['tokens_per_forward']:.2f} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per generation (default 96)")
    p.add_argument("--ks", default="2,4,8", help="drafted tokens per verification (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help=f"prompts (default {','.join(PROMPTS)})")
    p.add_argument("--models", default="opt,moe", help="embedded models: opt, moe (default opt,moe)")
    p.add_argument("--policy-k", type=int, default=4, help="sparse: also the 'verified' window policy at this K, adaptive "
                   "(0: not) (default 4)")
    p.add_argument("--min-ngram", type=int, default=Speculation.min_ngram,
                   help=f"prompt lookup's shortest match (default {Speculation.min_ngram})")
    p.add_argument("--sweep", default=None, metavar="RATES",
                   help="instead: flash bytes per token against planted acceptance rates (e.g. 0,0.25,0.5,0.75,1), "
                   "drafts of plain decoding's own continuation (Planted), at K = the first of --ks")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    ks = [int(k) for k in args.ks.split(",")]
    load = os.getloadavg()
    rows = []
    warnings.simplefilter("ignore", DroppedNeuronsWarning)  # the drops are counted in the table
    with tempfile.TemporaryDirectory(prefix="flashllm-speculative-") as tmp:
        for short in args.models.split(","):
            dirs = {short: demo.prepare(Path(tmp) / "tiny-opt") if short == "opt" else demo.prepare_moe(Path(tmp) / "tiny-moe")}
            name = next(n for n in MODELS if n.startswith(f"tiny-{short}"))
            todo = cases(ks, args.policy_k if short == "opt" else None, args.min_ngram)  # (no window over experts)
            for prompt in args.prompts.split(","):
                if args.sweep:
                    rows += acceptance_sweep(name, dirs[short], MODELS[name], PROMPTS[prompt], args.tokens,
                                             [float(r) for r in args.sweep.split(",")], ks[0])
                else:
                    rows += measure(name, dirs[short], MODELS[name], PROMPTS[prompt], args.tokens, todo, args.rounds)
    load = f"load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores, shared)"
    command = command_line("bench.speculative", argv)
    if args.sweep:
        text = f"`{command}`\n\n{args.tokens} new tokens, greedy; acceptance planted (Planted)." + "\n\n" + \
            sweep_table(rows)
    else:
        text = table(rows, f"`{command}`\n\nPrompt lookup (n-grams of {args.min_ngram} to {Speculation.max_ngram} "
                           f"tokens), greedy, {args.tokens} new tokens; {args.rounds} interleaved rounds, medians "
                           f"(speedup: each round against its own plain run); torch threads {args.torch_threads}; {load}.")
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_json, tmp_md = out.with_suffix(".json.tmp"), out.with_suffix(".md.tmp")
        tmp_json.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
        tmp_md.write_text(text + "\n")
        tmp_json.rename(out.with_suffix(".json"))
        tmp_md.rename(out.with_suffix(".md"))
    return rows


if __name__ == "__main__":
    main()
