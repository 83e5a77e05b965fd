"""bench/peers/run.py's pure parts: reading llama-bench's and accelerate_decode.py's output, the outcome of
a run, the summary per configuration with flashllm/peer ratios, and the markdown report (no I/O here)."""

from __future__ import annotations

import json

from bench.harness import GB


# -- pure parts: parsing, outcome, ratios, table -------------------------------------------------
def parse_llama_bench(stdout: str) -> dict:
    """llama-bench -o json: the token-generation test's mean ms per token, and what llama-bench says it ran."""
    tests = [t for t in json.loads(stdout) if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not tests:
        raise ValueError("llama-bench printed no token-generation test")
    t = tests[0]
    n = t["n_gen"]
    return {"ms_per_token": t["avg_ns"] / n / 1e6, "tokens": n * len(t.get("samples_ns") or [1]),
            "token_ms": [ns / n / 1e6 for ns in t.get("samples_ns") or [t["avg_ns"]]],
            "build": f"{t.get('build_commit')} (build {t.get('build_number')})", "threads": t.get("n_threads"),
            "model_type": t.get("model_type"), "model_size": t.get("model_size")}


def parse_progress(text: str) -> dict:
    """bench/peers/accelerate_decode.py's JSON lines: load facts, each decode token's ms, whether it finished."""
    out = {"token_ms": [], "done": False}
    for line in text.splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        kind = event.pop("event")
        if kind == "token":
            out["token_ms"].append(event["ms"])
        elif kind == "load":
            out.update(event)
        elif kind == "done":
            out.update(event, done=True)
    if out["token_ms"]:
        out["ms_per_token"] = sum(out["token_ms"]) / len(out["token_ms"])
        out["tokens"] = len(out["token_ms"])
    return out


def outcome(returncode: int | None, timed_out: bool, oom_kills: int | None) -> str:
    """ran / OOM-killed / timeout / error, from how the child ended and the group's oom_kill counter."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ran"
    if oom_kills or returncode in (-9, 137):  # SIGKILL with no OOM counter: the kernel's OOM killer all the same
        return "OOM-killed"
    return "error"


def summarize(runs: list[dict]) -> list[dict]:
    """One row per configuration: mean ms/token over its rounds that measured tokens, range, outcomes."""
    rows: dict[str, dict] = {}
    for r in runs:
        row = rows.setdefault(r["label"], {"label": r["label"], "peer": r["peer"], "values": [], "outcomes": [],
                                           "peaks": []})
        row["outcomes"].append(r["outcome"] + (f" ({r['tokens']} tokens)" if r["outcome"] == "timeout"
                                                and r.get("tokens") else ""))
        if r.get("ms_per_token") is not None:
            row["values"].append(r["ms_per_token"])
        if r.get("cgroup_peak") is not None:
            row["peaks"].append(r["cgroup_peak"])
    for row in rows.values():
        v = row["values"]
        row["ms_per_token"] = sum(v) / len(v) if v else None
        row["range"] = (min(v), max(v)) if v else None
        row["peak_bytes"] = max(row["peaks"]) if row["peaks"] else None
    return list(rows.values())


def ratios(rows: list[dict], runs: list[dict] | None = None) -> dict:
    """flashllm's ms/token over each peer's (below 1: flashllm is faster): of the means, and per round
    where both measured it (`runs`); None where one has no figure."""
    ours = next((r["ms_per_token"] for r in rows if r["peer"] == "flashllm"), None)
    out = {}
    for row in rows:
        if row["peer"] == "flashllm":
            continue
        per_round = []
        for run in runs or []:
            if run["label"] == row["label"] and run.get("ms_per_token"):
                mine = [f["ms_per_token"] for f in runs if f["peer"] == "flashllm" and f["round"] == run["round"]
                        and f.get("ms_per_token")]
                per_round += [mine[0] / run["ms_per_token"]] if mine else []
        out[row["label"]] = {"ratio": ours / row["ms_per_token"] if ours and row["ms_per_token"] else None,
                             "per_round": per_round}
    return out


def table(rows: list[dict], ratio: dict) -> str:
    def ms(row):
        if row["ms_per_token"] is None:
            return "—"
        lo, hi = row["range"]
        return f"{row['ms_per_token']:,.0f}" + (f" ({lo:,.0f}–{hi:,.0f})" if hi > lo else "")

    lines = ["| run | outcome | decode ms/token | peak memory (GB, cgroup) | flashllm/peer latency |",
             "|---|---|---|---|---|"]
    for row in rows:
        r = (ratio.get(row["label"]) or {}).get("ratio")
        per_round = (ratio.get(row["label"]) or {}).get("per_round") or []
        cell = "—" if row["peer"] == "flashllm" else "n/a" if not r else \
            f"{r:.2f} (flashllm {1 / r:.1f}× faster)" if r < 1 else f"{r:.2f} (flashllm {r:.1f}× slower)"
        if len(per_round) > 1:
            cell += f"; per round: {min(per_round):.2f}–{max(per_round):.2f}"
        peak = f"{row['peak_bytes'] / GB:.2f}" if row["peak_bytes"] else "—"
        lines.append(f"| {row['label']} | {', '.join(row['outcomes'])} | {ms(row)} | {peak} | {cell} |")
    return "\n".join(lines)


def moe_table(report: dict) -> list[str]:
    """Per run of an MoE model: tokens/s, bytes read (flashllm's own counter per timed token; the whole
    process's storage reads per decoded token, load included, for every run), hit rates."""
    lines = ["| run (round) | tokens/s | GB read from flash per timed token (flashllm's counter) | GB read from "
             "storage by the process (whole run) | per decoded token | expert cache hit rate | prefetch recall |",
             "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if r.get("ms_per_token") is None:
            continue
        # tokens the process decoded: flashllm a (warmup + 1)-token prompt + the timed ones; llama-bench 1 warm-up
        decoded = r["tokens"] + (report["warmup"] + 1 if r["peer"] == "flashllm" else 1)
        storage = r.get("storage_bytes_read")
        lines.append(f"| {r['label']} ({r['round'] + 1}) | {1e3 / r['ms_per_token']:.3f} | "
                     + (f"{r['bytes_read'] / GB:.3f}" if r.get("bytes_read") is not None else "—") + " | "
                     + (f"{storage / GB:.2f} | {storage / decoded / GB:.3f} ({decoded} tokens)" if storage is not None
                        else "— | —") + " | "
                     + (f"{r['expert_hit_rate']:.3f}" if r.get("expert_hit_rate") is not None else "—") + " | "
                     + (f"{r['prefetch_recall']:.3f}" if r.get("prefetch_recall") is not None else "—") + " |")
    return ["", *lines, "", "Storage reads are the kernel's per-process read accounting (getrusage ru_inblock of "
            "the child): page faults on llama.cpp's mmap'd GGUF and flashllm's direct reads alike, loading included "
            "(flashllm reads its resident weights at load; llama.cpp faults its weights in as it uses them)."]


STORAGE_GBS = (1, 3, 7)  # storage read speeds of the projection (GB/s): a slow SSD, a laptop's NVMe, a fast NVMe


def projection_table(report: dict) -> list[str]:
    """Each runtime's measured compute per token and bytes read per token, and the token latency they imply on
    storage of STORAGE_GBS: compute + bytes / speed (neither overlaps all of its reads with compute: llama.cpp's page
    faults stall the thread that takes them, flashllm's expert misses overlap only the cached experts' compute), so
    the comparison does not depend on how fast this VM's host cache serves a 'disk' read. flashllm: compute = its
    token less its waits for reads, bytes = its own counter; llama.cpp: compute = its token with no memory limit (no
    reads), bytes = the kernel's per-process count per decoded token (load included) at the limit."""
    runs = [r for r in report["runs"] if r.get("ms_per_token") is not None]
    free = [r["ms_per_token"] for r in runs if r["peer"] == "llama.cpp" and r.get("unlimited")]
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        if rs[0]["peer"] == "flashllm" and all(r.get("bytes_read") is not None for r in rs):
            compute = [r["ms_per_token"] - r["io_ms"] for r in rs]
            gb = [r["bytes_read"] / GB for r in rs]
        elif rs[0]["peer"] == "llama.cpp" and not rs[0].get("unlimited") and free \
                and all(r.get("storage_bytes_read") is not None for r in rs):
            compute = free
            gb = [r["storage_bytes_read"] / (r["tokens"] + 1) / GB for r in rs]
        else:
            continue
        c, b = sum(compute) / len(compute), sum(gb) / len(gb)
        rows.append(f"| {label} | {c:,.0f} | {b:.3f} | " + " | ".join(f"{c + b / s * 1e3:,.0f}" for s in STORAGE_GBS) + " |")
    if not rows:
        return []
    return ["", "Projection (model: token = compute + bytes read / storage speed, means over rounds):", "",
            "| runtime | compute ms/token | GB read/token | " + " | ".join(f"ms/token at {s} GB/s" for s in STORAGE_GBS) + " |",
            "|---|---|---|" + "---|" * len(STORAGE_GBS), *rows, "", PROJECTION_NOTE]


PROJECTION_NOTE = (
    "A sum, not a max: neither runtime overlaps all of its reads with compute (llama.cpp's page faults stall the "
    "thread that takes them; flashllm's expert misses overlap only the cached experts' compute), so the sum is "
    "closer for both. flashllm's compute is its token less its waits for reads and its bytes its own counter; "
    "llama.cpp's compute is its token with no memory limit (no reads) and its bytes the kernel's count per "
    "decoded token (load included) at the limit. This does not depend on how fast this VM's host cache serves a "
    "'disk' read.")


CAVEAT = (
    "**Caveat: this is not a like-for-like computation.** The model has random weights, which have no "
    "activation sparsity of their own. flashllm's sparse mode reads and computes only the FFN neurons that an "
    "activation trace marks active: the real activations of the embedded small model (bench/models/activation_trace.py), "
    "replayed onto this shape ({active}). llama.cpp and accelerate compute every neuron (dense), as they "
    "would on any model. So flashllm's figures hold for a model whose FFN is as sparse as that trace (a ReLU "
    "model, like the paper's ReLU-fied models); on a model without activation sparsity (e.g. SiLU Llama as "
    "released) flashllm would have to read all neurons and its advantage here does not apply. The trace's "
    "sparsity is not that of a real 7B model either (the paper reports ~97% of OPT-6.7B's FFN neurons "
    "inactive per token; the trace is denser). flashllm's tokens are therefore not the model's own output; "
    "the peers' are.")

MOE_CAVEAT = (
    "**Caveat: what differs between the runs.** Every runtime here computes only the top-{top_k} experts "
    "of each token (a mixture of experts is sparse for all of them), so there is no dense-vs-sparse gap. "
    "The model has random weights: its own router routes random token ids at random, and `its own "
    "routing` rows (flashllm) and llama.cpp see that same kind of routing (the same router weights, but not "
    "the same choices token by token: the hidden states differ with the random expert values). `uniform random "
    "routing` rows draw top-k uniformly per token and layer (no reuse: the worst case for an expert cache). "
    "`replayed routing` rows "
    "route as the embedded trained MoE did on held-out text (bench/models/routing_trace.py's ReplayRouting: more "
    "reuse between tokens, and only part of each layer's experts are ever routed to), which favours "
    "flashllm's expert cache; whether a real Qwen3-30B-A3B routes like that is not measured here. The "
    "expert weights are 4-bit in both, 4.5 bits per weight (flashllm int4 groups of 64 with float16 scale and "
    "minimum; llama.cpp Q4_0 blocks of 32 with a float16 scale), both drawn directly as random codes, so the two "
    "runtimes hold different random values of the same shape and bytes.")


def markdown(report: dict, header: bool = True) -> str:
    """The report of one `python -m bench peers run` (its JSON, as --json-out writes and the record holds);
    header: its name, date and command first (a result record has its own)."""
    if "rows" not in report:
        report = dict(report, rows=summarize(report["runs"]))
        report["ratios"] = ratios(report["rows"], report["runs"])
    fl = next((r for r in report["runs"] if r["peer"] == "flashllm" and r.get("ms_per_token")), {})
    acc = next((r for r in report["runs"] if r["peer"] == "accelerate" and "modules_disk" in r), {})
    limit, sizes = report["memory_limit"], report["model_bytes"]
    files = ", ".join(f"{k} {v / GB:.2f} GB" + (f" (limit = {limit / v:.0%} of it)" if limit else "")
                      for k, v in sizes.items())
    active = (f"{fl['active_fraction']:.1%} of FFN neurons active per token; {fl.get('predictor_method')}"
              if fl.get("active_fraction") is not None else "no flashllm run measured it")
    of = (f" ({report['dram_budget'] / sizes['llama.cpp']:.0%} of the GGUF's {sizes['llama.cpp'] / GB:.2f} GB)"
          if report.get("budget_of") == "gguf" else "")
    base_of = sizes["llama.cpp"] if report.get("budget_of") == "gguf" else sizes.get("flashllm")
    of_limit = f"{limit / base_of:.0%} of the {'GGUF' if report.get('budget_of') == 'gguf' else 'model'}'s " \
               f"{base_of / GB:.2f} GB" if limit and base_of else ""
    moe = fl.get("expert_hit_rate") is not None
    read_ahead = (f"disk read-ahead {report['read_ahead_kb']} KiB (a page fault on llama.cpp's mmap'd file reads "
                  "about that much around it; flashllm's direct reads do not)") if report.get("read_ahead_kb") else ""
    lines = ([f"## {report['name'] or 'peers'}", "", f"- date: {report['date']}", f"- command: `{report['command']}`",
              f"- machine: {report['machine']}" + (f"; {read_ahead}" if read_ahead else "")]
             if header else [f"- {read_ahead}"] if read_ahead else []) + [
             "- versions: " + "; ".join(f"{k} {v}" for k, v in report["versions"].items()),
             f"- model: {report['model']}", f"- model files: {files}"]
    if limit and report.get("limit_given"):
        lines.append(f"- memory limit: {limit / GB:.2f} GB for every run, {of_limit} (cgroup v1 memory.limit_in_bytes, "
                     f"page cache charged; a new group per run, removed after it); flashllm's DRAM budget "
                     f"{report['dram_budget'] / GB:.2f} GB = the limit less the interpreter/torch baseline RSS "
                     f"{report['baseline_rss'] / GB:.2f} GB and {report['cgroup_slack_mib']} MiB slack")
    elif limit:
        lines.append(f"- memory limit: {limit / GB:.2f} GB for every run (cgroup v1 memory.limit_in_bytes, page cache "
                     f"charged; a new group per run, removed after it) = flashllm's DRAM budget "
                     f"{report['dram_budget'] / GB:.2f} GB{of} + interpreter/torch baseline RSS "
                     f"{report['baseline_rss'] / GB:.2f} GB + {report['cgroup_slack_mib']} MiB slack")
    else:
        lines.append(f"- memory limit: none ({report['no_limit_because']})")
    cached = [r.get("page_cache_at_start") for r in report["runs"] if r.get("page_cache_at_start") is not None]
    if report.get("read_ahead_runs_kb"):
        lines.append(f"- llama.cpp runs once per disk read-ahead, {' and '.join(map(str, report['read_ahead_runs_kb']))} "
                     "KiB as their labels say (set for that run only, then restored); the other runs at the machine's")
    lines += [f"- page cache: every model file evicted before each run (posix_fadvise DONTNEED); largest fraction "
              f"still cached at a run's start: {max(cached):.1%}" if cached else "- page cache: no run",
              (f"- tokens: flashllm a {report['warmup'] + 1}-token prompt + {report['tokens']} timed decode tokens "
               "(experts streamed" if moe else
               f"- tokens: flashllm {report['warmup']} warm-up + {report['tokens']} timed decode tokens (sparse, "
               f"compute {fl.get('compute_dtype', '?')}") + (f", resident matrices {report['quantize_resident']}"
                                                            if report.get("quantize_resident", "none") != "none" else "")
              + f"); llama.cpp llama-bench 1 warm-up + {report['tokens']} timed; "
              + (f"accelerate a 1-token prompt + {report['tokens']} timed; "
                 if any(r["peer"] == "accelerate" for r in report["runs"]) else "")
              + "random token ids; "
              f"OMP_WAIT_POLICY={report['omp_wait_policy']} for every run"]
    if fl and moe:
        lines += [f"- flashllm per token ({r['label']}, first round): {r['bytes_read'] / GB:.3f} GB read from flash; "
                  f"I/O {r['io_ms']:,.0f} ms, memory management {r['mem_ms']:,.0f} ms, compute {r['compute_ms']:,.0f} ms "
                  f"of {r['ms_per_token']:,.0f} ms" + (f" ({r['cpu_ms']:,.0f} ms of CPU)" if r.get("cpu_ms") else "")
                  + f"; expert cache hit rate {r['expert_hit_rate']:.2f}"
                  + (f", prefetch recall {r['prefetch_recall']:.2f}" if r.get("prefetch_recall") is not None else "")
                  + f"; DRAM held {r['dram_bytes'] / GB:.2f} GB"
                  + (f"; {r['slots_per_layer']} expert slots per layer" if r.get("slots_per_layer") else "")
                  + (f" ({r['expert_slots']})" if r.get("expert_slots") else "")
                  for r in report["runs"] if r["peer"] == "flashllm" and r["round"] == 0 and r.get("ms_per_token")]
    elif fl:
        lines.append(f"- flashllm per token: {fl['bytes_read'] / GB:.3f} GB read from flash; I/O {fl['io_ms']:,.0f} ms, "
                     f"memory management {fl['mem_ms']:,.0f} ms, compute {fl['compute_ms']:,.0f} ms (predictor "
                     f"{fl['predictor_ms']:,.0f} ms) of {fl['ms_per_token']:,.0f} ms (first round); "
                     f"DRAM held {fl['dram_bytes'] / GB:.2f} GB; **{fl['dropped_fraction']:.1%} of the FFN neurons dropped per "
                     "token** (predicted active, but the neuron caches at this budget could not hold them: a quality "
                     "cost the peers do not pay, see README)")
    if acc:
        lines.append(f"- accelerate: {acc['modules_cpu']} modules in DRAM, {acc['modules_disk']} offloaded to disk "
                     f"(read from the checkpoint's safetensors; {acc['offload_folder_bytes'] / GB:.2f} GB written "
                     "to the offload folder)")
    lines += ["", table(report["rows"], report["ratios"]), ""] + (moe_table(report) + projection_table(report) if moe else []) + ["",
              "Peak memory is the group's memory.max_usage_in_bytes (process memory + page cache). Latency ratio "
              "flashllm/peer below 1: flashllm is faster. Runs in order, #N the round (load average at each start: the "
              "machine's other work competes for its 2 cores):",
              "; ".join(f"{r['label']} #{r['round'] + 1}: load {r['load_average']:.1f}, {r['wall_s']:.0f} s"
                        for r in report["runs"] if "wall_s" in r) + "."]
    for r in report["runs"]:
        if r["outcome"] not in ("ran", "skipped"):
            last = r["stderr_tail"].strip().splitlines()[-1][:200] if r["stderr_tail"].strip() else ""
            lines.append(f"- {r['label']} (#{r['round'] + 1}): {r['outcome']} after {r['wall_s']:.0f} s, exit "
                         f"{r['returncode']}, oom_kill {r.get('oom_kills')}; "
                         + (f"last line on stderr: `{last}`" if last else "nothing on stderr (killed without a message)"))
        elif r["outcome"] == "skipped":
            lines.append(f"- {r['label']}: skipped: {r['why']}")
    lines += ["", MOE_CAVEAT.format(top_k=report.get("top_k", "k")) if moe else
              CAVEAT.format(active=active) if report["trace"] else
              f"flashllm's active neurons: {active} (predictor {fl.get('predictor_kind', '?')}); llama.cpp and "
              "accelerate compute every neuron (dense).", "", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    """Render a saved report again: python -m bench peers report REPORT.json (markdown on stdout)."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("report", help="JSON written by bench/peers/run.py --json-out")
    print(markdown(json.loads(Path(p.parse_args(argv).report).read_text())), end="")


if __name__ == "__main__":
    main()
