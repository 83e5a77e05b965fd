"""The paper benchmark's measurements: one run (load, decode, per-token costs), and the runner that puts
each run in a child process (inside a memory group) when asked.

As a module it measures the one run described by a JSON file (the child process of `Runner`):
    python -m bench.paper.measure RUN.json RESULT.json
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import (GB, ROOT, MemoryGroup, cached_fraction, drop_page_cache, load, module_argv,
                           own_memory_cgroup, vm)
from bench.models import activation_trace


# -- one measurement ---------------------------------------------------------------------------
def measure(run: dict) -> dict:
    """Load the model as `run` says, decode the prompt, warm-up and measured tokens; per-token costs."""
    import flashllm

    if run.get("torch_threads"):
        import torch

        torch.set_num_threads(run["torch_threads"])
    predictor = run.get("predictor") or "oracle"
    if predictor == "trace":
        predictor = activation_trace.trace_predictor_factory(run["trace"], run["seed"], run["predictor_rank"],
                                                     order=run.get("order"), window=run.get("window") or 1,
                                                     lookahead=run.get("lookahead_model"))
    n = 1 + run["warmup"] + run["tokens"]
    t0 = time.perf_counter()
    model = flashllm.load(run["model_dir"], backend=run["backend"], mode=run["mode"], predictor=predictor,
                          dram_budget=run["budget"], window=run.get("window") or 1, threads=run["threads"],
                          aio_depth=run.get("aio_depth", 0), gap_bytes=run.get("gap_bytes", 0), dtype=run.get("dtype"),
                          context=n + 1, quantize_resident=run.get("quantize_resident", "none"),
                          kv_bits=run.get("kv_bits", 16), read_ahead=run.get("read_ahead"), device=run.get("device"),
                          gpu_budget=run.get("gpu_budget"))
    load_s = time.perf_counter() - t0
    if hasattr(model.mode_impl.predictor, "early"):  # a replayed trace: tell it which predictions are lookaheads
        flag_lookahead(model.mode_impl)
    for name, value in (run.get("plan") or {}).items():  # plan attributes to vary (bench/io/runtime.py configs)
        setattr(model.mode_impl, name, value)
    read_acc, predicted_acc = [0.0], [0]

    def on_read(io):  # the engine's wall time of each read
        read_acc[0] += io.wall_s

    def on_predict(layer, mask):  # neurons each prediction selects
        predicted_acc[0] += int(mask.sum())

    model.hooks.add("read", on_read)
    model.hooks.add("predict", on_predict)
    ids = np.random.default_rng(run["seed"]).integers(3, model.spec.vocab_size, size=n).tolist()
    read_ms, predicted, cpu = [], [], []
    readers = [r for r in (getattr(model.mode_impl, "reader", None), getattr(model.mode_impl, "attn_reader", None)) if r]
    readers = [getattr(r, "io", r) for r in readers]

    def cpu_now():  # process, this (the generating) thread, the flash reader threads: CPU seconds so far
        return time.process_time(), time.thread_time(), sum(r.cpu_seconds() for r in readers)

    prof = sizes = None
    for pos in range(n):
        if run.get("profile") and pos == 1 + run["warmup"]:  # profile the measured tokens only
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        if run.get("read_sizes") and pos == 1 + run["warmup"]:
            sizes = record_read_sizes(model.mode_impl.reader.io)
        read_acc[0], predicted_acc[0] = 0.0, 0
        c0 = cpu_now()
        model.forward([ids[pos]], pos)
        cpu.append([(b - a) * 1e3 for a, b in zip(c0, cpu_now())])
        read_ms.append(read_acc[0] * 1e3)
        predicted.append(predicted_acc[0])
    if prof is not None:
        prof.disable()
    costs = model.token_stats  # the 1-token prompt first, then each decode token
    decode = costs[1:]
    for c, r, p, u in zip(decode, read_ms[1:], predicted[1:], cpu[1:]):
        c["read_ms"], c["predicted"] = r, p
        c["cpu_ms"], c["main_cpu_ms"], c["io_cpu_ms"] = u  # CPU: the process, the generating thread, the readers
    measured = decode[run["warmup"]:]
    k = max(len(measured), 1)

    def mean(key):
        return sum(c[key] for c in measured) / k

    row_bytes = model.compute_row_bytes()
    out = {"run": run, "load_s": load_s, "decode_tokens": len(measured), "warmup_tokens": run["warmup"],
           "model_bytes": model.model_bytes, "dram_budget": model.dram_budget, "dram_bytes": model.dram_bytes(),
           "device": model.stats["device"], "gpu_budget": model.gpu_budget, "gpu_bytes": model.stats["gpu_bytes"],
           "compute_dtype": model.backend.dtype_name,
           "storage_dtype": model.manifest.data["dtype"], "bundled": model.layout.bundled,
           "context": model.context, "gap_bytes": model.stats.get("gap_bytes"), "n_layers": model.spec.n_layers, "d_ffn": model.spec.d_ffn, "kv_bytes": _kv_bytes(model), "row_bytes": row_bytes,
           "prompt": {k2: costs[0][k2] for k2 in ("bytes_read", "io_ms", "total_ms")}}
    for key in ("bytes_read", "bytes_wasted", "reads", "io_ms", "read_ms", "mem_ms", "compute_ms", "predictor_ms",
                "total_ms", "neurons_dropped", "predicted", "cpu_ms", "main_cpu_ms", "io_cpu_ms"):
        out[key] = mean(key)
    if run["mode"] == "sparse":
        cached = sum(sum(c["neurons_cached"]) for c in measured) / k
        out["neurons_cached"] = cached
        out["neurons_loaded"] = sum(sum(c["neurons_loaded"]) for c in measured) / k
        out["cache_capacity"] = max(model.stats["cache_capacity"])
        out["predictor_bytes"] = model.predictor.nbytes()
        out["predictor_kind"] = model.predictor.kind
        if hasattr(model.predictor, "describe"):
            out["predictor_method"] = model.predictor.describe()
        # DRAM holding data: resident weights + KV + predictors + the cache rows in use (not the free ones)
        out["dram_in_use"] = model.backend.nbytes() + model.predictor.nbytes() + cached * row_bytes
    else:
        out["dram_in_use"] = out["dram_bytes"]
    if run["mode"] == "hybrid":
        out["resident_neurons"] = model.stats["resident_neurons"]
    if run.get("per_token"):
        out["per_token"] = [{key: c[key] for key in ("bytes_read", "reads", "io_ms", "read_ms", "mem_ms", "total_ms",
                                                     "neurons_dropped", "cpu_ms", "io_cpu_ms")} for c in decode]
    if prof is not None:
        out["profile"] = profile_rows(prof, max(run["tokens"], 1))
    if sizes is not None:  # request size (bytes) -> reads of that size, per measured token
        out["read_sizes"] = {str(b): c / k for b, c in sorted(sizes.items())}
    if run["mode"] == "sparse":
        s = model.stats
        out.update({key: s.get(key) for key in ("read_ahead_recall", "read_ahead_recall_per_layer",
                                                 "read_ahead_precision_per_layer", "read_ahead_share_per_layer",
                                                 "read_ahead_cut", "neurons_read_ahead",
                                                 "read_ahead_unused", "read_ahead_rows", "read_ahead")})
    out["rss_peak"] = vm("VmHWM")
    out["cgroup"] = own_memory_cgroup()
    del model
    gc.collect()
    return out


def flag_lookahead(plan) -> None:
    """Set `plan.predictor.early` while the sparse plan's lookahead predicts (its `_lookahead`, wrapped on
    this one instance), so that a TracePredictor can replay an imperfect lookahead (its `lookahead` model)."""
    lookahead, pred = plan.read_ahead.start, plan.predictor

    def flagged(layer, cost):
        pred.early = True
        try:
            lookahead(layer, cost)
        finally:
            pred.early = False

    plan.read_ahead.start = flagged


def record_read_sizes(engine) -> dict:
    """Count the reads the FlashReader `engine` issues from now on by size (bytes -> reads): the runtime's
    request-size mix, for fio to replay (bench/io/runtime.py). It observes the engine's planned reads
    (its `_submit`, wrapped on this one instance); what is read is unchanged."""
    sizes: dict[int, int] = {}
    submit = engine._submit

    def counted(flat, reads, requested, t0):
        for b, c in zip(*np.unique(reads.len, return_counts=True)):
            sizes[int(b)] = sizes.get(int(b), 0) + int(c)
        return submit(flat, reads, requested, t0)

    engine._submit = counted
    return sizes


def io_engine(manifest, threads: int, aio_depth: int) -> str:
    """How the flash I/O engine reads this model's FFN file here (native AIO or preadv threads)."""
    from flashllm.io.reader import FlashReader

    with FlashReader(manifest.path("ffn"), threads=threads, aio_depth=aio_depth) as r:
        if r.engine == "aio":
            return f"{threads} in flight, native AIO from {-(-threads // r.aio_depth)} thread(s)"
        return f"{threads} preadv threads ({'O_DIRECT' if r.direct else 'buffered'})"


def profile_rows(prof, tokens: int, top: int = 25) -> list[dict]:
    """The main thread's functions by own time, per measured token (cProfile; I/O threads not included)."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append({"function": where, "calls_per_token": nc / tokens, "own_ms_per_token": tt * 1e3 / tokens,
                     "cumulative_ms_per_token": ct * 1e3 / tokens})
    rows.sort(key=lambda r: -r["own_ms_per_token"])
    return rows[:top]


def _kv_bytes(model) -> int:
    s = model.spec
    return 2 * s.n_layers * model.context * s.n_kv_heads * s.head_dim * model.backend.itemsize


# -- the runs ----------------------------------------------------------------------------------
class Runner:
    """Runs measurements in this process, or each in a child process (inside the memory group)."""

    def __init__(self, isolate: bool, group: MemoryGroup | None, drop_paths: list[Path], log):
        self.isolate, self.group, self.drop_paths, self.log = isolate or group is not None, group, drop_paths, log

    def __call__(self, run: dict) -> dict:
        load_average = load()
        before = cached_fraction(self.drop_paths)
        drop_page_cache(self.drop_paths)
        after = cached_fraction(self.drop_paths)
        t0 = time.perf_counter()
        self.log(f"run {run['label']}: {run['mode']} window {run.get('window')} "
                 f"{'bundled' if run['bundled'] else 'unbundled'} {run['backend']} "
                 f"{run['warmup']}+{run['tokens']} tokens")
        if not self.isolate:
            try:
                result = measure(run)
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                result = {"error": f"{type(exc).__name__}: {exc}", "run": run}
        else:
            result = self._child(run)
        result["label"] = run["label"]
        result["load_average_at_start"] = load_average
        result["page_cache_before_drop"], result["page_cache_at_start"] = before, after
        result["wall_s"] = time.perf_counter() - t0
        if "error" not in result:
            self.log(f"  {result['total_ms']:.0f} ms/token, {result['bytes_read'] / GB:.3f} GB/token, "
                     f"io {result['io_ms']:.0f} ms, mem {result['mem_ms']:.1f} ms, load {result['load_s']:.1f} s, "
                     f"wall {result['wall_s']:.0f} s")
        else:
            self.log(f"  failed: {result['error']}")
        return result

    def _child(self, run: dict) -> dict:
        with tempfile.TemporaryDirectory(prefix="flashllm-bench-") as tmp:
            spec, res = Path(tmp) / "run.json", Path(tmp) / "result.json"
            spec.write_text(json.dumps(run))
            argv = module_argv("bench.paper.measure", spec, res)
            if self.group is not None:
                self.group.reset_peak()
                argv = self.group.command(argv)
            proc = subprocess.Popen(argv, cwd=ROOT)
            try:
                rc = proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            usage = self.group.usage() if self.group is not None else None
            if rc != 0 or not res.is_file():
                why = f"exit status {rc}" + (" (killed: out of memory at the cgroup limit?)" if rc in (-9, 137) else "")
                return {"error": why, "run": run, "cgroup_usage": usage}
            result = json.loads(res.read_text())
        if self.group is not None:
            result["cgroup_usage"] = usage
            result["cgroup_limit"] = self.group.limit
            result["cgroup_active"] = result.get("cgroup") is not None and \
                str(self.group.path).endswith(result["cgroup"].lstrip("/"))
        return result


def run_one(spec_path: str, result_path: str) -> None:
    """Measure the run described in the JSON file `spec_path`; write the result to `result_path`."""
    run = json.loads(Path(spec_path).read_text())
    Path(result_path).write_text(json.dumps(measure(run)))


if __name__ == "__main__":
    run_one(*sys.argv[1:3])
