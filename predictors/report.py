"""`predictors eval` output: the human report of one evaluation, and the quality-vs-memory sweep
as a markdown table, JSON and a PNG plot (ppl ratio and top-1 agreement vs DRAM budget, beside
flash bytes and latency per token): what a user needs to pick a budget."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

MiB = 2**20


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / MiB:.3f} MiB"


def _size(b) -> str:
    """Bytes in the unit that shows them (a warm cache reads a few KiB per token, naive mode MiB)."""
    if b is None:
        return "n/a"
    return f"{b / MiB:.3f} MiB" if b >= MiB else f"{b / 1024:.2f} KiB" if b >= 1024 else f"{b:.0f} B"


def _flash_ratio(p: dict) -> str:
    """Sparse flash bytes against naive mode's. With an unlimited budget every cache holds all its
    layer's neurons, so a token reads only the neurons no earlier token used: no steady-state ratio."""
    if p.get("naive_over_sparse") is None:
        return "n/a"
    if p["budget_bytes"] is None:
        return "unlimited budget: only each neuron's first use reads it"
    return f"{p['naive_over_sparse']:.1f}x fewer than naive"


def _budget(p: dict) -> str:
    b = p.get("dram_budget")
    return "unlimited" if b is None else (str(b) if b <= 1 else f"{b / MiB:.1f} MiB")


def format_point(p: dict) -> list[str]:
    """The lines for one evaluated budget."""
    head = f"at DRAM budget {_budget(p)}"
    if "refused" in p:
        return [f"{head}: refused by the runtime: {p['refused']}"]
    held = "unlimited" if p["budget_bytes"] is None else _mib(p["budget_bytes"])
    lines = [
        f"{head} ({held}; predictor {p['predictor']}; DRAM held {_mib(p['dram_bytes'])}; cache rows per layer "
        f"{p['cache_capacity']}):",
        f"  perplexity: dense {p['ppl_dense']:.4f}  sparse {p['ppl_sparse']:.4f}  ({(p['ppl_ratio'] - 1) * 100:+.2f}%)",
        f"  greedy top-1 agreement: {p['top1_agreement'] * 100:.1f}% over {p['top1_agreement_tokens']} tokens "
        f"(held-out text {p['top1_agreement_heldout'] * 100:.1f}%; free-running {p['free_run_agreement'] * 100:.1f}%, "
        f"first divergence at {p['free_run_first_divergence']})",
        f"  neurons dropped per token: {p['neurons_dropped_per_token']:.1f}; flash read per token "
        f"{_size(p['bytes_per_token'])} ({_flash_ratio(p)}); latency {p['latency_ms_per_token']:.2f} ms/token "
        f"(I/O {p['io_ms_per_token']:.2f})",
        "  computed at this budget (cache rows vs true mask), per layer: " + "  ".join(
            f"{x['layer']}: recall {x['recall']:.3f} precision {x['precision']:.3f}" for x in p["computed_layers"]),
    ]
    return lines


def format_report(r: dict) -> str:
    """One evaluation (one or more budgets) as a few lines and the per-layer predictor table."""
    pt = r["predicted_over_true"]
    lines = [
        f"{r['model_dir']} on {r['data']}: {r['tokens']} tokens, {r['scored_tokens']} scored; compute dtype "
        f"{r['dtype']}, window {r['window']}",
        f"active iff {r['activation_rule']}",
        f"predictors (dense pass): recall {r['recall']:.4f}  precision {r['precision']:.4f}  predicted/true "
        f"{'n/a' if pt is None else round(pt, 3)}  (predicted {r['predicted_fraction']:.3f} of neurons, "
        f"true {r['true_fraction']:.3f})",
        f"naive mode reads {_mib(r['bytes_per_token_naive'])} per token",
    ]
    for p in r["points"]:
        lines += format_point(p)
    lines += ["", f"{'layer':>5} {'rank':>5} {'threshold':>10} {'recall':>7} {'precision':>9} {'predicted':>9} "
                  f"{'true':>6} {'pred/true':>9}"]
    for x in r["layers"]:
        ratio = "n/a" if x["predicted_over_true"] is None else f"{x['predicted_over_true']:.2f}"
        lines.append(f"{x['layer']:>5} {x['rank']:>5} {x['threshold']:>10.3g} {x['recall']:>7.4f} "
                     f"{x['precision']:>9.4f} {x['predicted_fraction']:>9.4f} {x['true_fraction']:>6.3f} {ratio:>9}")
    return "\n".join(lines)


def sweep_table(results: list[dict]) -> str:
    """Markdown: one row per (dtype, budget)."""
    rows = ["| dtype | `--dram-budget` | DRAM held | cache rows / layer | dropped / token | ppl dense → sparse "
            "| top-1 | recall computed | flash read / token | latency / token |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for p in r["points"]:
            if "refused" in p:
                rows.append(f"| {r['dtype']} | {_budget(p)} | refused: {p['refused']} |||||||| ")
                continue
            caps = p["cache_capacity"]
            rows.append(
                f"| {r['dtype']} | {_budget(p)} | {p['dram_bytes'] / MiB:.2f} MiB | {min(caps)}–{max(caps)} | "
                f"{p['neurons_dropped_per_token']:.0f} | {p['ppl_dense']:.2f} → {p['ppl_sparse']:.2f} "
                f"(x{p['ppl_ratio']:.3f}) | {p['top1_agreement'] * 100:.1f}% | {p['computed_recall']:.3f} | "
                f"{p['bytes_per_token'] / 1024:.0f} KiB | {p['latency_ms_per_token']:.1f} ms |")
    return "\n".join(rows)


def _write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_sweep(results: list[dict], path: Path) -> None:
    """2x2 panels vs DRAM budget: ppl ratio, top-1 agreement, flash bytes and latency per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("ppl_ratio", "perplexity sparse / dense", 1), ("top1_agreement", "greedy top-1 agreement (%)", 100),
              ("bytes_per_token", "flash read per token (KiB)", 1 / 1024),
              ("latency_ms_per_token", "latency per token (ms)", 1)]
    for ax, (key, label, scale) in zip(axes.flat, panels):
        for k, r in enumerate(results):
            ok = [p for p in r["points"] if "refused" not in p and p["dram_budget"] is not None]
            line, = ax.plot([p["dram_budget"] for p in ok], [p[key] * scale for p in ok], "o-", label=r["dtype"])
            refused = [p["dram_budget"] for p in r["points"] if "refused" in p and p["dram_budget"] is not None]
            if refused:  # at the bottom of the panel, one row per dtype: the runtime refuses these budgets
                ax.plot(refused, [0.04 + 0.05 * k] * len(refused), "x", color=line.get_color(),
                        transform=ax.get_xaxis_transform(), label=f"{r['dtype']}: refused")
        ax.set_xlabel("--dram-budget (fraction of the model on flash)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0, 0].axhline(1.02, color="gray", ls="--", lw=0.8)
    axes[0, 1].axhline(95, color="gray", ls="--", lw=0.8)
    axes[0, 0].legend()
    fig.suptitle(f"quality vs memory: {Path(results[0]['model_dir']).name}, window {results[0]['window']}")
    fig.tight_layout()
    _write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)


def check_out_prefix(prefix: str | Path) -> Path:
    """`--out PREFIX` whose directory exists (checked before a sweep of minutes to hours, and again on writing)."""
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        from flashllm.errors import FlashLLMError
        raise FlashLLMError(f"--out {prefix}: directory {prefix.parent} does not exist")
    return prefix


def write_sweep(results: list[dict], prefix: str | Path, command: str) -> list[Path]:
    """PREFIX.json (every figure), PREFIX.md (the table and the command) and PREFIX.png (where
    matplotlib is installed: the `bench` extra). Returns the paths written."""
    prefix = check_out_prefix(prefix)
    paths = [prefix.with_suffix(".json"), prefix.with_suffix(".md"), prefix.with_suffix(".png")]
    _write(paths[0], lambda p: p.write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n"))
    r0 = results[0]
    gen = next((p["top1_agreement_tokens"] for r in results for p in r["points"] if "refused" not in p), 0)
    md = (f"# Quality vs memory: {r0['model_dir']}\n\n```\n{command}\n```\n\n"
          f"{r0['tokens']} held-out tokens of {r0['data']} ({r0['scored_tokens']} scored), window {r0['window']}; "
          f"ppl against the dense model in the same dtype; top-1 over {gen} greedy tokens.\n\n"
          + sweep_table(results) + f"\n\n![quality vs memory]({paths[2].name})\n")
    _write(paths[1], lambda p: p.write_text(md))
    if importlib.util.find_spec("matplotlib") is None:
        return paths[:2]
    plot_sweep(results, paths[2])
    return paths
