"""The paper benchmark's report: Table 2/3 and Figure 7/8 rows from the measured runs, the ratios and
targets, the markdown text, and the description of the setting (machine, code, model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.harness import GB, number
from bench.models import activation_trace as tr


# -- tables ------------------------------------------------------------------------------------
TABLE2 = [("naive", "naive", (0, 0, 0, 0)), ("hybrid", "hybrid", (1, 0, 0, 0)),
          ("hybrid+predictor", "hybrid+predictor", (1, 1, 0, 0)), ("+windowing", "+windowing", (1, 1, 1, 0)),
          ("+bundling", "all", (1, 1, 1, 1))]


def _ok(r) -> bool:
    return r is not None and "error" not in r


def table2_rows(results: dict) -> list[dict]:
    rows = []
    for config, key, flags in TABLE2:
        r = results.get(key)
        if not _ok(r):
            continue
        rows.append({"config": config, "hybrid": bool(flags[0]), "predictor": bool(flags[1]),
                     "windowing": bool(flags[2]), "bundling": bool(flags[3]),
                     "window": r["run"].get("window"), "bundled_layout": r["bundled"],
                     "dram_gb": r["dram_in_use"] / GB, "dram_allocated_gb": r["dram_bytes"] / GB,
                     "flash_gb_per_token": r["bytes_read"] / GB,
                     "throughput_gbs": r["bytes_read"] / GB / (r["io_ms"] / 1e3) if r["io_ms"] else None,
                     "io_ms": r["io_ms"], "read_ms": r["read_ms"], "reads_per_token": r["reads"],
                     "neurons_dropped_per_token": r["neurons_dropped"], "tokens": r["decode_tokens"]})
    return rows


def table3_rows(results: dict, backends: list[str]) -> list[dict]:
    rows = []
    for backend in backends:
        suffix = "" if backend == "torch" else f"@{backend}"
        for config in ("naive", "hybrid", "all"):
            r = results.get(config + suffix)
            if not _ok(r):
                continue
            rows.append({"config": config, "backend": backend, "compute_dtype": r["compute_dtype"],
                         "io_ms": r["io_ms"], "read_ms": r["read_ms"], "mem_ms": r["mem_ms"],
                         "compute_ms": r["compute_ms"], "predictor_ms": r["predictor_ms"], "total_ms": r["total_ms"],
                         "flash_gb_per_token": r["bytes_read"] / GB, "dram_gb": r["dram_in_use"] / GB,
                         "dram_allocated_gb": r["dram_bytes"] / GB, "gpu_gb": r.get("gpu_bytes", 0) / GB,
                         "device": r.get("device", "cpu"), "tokens": r["decode_tokens"]})
    return rows


def fig7_rows(results: dict, windows: list[int], k: int) -> list[dict]:
    rows = []
    for w in windows:
        r = results.get("all" if w == k else f"window {w}")
        if not _ok(r):
            continue
        rows.append({"window": w, "dram_gb": r["dram_in_use"] / GB, "flash_gb_per_token": r["bytes_read"] / GB,
                     "io_ms": r["io_ms"], "total_ms": r["total_ms"], "mem_ms": r["mem_ms"],
                     "cached_fraction": r["neurons_cached"] / (r["n_layers"] * r["d_ffn"]),
                     "neurons_dropped_per_token": r["neurons_dropped"],
                     "tokens": r["decode_tokens"]})
    return rows


def fig8_rows(results: dict) -> list[dict]:
    r = results.get("fig8")
    if not _ok(r):
        return []
    return [{"token": i + 1, "io_ms": c["io_ms"], "read_ms": c["read_ms"], "flash_gb": c["bytes_read"] / GB,
             "total_ms": c["total_ms"]} for i, c in enumerate(r["per_token"])]


def ratios(t3: list[dict]) -> dict:
    by = {(r["backend"], r["config"]): r for r in t3}
    out = {}
    for backend in sorted({r["backend"] for r in t3}):
        a = by.get((backend, "all"))
        if a is None:
            continue
        for other in ("naive", "hybrid"):
            o = by.get((backend, other))
            if o is not None:
                out[f"{other}/all{'' if backend == 'torch' else '@' + backend}"] = {
                    "total": o["total_ms"] / a["total_ms"], "io_ms": o["io_ms"] / max(a["io_ms"], 1e-9),
                    "flash_bytes": o["flash_gb_per_token"] / max(a["flash_gb_per_token"], 1e-12)}
    return out


def trace_report(path, manifest, windows: list[int]) -> dict:
    """The trace's per-layer statistics, and the flash traffic they imply for this model if the neuron
    caches could hold every window's union (no DRAM limit): the floor for the sparse rows."""
    trace = tr.Trace.load(path)
    summary = trace.summary(windows=windows)
    spec, lay = manifest.spec, manifest.layout
    lmap = tr.layer_map(trace.n_layers, spec.n_layers)
    per_token = lay.d_ffn * lay.stride / GB
    implied = {str(k): sum(summary[f"new_w{k}"][s] for s in lmap) * per_token for k in windows}
    held = {str(k): [summary[f"held_w{k}"][s] for s in lmap] for k in windows}
    meta = {k: v for k, v in trace.meta.items() if k != "summary"}
    return {"meta": meta, "summary": summary, "layer_map": lmap, "unlimited_flash_gb_per_token": implied,
            "held_fraction_per_layer": held}




class Units:
    """Sizes in GB for a model of at least 1 GB, else in MB (the JSON is in GB either way)."""

    def __init__(self, model_gb: float):
        self.scale, self.name = (1.0, "GB") if model_gb >= 1 else (1e3, "MB")

    def __call__(self, x, nd=2) -> str:
        return number(None if x is None else x * self.scale, nd)


YES = {True: "✓", False: "✗"}


def markdown(report: dict) -> str:
    """The report as markdown: the setting, then one section per table or figure, then the runs."""
    g = Units(report["meta"]["model_gb"])
    sections = (_setting, _table2, _table3, _profile, _fig7, _fig8, _trace, _runs)
    return "\n".join(line for section in sections for line in section(report, g)) + "\n"


def _setting(report: dict, g: Units) -> list[str]:
    m, L, U = report["meta"], [], g.name
    L.append("# LLM in a flash on this machine: Tables 2 and 3, Figures 7 and 8\n")
    L.append(f"- date: {m['date']}")
    L.append(f"- command: `{m['command']}`")
    L.append(f"- machine: {m['machine']}")
    if m.get("code"):
        L.append(f"- code: {m['code']}")
    L.append(f"- model: `{m['model_dir']}`: {m['model_desc']}")
    L.append(f"- DRAM budget: {m['budget_gb']:.2f} GB ({m['budget_arg']} of {m['model_gb']:.2f} GB); the runtime "
             "counts resident weights (in the compute dtype), KV cache, neuron caches and predictors against it")
    if m.get("gpu_budget_arg") is not None:
        L.append(f"- GPU budget: {m['gpu_budget_arg']} of the model: resident weights, KV cache and neuron caches live "
                 "in GPU memory and count against it (the DRAM budget then covers host staging; the DRAM columns "
                 "below count what the runtime holds on the GPU)")
    L.append(f"- compute: {m['compute']}")
    L.append(f"- active neurons: {m['active_method']}")
    L.append(f"- memory limit: {m['memory_limit']}")
    L.append(f"- page cache: {m['page_cache']}")
    L.append(f"- tokens: {m['tokens_desc']}")
    L.append(f"- units: {U} = 10^{9 if U == 'GB' else 6} bytes; ms per decode token; \"I/O latency\" is the runtime's io_ms (flash reads "
             "plus, for sparse runs, placing the read rows into the cache matrix: with float16 storage and bfloat16 "
             "compute that includes the conversion); \"reads\" is the I/O engine's own wall time for the reads alone")
    L.append("")
    return L


def _table2(report: dict, g: Units) -> list[str]:
    L, U, yes = [], g.name, YES
    L.append("## Table 2 analogue: flash→DRAM traffic per configuration\n")
    L.append(f"| configuration | hybrid | predictor | windowing | bundling | DRAM in use ({U}) | DRAM allocated ({U}) | "
             f"flash→DRAM ({U}/token) | throughput (GB/s) | I/O latency (ms) | reads (ms) | reads/token | "
             "dropped neurons/token | tokens |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["table2"]:
        L.append(f"| {r['config']} | {yes[r['hybrid']]} | {yes[r['predictor']]} | {yes[r['windowing']]} | "
                 f"{yes[r['bundling']]} | {g(r['dram_gb'])} | {g(r['dram_allocated_gb'])} | "
                 f"{g(r['flash_gb_per_token'], 3)} | {number(r['throughput_gbs'], 2)} | {number(r['io_ms'], 0)} | "
                 f"{number(r['read_ms'], 0)} | {number(r['reads_per_token'], 0)} | {number(r['neurons_dropped_per_token'], 0)} | "
                 f"{r['tokens']} |")
    L.append("\nDRAM in use: resident weights + KV cache + predictors + the neuron-cache rows holding neurons "
             "(mean over the measured tokens); allocated: what the runtime reserves (caches at full capacity).")
    return L


def _table3(report: dict, g: Units) -> list[str]:
    """Table 3, the ratios between its rows and the paper's targets."""
    L, U, yes = [], g.name, YES
    L.append("\n## Table 3 analogue: where a decode token's time goes\n")
    L.append(f"| configuration | backend | compute dtype | flash→DRAM ({U}) | I/O (ms) | memory mgmt (ms) | compute (ms) | "
             f"predictor (ms) | total (ms) | DRAM ({U}) | tokens |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["table3"]:
        L.append(f"| {r['config']} | {r['backend']} | {r['compute_dtype']} | {g(r['flash_gb_per_token'], 3)} | "
                 f"{number(r['io_ms'], 0)} | {number(r['mem_ms'], 1)} | {number(r['compute_ms'], 0)} | {number(r['predictor_ms'], 1)} | "
                 f"{number(r['total_ms'], 0)} | {g(r['dram_gb'])} | {r['tokens']} |")
    L.append("")
    for name, v in report["ratios"].items():
        L.append(f"- {name}: {v['total']:.2f}× end-to-end, {v['io_ms']:.1f}× I/O time, "
                 f"{v['flash_bytes']:.1f}× flash bytes per token")
    if report.get("notes_table3"):
        L.append("")
        L += [f"- {n}" for n in report["notes_table3"]]
    if report.get("targets"):
        L.append("\n## Targets (paper, CPU) vs this run\n")
        L.append("| target | paper | this run | met |")
        L.append("|---|---|---|---|")
        for t in report["targets"]:
            L.append(f"| {t['what']} | {t['paper']} | {t['here']} | {yes[t['met']] if t['met'] is not None else '-'} |")
    return L


def _profile(report: dict, g: Units) -> list[str]:
    L = []
    prof = (report["runs"].get("all") or {}).get("profile")
    if prof:
        L.append("\n## Where the \"all\" token goes (cProfile of the measured tokens, main thread)\n")
        L.append("| function | calls/token | own ms/token | cumulative ms/token |")
        L.append("|---|---|---|---|")
        for r in prof[:15]:
            L.append(f"| `{r['function']}` | {r['calls_per_token']:.0f} | {r['own_ms_per_token']:.1f} | "
                     f"{r['cumulative_ms_per_token']:.1f} |")
    return L


def _fig7(report: dict, g: Units) -> list[str]:
    L, U = [], g.name
    if report["fig7"]:
        L.append("\n## Figure 7 analogue: window size vs DRAM vs latency (bundled)\n")
        L.append(f"| window | DRAM in use ({U}) | flash→DRAM ({U}/token) | I/O (ms) | memory mgmt (ms) | total (ms) | "
                 "FFN held in cache | dropped neurons/token | tokens |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in report["fig7"]:
            L.append(f"| {r['window']} | {g(r['dram_gb'])} | {g(r['flash_gb_per_token'], 3)} | {number(r['io_ms'], 0)} | "
                     f"{number(r['mem_ms'], 1)} | {number(r['total_ms'], 0)} | {r['cached_fraction']:.1%} | "
                     f"{number(r['neurons_dropped_per_token'], 0)} | {r['tokens']} |")
    return L


def _fig8(report: dict, g: Units) -> list[str]:
    L, U = [], g.name
    if report["fig8"]:
        f8 = report["fig8"]
        io = np.array([r["io_ms"] for r in f8])
        L.append(f"\n## Figure 8 analogue: I/O latency over {len(f8)} generated tokens (all, window "
                 f"{report['meta']['window']})\n")
        L.append(f"| tokens | mean I/O (ms) | median | p90 | mean flash→DRAM ({U}) | mean total (ms) |")
        L.append("|---|---|---|---|---|---|")
        edges = [0, 1, 10, 100, len(f8)] if len(f8) > 100 else [0, 1, len(f8)]
        edges = sorted(set(e for e in edges if e <= len(f8)))
        for a, b in zip(edges, edges[1:]):
            part = f8[a:b]
            v = io[a:b]
            L.append(f"| {a + 1}–{b} | {number(float(v.mean()), 0)} | {number(float(np.median(v)), 0)} | "
                     f"{number(float(np.percentile(v, 90)), 0)} | {g(sum(r['flash_gb'] for r in part) / len(part), 3)} | "
                     f"{number(sum(r['total_ms'] for r in part) / len(part), 0)} |")
    return L


def _trace(report: dict, g: Units) -> list[str]:
    """The activation trace's per-layer statistics and what they imply at this budget."""
    L, U = [], g.name
    if report.get("trace"):
        t, sm = report["trace"], report["trace"]["summary"]
        k = report["meta"]["window"]
        L.append("\n## The activation trace\n")
        L.append(f"{t['meta']['tokens']} tokens of `{Path(t['meta']['data']).name}` decoded by `{t['meta']['model']}` "
                 f"({t['meta']['predictor']} predictor), recorded {t['meta']['date']}. Per layer of the small model:\n")
        L.append(f"| small layer | large layers | active | new/token w1 | new/token w{k} | held w{k} | recall | "
                 "predicted/true |")
        L.append("|---|---|---|---|---|---|---|---|")
        lmap = t["layer_map"]
        for i, a in enumerate(sm["active"]):
            large = [j for j, s_ in enumerate(lmap) if s_ == i]
            rng_ = f"{large[0]}–{large[-1]}" if large else "-"
            rec = sm.get("recall", [None] * len(sm["active"]))[i]
            pot = sm.get("predicted_over_true", [None] * len(sm["active"]))[i]
            L.append(f"| {i} | {rng_} | {a:.1%} | {sm['new_w1'][i]:.1%} | {sm[f'new_w{k}'][i]:.1%} | "
                     f"{sm[f'held_w{k}'][i]:.1%} | {number(rec, 3)} | {number(pot, 2)} |")
        imp = t["unlimited_flash_gb_per_token"]
        L.append("\nWith caches large enough for every window (no DRAM limit), this trace implies per token: " +
                 ", ".join(f"window {w}: {g(v, 3)} {U}" for w, v in imp.items()) + ".")
        cap = next((r for r in report["runs"].values() if _ok(r) and r["run"]["mode"] == "sparse"), None)
        if cap:
            need = max(t["held_fraction_per_layer"][str(k)])
            L.append(f"At this budget each layer's cache holds {cap['cache_capacity']} neurons "
                     f"({cap['cache_capacity'] / cap['d_ffn']:.1%} of the FFN, the same for every layer); the union of "
                     f"the last {k} tokens needs up to {need:.1%} in the densest layers, so there the window shrinks "
                     "and, when even one token's set does not fit, neurons are dropped (counted above).")
    return L


def _runs(report: dict, g: Units) -> list[str]:
    """The plots, failed runs and every run's setting."""
    L, U = [], g.name
    if report.get("plots"):
        L.append("\n## Plots\n")
        L += [f"![{Path(p).stem}]({Path(p).name})" for p in report["plots"]]
    failed = [f"{name}: {r['error']}" for name, r in report["runs"].items() if not _ok(r)]
    if failed:
        L.append("\n## Failed runs\n")
        L += [f"- {f}" for f in failed]
    L.append("\n## Runs\n")
    L.append(f"| run | mode | window | layout | load (s) | tokens (warm-up+measured) | peak RSS ({U}) | cgroup peak ({U}) | "
             "page cache at start | machine load average at start |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        if not _ok(r):
            continue
        cg = (r.get("cgroup_usage") or {}).get("peak_bytes")
        pc = r.get("page_cache_at_start")
        L.append(f"| {name} | {r['run']['mode']} | {r['run'].get('window') or '-'} | "
                 f"{'bundled' if r['bundled'] else 'unbundled'} | {number(r['load_s'], 1)} | "
                 f"{r['warmup_tokens']}+{r['decode_tokens']} | {g((r.get('rss_peak') or 0) / GB)} | "
                 f"{g(cg / GB) if cg else '-'} | {'-' if pc is None else f'{pc:.1%}'} | "
                 f"{number(r.get('load_average_at_start'), 1)} |")
    return L


def targets(report: dict) -> list[dict]:
    t3 = {(r["backend"], r["config"]): r for r in report["table3"]}
    a, n = t3.get(("torch", "all")), t3.get(("torch", "naive"))
    out = []
    if a:
        out.append({"what": "flash→DRAM per token (all)", "paper": "13.4 GB → ≤ 0.3 GB",
                    "here": f"{n['flash_gb_per_token']:.1f} GB → {a['flash_gb_per_token']:.3f} GB" if n else
                    f"{a['flash_gb_per_token']:.3f} GB", "met": a["flash_gb_per_token"] <= 0.3})
    if a and n:
        x = n["total_ms"] / a["total_ms"]
        out.append({"what": "end-to-end speed-up over naive", "paper": "≥ 4.8×", "here": f"{x:.2f}×", "met": x >= 4.8})
    if a:
        share = a["mem_ms"] / a["total_ms"]
        out.append({"what": "memory management share of token time (all)", "paper": "≤ 10%",
                    "here": f"{share:.1%} ({a['mem_ms']:.1f} of {a['total_ms']:.0f} ms)", "met": share <= 0.10})
    return out


# -- description of the setting ----------------------------------------------------------------
def model_desc(manifest, model_bytes: int) -> str:
    s, src = manifest.spec, manifest.data.get("source", {})
    ffn = manifest.data["files"]["ffn"]["size"]
    weights = "random weights (" + src["path"] + ")" if src.get("random_weights") else f"from {src.get('path')}"
    return (f"{s.family}, {s.n_layers} layers, d_model {s.d_model}, FFN {s.d_ffn} ({s.activation}), vocab "
            f"{s.vocab_size}, {manifest.data['dtype']}, {model_bytes / GB:.2f} GB on flash (resident "
            f"{(model_bytes - ffn) / GB:.2f} GB + FFN {ffn / GB:.2f} GB, bundle {manifest.layout.bundle_bytes} bytes); "
            f"{weights}")
