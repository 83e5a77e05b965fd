"""Reads and bytes per decode token before/after co-activation ordering, on held-out text.

The embedded model (flashllm/data/tiny-opt with its shipped predictors) is converted into a temporary
directory and copied per ordering: the converter's order, hot-first (by activation frequency) and
co-activation (`flashllm predictors order` on the stdlib corpus' train split). Each copy decodes the same
held-out sequences (stdlib corpus, heldout split) token by token in sparse mode, and the runtime's own
stats give reads, bytes and I/O time per decode token. Beside the engine's measured reads, "reads
with gap filling g" replays the same loads (predicted now, not in the window's earlier tokens; unlimited
cache) and merges needed bundles at most g bundles apart into one read (the bytes then include the gaps).

    python -m bench io order [--tokens 1024] [--budget 0.5] [--out bench/results/io/neuron_order]

The co-activation order `flashllm demo` uses is the one this computes, shipped with the embedded model
(flashllm/data/tiny-opt-predictors/neuron_order.safetensors); `--ship` computes it and writes that file
(the report says whether the order computed here is the shipped one); `--quality` compares held-out
perplexity in the shipped order and the converter's, dense and sparse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import flashllm
from flashllm.cli import demo
from flashllm.predictors import coactivation as co
from flashllm.predictors.order import order_model
from flashllm.predictors.reorder import apply_order
from flashllm.format.safetensors_io import SafetensorsFile
from bench.harness import command_line

GAPS = (0, 1, 2, 4, 8)


def gap_runs(ids: np.ndarray, gap: int) -> tuple[int, int]:
    """(reads, bundles transferred) for sorted needed ids when holes of at most `gap` bundles are read through."""
    if not len(ids):
        return 0, 0
    breaks = np.flatnonzero(np.diff(ids) > gap + 1)
    starts = np.concatenate([[ids[0]], ids[breaks + 1]])
    ends = np.concatenate([ids[breaks], [ids[-1]]])
    return len(starts), int((ends - starts + 1).sum())


def measure(model_dir: Path, sequences: list[list[int]], prefill: int, budget, window: int, gap_bytes) -> dict:
    model = flashllm.load(model_dir, mode="sparse", predictor="lowrank", dram_budget=budget, window=window,
                          gap_bytes=gap_bytes, **demo.SETTINGS)
    stride = model.layout.stride
    keys = ("bytes_read", "reads", "io_ms", "total_ms")
    total = {k: 0.0 for k in keys}
    sim = {g: [0, 0] for g in GAPS}
    tokens = 0
    for seq in sequences:
        masks: dict[int, list[np.ndarray]] = {}
        model.mode_impl.reset()
        with model.hooks.observing("predict", lambda layer, m: masks.setdefault(layer, []).append(m.copy())):
            model.logits(seq, prefill=prefill)
        n = len(seq) - prefill
        for k in keys:
            total[k] += model.stats[k] * n
        tokens += n
        for layer, ms in masks.items():
            pred = np.concatenate(ms)  # prompt rows, then one row per decode token
            loads = co.loads(pred, window)[prefill:]
            for row in loads:
                ids = np.flatnonzero(row)
                for g in GAPS:
                    r, b = gap_runs(ids, g)
                    sim[g][0] += r
                    sim[g][1] += b
    out = {k: total[k] / tokens for k in keys}
    out["sim"] = {g: {"reads": r / tokens, "bytes": b * stride / tokens} for g, (r, b) in sim.items()}
    out["tokens"] = tokens
    out["gap_bytes"] = model.stats.get("gap_bytes", gap_bytes)
    return out


def frequency_order(model_dir: Path) -> list[np.ndarray]:
    st = SafetensorsFile(model_dir / "predictors.safetensors")
    n_layers = len(json.loads((model_dir / "predictors.json").read_text())["layers"])
    return [np.argsort(-st.read(f"layers.{i}.freq"), kind="stable") for i in range(n_layers)]


def run(tokens: int, seq_len: int, prefill: int, budget, window: int, cal_tokens: int, workdir: Path) -> dict:
    from bench.models import stdlib_corpus  # here so that gap_runs imports alone

    base = demo.prepare(workdir / "converter", order=False)
    heldout = workdir / "heldout.txt"
    train = workdir / "train.txt"
    stdlib_corpus.write_text("heldout", heldout, max_bytes=16 * tokens)
    stdlib_corpus.write_text("train", train, max_bytes=16 * cal_tokens)
    probe = flashllm.load(base, mode="dense", **demo.SETTINGS)
    ids = probe.tokenizer.encode(heldout.read_text())
    del probe
    sequences = [ids[k:k + seq_len] for k in range(0, min(len(ids), tokens + tokens // (seq_len - prefill) * prefill),
                                                   seq_len)]
    sequences = [s for s in sequences if len(s) > prefill + 1]
    dirs = {"converter": base}
    t0 = time.perf_counter()
    dirs["hot-first"] = Path(shutil.copytree(base, workdir / "hot-first"))
    apply_order(dirs["hot-first"], frequency_order(base), {"method": "frequency"}, progress=False)
    dirs["coactivation"] = Path(shutil.copytree(base, workdir / "coactivation"))
    info = order_model(dirs["coactivation"], train, max_tokens=cal_tokens, window=window, progress=False)
    order_s = time.perf_counter() - t0
    shipped = demo.EMBEDDED_PREDICTORS / demo.ORDER_FILE
    same = shipped.is_file() and all(np.array_equal(a, b) for a, b in zip(read_perms(shipped),
                                                                          read_perms(dirs["coactivation"] / demo.ORDER_FILE)))
    results = {f"{name}, gap {'auto' if gap is None else gap}": measure(d, sequences, prefill, budget, window, gap)
               for gap in (0, None) for name, d in dirs.items()}
    return {"budget": budget, "window": window, "settings": demo.SETTINGS, "tokens": results["converter, gap 0"]["tokens"],
            "calibration_tokens": info["tokens"], "order_seconds": round(order_s, 1),
            "expected_on_calibration": {k: info[k] for k in ("runs_per_token_before", "runs_per_token_after")},
            "same_as_shipped": same, "results": results}


def read_perms(path: Path) -> list[np.ndarray]:
    st = SafetensorsFile(path)
    return [st.read(f"layers.{i}.perm") for i in range(len(st.entries))]


def ship(cal_tokens: int, window: int, workdir: Path) -> dict:
    """Compute the co-activation order of the embedded model (from the converter's order, on the train split)
    and write it where `flashllm demo` takes it from."""
    from bench.models import stdlib_corpus

    base = demo.prepare(workdir / "converter", order=False)
    train = workdir / "train.txt"
    stdlib_corpus.write_text("train", train, max_bytes=16 * cal_tokens)
    info = order_model(base, train, max_tokens=cal_tokens, window=window)
    dest = demo.EMBEDDED_PREDICTORS / demo.ORDER_FILE
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.copyfile(base / demo.ORDER_FILE, tmp)
    os.replace(tmp, dest)
    return {k: info[k] for k in ("tokens", "runs_per_token_before", "runs_per_token_after")}


def table(r: dict) -> str:
    lines = [f"embedded model, sparse, lowrank predictors, budget {r['budget']}, window {r['window']}, "
             f"{r['tokens']} held-out decode tokens; ordering from {r['calibration_tokens']} train-split tokens "
             f"({'the' if r.get('same_as_shipped') else 'NOT the'} order shipped for `flashllm demo`)",
             "", f"{'order, engine gap':<24}{'reads/tok':>10}{'KiB/tok':>9}{'io ms':>8}{'total ms':>9}" +
             "".join(f"{'g=' + str(g) + ' reads':>12}{'KiB':>7}" for g in GAPS)]
    for name, m in r["results"].items():
        lines.append(f"{name:<24}{m['reads']:>10.1f}{m['bytes_read'] / 1024:>9.1f}{m['io_ms']:>8.2f}{m['total_ms']:>9.2f}"
                     + "".join(f"{m['sim'][g]['reads']:>12.1f}{m['sim'][g]['bytes'] / 1024:>7.1f}" for g in GAPS))
    lines.append("")
    for gap in ("0", "auto"):
        base, best = r["results"][f"converter, gap {gap}"], r["results"][f"coactivation, gap {gap}"]
        lines.append(f"engine gap {gap} ({best['gap_bytes']} bytes): coactivation vs converter order: reads/token "
                     f"{best['reads'] / base['reads']:.2f}x, bytes/token {best['bytes_read'] / base['bytes_read']:.2f}x, "
                     f"io ms {best['io_ms'] / base['io_ms']:.2f}x (below 1: fewer)")
    return "\n".join(lines)


def quality(tokens: int, seq_len: int, prefill: int, budget, window: int, workdir: Path) -> str:
    """Held-out perplexity and top-1 agreement with dense, dense and sparse, in the shipped order and in the
    converter's: the order is a permutation, so only the float sums' order may differ."""
    from bench.models import stdlib_corpus

    heldout = workdir / "heldout.txt"
    stdlib_corpus.write_text("heldout", heldout, max_bytes=16 * tokens)
    dirs = {"shipped": demo.prepare(workdir / "shipped"), "converter": demo.prepare(workdir / "converter", order=False)}
    ids = flashllm.load(dirs["shipped"], mode="dense", **demo.SETTINGS).tokenizer.encode(heldout.read_text())
    seqs = [ids[k:k + seq_len] for k in range(0, min(len(ids), tokens), seq_len)]
    lines, tops = [], {}
    for name, d in dirs.items():
        for mode in ("dense", "sparse"):
            kw = dict(predictor="lowrank", dram_budget=budget, window=window) if mode == "sparse" else {}
            model = flashllm.load(d, mode=mode, **kw, **demo.SETTINGS)
            nll, n, top = 0.0, 0, []
            for s in seqs:
                lg = model.logits(s, prefill=prefill)[:-1].astype(np.float64)
                lse = lg.max(1) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1))
                nll += float((lse - lg[np.arange(len(s) - 1), s[1:]]).sum())
                n += len(s) - 1
                top.append(lg.argmax(1))
            tops[name, mode] = np.concatenate(top)
            agree = np.mean(tops[name, mode] == tops[name, "dense"])
            lines.append(f"{name + ' order':<16}{mode:<8}perplexity {np.exp(nll / n):.3f}  top-1 vs its dense {agree:.4f}"
                         f"  dropped/token {model.stats.get('neurons_dropped', 0)}")
    lines.append(f"{n} held-out positions (stdlib corpus), budget {budget}, window {window}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="held-out decode tokens (default 1024)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per held-out sequence (default 128)")
    p.add_argument("--prefill", type=int, default=8, help="prompt tokens per sequence (default 8)")
    p.add_argument("--budget", default="0.5", help="DRAM budget (default 0.5, the demo's); 'unlimited' for none")
    p.add_argument("--window", type=int, default=4, help="sliding window (default 4)")
    p.add_argument("--calibration-tokens", type=int, default=20000, help="tokens the order is computed on (default 20000)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--quality", action="store_true", help="only compare held-out perplexity and top-1 agreement "
                   "in the shipped order and the converter's (dense and sparse)")
    p.add_argument("--ship", action="store_true", help="only compute the order and write it to "
                   "flashllm/data/tiny-opt-predictors/neuron_order.safetensors (what `flashllm demo` uses)")
    args = p.parse_args(argv)
    budget = None if args.budget == "unlimited" else flashllm.budget.parse_budget(args.budget)
    import torch

    torch.set_num_threads(args.torch_threads)  # a tiny model: more threads only spin on a loaded machine
    if args.quality:
        with tempfile.TemporaryDirectory(prefix="flashllm-order-") as tmp:
            text = quality(args.tokens, args.seq_len, args.prefill, budget, args.window, Path(tmp))
        print(text)
        return {"quality": text}
    if args.ship:
        with tempfile.TemporaryDirectory(prefix="flashllm-order-") as tmp:
            info = ship(args.calibration_tokens, args.window, Path(tmp))
        print(f"wrote {demo.EMBEDDED_PREDICTORS / demo.ORDER_FILE}: expected reads per token on the calibration text "
              f"{info['runs_per_token_before']} -> {info['runs_per_token_after']} ({info['tokens']} tokens)")
        return info
    with tempfile.TemporaryDirectory(prefix="flashllm-order-") as tmp:
        r = run(args.tokens, args.seq_len, args.prefill, budget, args.window, args.calibration_tokens, Path(tmp))
    r["command"] = command_line("bench.io.neuron_order", argv)
    text = table(r)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(r, indent=1) + "\n")
        Path(args.out + ".md").write_text(f"`{r['command']}`\n\n```\n{text}\n```\n")
    return r


if __name__ == "__main__":
    main()
