"""The paper benchmark's plots (matplotlib, PNG): Table 3 time split, Figure 7 window sweep, Figure 8 I/O per token."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(report: dict, out_dir: Path, prefix: str = "paper_") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if report["table3"]:
        rows = [r for r in report["table3"] if r["backend"] == "torch"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in rows]
        bottom = np.zeros(len(rows))
        for key, label in (("io_ms", "I/O"), ("mem_ms", "memory mgmt"), ("compute_ms", "compute"),
                           ("predictor_ms", "predictor")):
            vals = np.array([r[key] for r in rows]) / 1e3
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom += vals
        ax.set_ylabel("seconds per token")
        ax.set_title("Table 3 analogue: time per decode token")
        ax.legend()
        paths.append(_save(plt, fig, out_dir / f"{prefix}table3.png"))
    if report["fig7"]:
        rows = report["fig7"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        w = [r["window"] for r in rows]
        ax.plot(w, [r["total_ms"] for r in rows], "o-", label="latency (total)")
        ax.plot(w, [r["io_ms"] for r in rows], "s--", label="I/O")
        ax.set_xlabel("window size (tokens)")
        ax.set_ylabel("ms per token")
        ax2 = ax.twinx()
        ax2.plot(w, [r["dram_gb"] for r in rows], "^-", color="tab:green", label="DRAM in use")
        ax2.set_ylabel("DRAM in use (GB)")
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper center")
        ax.set_title("Figure 7 analogue: window size vs DRAM vs latency")
        paths.append(_save(plt, fig, out_dir / f"{prefix}fig7.png"))
    if report["fig8"]:
        rows = report["fig8"]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        t = [r["token"] for r in rows]
        io = np.array([r["io_ms"] for r in rows])
        ax.plot(t, io, lw=0.6, alpha=0.6, label="I/O latency per token")
        k = min(25, len(io))
        if k > 1:
            ax.plot(t[k - 1:], np.convolve(io, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k}")
        ax.set_xlabel("generated token")
        ax.set_ylabel("I/O ms")
        ax.set_yscale("log")
        ax.set_title("Figure 8 analogue: I/O latency per token")
        ax.legend()
        paths.append(_save(plt, fig, out_dir / f"{prefix}fig8.png"))
    return paths


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
