"""Recall of the sparse lookahead per layer, from which residual stream and at which margin.

The read-ahead (`--prefetch` in sparse mode) predicts layer l+1's neurons before layer l+1's FFN
input exists. This measures, per layer and decode token, the share of the layer's own prediction
(from its exact FFN input) that a lookahead names, and how many neurons it names per exact one:

- after attention: layer l+1's predictor on the residual stream after layer l's attention, normed
  as layer l+1 norms its FFN input (what the runtime does; the read overlaps layer l's FFN and
  layer l+1's attention);
- layer output: on layer l's output, after its FFN (one sublayer closer, but the read can only
  overlap layer l+1's attention); sequential (non-parallel) blocks without post-norms only;

each at the predictor's threshold and at a margin of 1 and 2 logits below it (more neurons, more
recall, more bytes). Low-rank predictors (their scores are logits).

Per layer it also records how the lookahead's score ranks its neurons: recall and precision of the
neurons scored above each of a ladder of cuts (the runtime reads ahead only those above the lowest cut
whose running precision is >= 0.9: ReadAhead.CUTS), and, for `--json-out`, the score distribution
of the layer's needed neurons (quantiles) and the count of the others above each cut per needed neuron,
which bench/io/runtime.py's `--lookahead-model` replays on the 7B shape (bench/models/activation_trace.py TracePredictor).

    python -m bench io lookahead [MODEL_DIR] --tokens 48 --markdown bench/results/io/lookahead.md
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np
from bench.harness import command_line


MARGINS = (0.0, 1.0, 2.0)
GRID = (-4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)  # score cuts recorded
QUANTILES = 101  # of the needed neurons' lookahead scores, per layer


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="model directory (default: the embedded model, demo settings)")
    p.add_argument("--tokens", type=int, default=48, help="decode tokens (default: %(default)s)")
    p.add_argument("--markdown", help="also write the report here")
    p.add_argument("--json-out", help="also write recall and size per layer here (JSON), e.g. for "
                   "bench/io/runtime.py --lookahead-model")
    return p


def measure(model_dir, settings: dict, prompt: str, tokens: int) -> dict:
    """{source: {margin: (recall per layer, predicted per exact neuron per layer)}}; layer 0 has none."""
    import flashllm
    from flashllm.modes.sparse.predictor import predict_scored

    model = flashllm.load(model_dir, mode="sparse", predictor="lowrank", **settings)
    spec, B, pred = model.spec, model.backend, model.mode_impl.predictor
    if spec.parallel_attn or spec.post_norms:
        raise SystemExit("io_lookahead: sequential blocks without post-norms only")
    L = spec.n_layers
    seen: dict[int, dict] = {}
    model.hooks.add("ffn_input", lambda layer, x: seen.__setitem__(layer, {"attn": model.mode_impl.read_ahead.residual}))
    model.hooks.add("ffn_output", lambda layer, y: seen[layer].__setitem__(
        "out", None if seen[layer]["attn"] is None else seen[layer]["attn"] + y))
    exact: dict[int, np.ndarray] = {}
    model.hooks.add("predict", lambda layer, mask: exact.__setitem__(layer, mask[-1].copy()))
    counts = {(src, m): np.zeros((L, 3)) for src in ("attn", "out") for m in MARGINS}
    grid = np.asarray(GRID)[:, None]
    ladder = {src: np.zeros((L, 2, len(GRID))) for src in ("attn", "out")}  # needed / all neurons above each cut
    needed_scores = {src: [[] for _ in range(L)] for src in ("attn", "out")}
    steps = model.generate_ids(model.tokenizer.encode(prompt), tokens)
    next(steps)  # the prompt
    for _ in steps:
        for layer in range(1, L):
            for src in ("attn", "out"):
                scores = predict_scored(pred, layer, B.norm(f"layers.{layer}.ffn_norm", seen[layer - 1][src]))[1][-1]
                need = exact[layer]
                for m in MARGINS:
                    guess = scores > -m
                    counts[src, m][layer] += [(guess & need).sum(), need.sum(), guess.sum()]
                above = scores[None, :] > grid
                ladder[src][layer] += [(above & need).sum(axis=1), above.sum(axis=1)]
                needed_scores[src][layer].append(scores[need])
    out = {k: (c[:, 0] / np.maximum(c[:, 1], 1), c[:, 2] / np.maximum(c[:, 1], 1)) for k, c in counts.items()}
    active = counts["attn", 0.0][:, 1]  # needed neurons per layer, summed over the tokens
    out["ladder"] = {src: {"grid": list(GRID), "layers": [None] + [{
        "recall": (lad[layer, 0] / max(active[layer], 1)).tolist(),
        "precision": (lad[layer, 0] / np.maximum(lad[layer, 1], 1)).tolist(),
        "named_per_needed": (lad[layer, 1] / max(active[layer], 1)).tolist(),
        "needed_quantiles": np.quantile(np.clip(np.concatenate(needed_scores[src][layer]), -30, 30),
                                        np.linspace(0, 1, QUANTILES)).tolist() if active[layer] else None}
        for layer in range(1, L)]} for src, lad in ladder.items()}
    return out


def markdown(res: dict, command: str, tokens: int, model_dir) -> str:
    L = len(next(iter(res.values()))[0])
    names = {"attn": "after layer l's attention (runtime)", "out": "layer l's output (after its FFN)"}
    lines = [f"# Lookahead recall per layer ({datetime.datetime.now().isoformat(timespec='seconds')})", "",
             f"- command: `{command}`", f"- model: `{model_dir}`, {tokens} greedy decode tokens, low-rank predictors",
             "- recall: share of layer l+1's predicted neurons (from its exact FFN input) that the lookahead names; "
             "size: neurons the lookahead names per exact one (what it would read, before the cache)", "",
             "| source | margin (logits) | " + " | ".join(f"layer {i}" for i in range(1, L)) + " | mean recall | mean size |",
             "|---|---|" + "---|" * (L + 1)]
    for key, (rec, size) in res.items():
        if key == "ladder":
            continue
        src, m = key
        cells = " | ".join(f"{r:.2f} ({s:.2f}x)" for r, s in zip(rec[1:], size[1:]))
        lines.append(f"| {names[src]} | {m:g} | {cells} | {rec[1:].mean():.2f} | {size[1:].mean():.2f}x |")
    for src, lad in res["ladder"].items():
        cuts = [k for k, c in enumerate(lad["grid"]) if c >= -1]
        lines += ["", f"Recall / precision of the neurons scored above each cut, {names[src]} (the runtime reads ahead "
                  "those above the lowest cut whose running precision is >= 0.9):", "",
                  "| cut (logits) | " + " | ".join(f"layer {i}" for i in range(1, L)) + " |", "|---|" + "---|" * (L - 1)]
        for k in cuts:
            lines.append(f"| {lad['grid'][k]:g} | " + " | ".join(
                f"{d['recall'][k]:.2f} / {d['precision'][k]:.2f}" for d in lad["layers"][1:]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = setup_arg_parser().parse_args(argv)
    import torch

    from flashllm.cli import demo

    torch.set_num_threads(1)
    if args.model_dir:
        model_dir, settings = Path(args.model_dir), {}
    else:
        model_dir, settings = demo.prepare(), dict(demo.SETTINGS, dram_budget=0.5, window=4)
    res = measure(model_dir, settings, demo.PROMPT, args.tokens)
    md = markdown(res, command_line("bench.io.lookahead", argv),
                  args.tokens, model_dir)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model_dir": str(model_dir), "tokens": args.tokens, "sources": {
            f"{k[0]}/{k[1]:g}": {"recall": v[0].tolist(), "size": v[1].tolist()} for k, v in res.items() if k != "ladder"},
            "ladder": res["ladder"]}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
