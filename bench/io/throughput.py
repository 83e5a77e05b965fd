"""Flash read throughput of flashllm.io.reader against fio at the same chunk size and thread count.

For each cell (pattern, chunk size, threads) the engine and fio each read for --seconds, interleaved,
for --rounds rounds; the table shows medians and the median of the per-round engine/fio ratios.
Patterns: `random` (read_rows of random chunk-sized rows; fio randread), `sequential` (read_rows of
consecutive rows, no coalescing; fio read, one slice per job), `layer` (read_range of a whole layer,
--layer-bytes, in --layer-chunk pieces; fio read with bs=--layer-chunk).

The engine keeps --inflight calls outstanding (each 64 MiB of rows, or one layer) and reads into
buffers from aligned_empty, as the runtime's neuron cache does; numpy backs such large arrays with
transparent huge pages, so a read needs fewer DMA segments (--small-pages: 4 KiB pages, like fio's).
--per-read-tasks adds one executor task per read, the design the engine avoids.
The output notes how many CPU cores other processes kept busy: on a shared machine that disturbs the
engine (whose threads need the GIL between reads) more than fio.

Test file: --file PATH is created once with random data (or reused when it already has --size bytes)
and kept unless --no-keep. Without --file a file in the temp directory is used and deleted at the end
unless --keep. Both sides bypass the page cache (O_DIRECT; fio --direct=1).

    python -m bench io throughput --file /data/io.bin --size 2GiB --chunks 32K --threads 32 --json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from flashllm.hugepages import aligned_empty
from flashllm.io.reader import FlashReader
from bench.harness import MiB, machine_desc

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
CALL_BYTES = 64 * MiB  # bytes requested per read_rows call (one call ~ many layers' worth of bundles)


def parse_size(text: str) -> int:
    """'32K', '2GiB', '1M', '4096' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in UNITS else ""
    return int(float(t[:len(t) - len(unit)]) * UNITS[unit])


def fmt_size(n: int) -> str:
    for u in ("G", "M", "K"):
        if n >= UNITS[u] and n % UNITS[u] == 0:
            return f"{n // UNITS[u]}{u}"
    return str(n)


EXTRAS = {"per_task": "per-read tasks", "preadv": "preadv threads"}  # optional comparison engines


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", help="test file (created with random data, or reused if it has --size bytes)")
    p.add_argument("--size", default="2GiB", help="test file size (default 2GiB)")
    p.add_argument("--keep", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the test file afterwards (default: keep if --file was given, else delete)")
    p.add_argument("--chunks", default="4K,8K,16K,32K,64K,128K,256K,512K,1M", help="comma list of chunk sizes")
    p.add_argument("--threads", default="1,2,4,8,16,32,64", help="comma list of thread counts")
    p.add_argument("--patterns", default="random,sequential,layer", help="comma list of random,sequential,layer")
    p.add_argument("--rounds", type=int, default=3, help="interleaved engine/fio rounds per cell (median)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per run (engine and fio each)")
    p.add_argument("--layer-bytes", default="256M", help="bytes per read_range call in the layer pattern")
    p.add_argument("--layer-chunk", default="1M", help="max_chunk_bytes for the layer pattern")
    p.add_argument("--per-read-tasks", action="store_true",
                   help="also measure one executor task per read (random pattern) to show why the engine "
                        "uses per-thread loops")
    p.add_argument("--inflight", type=int, default=2,
                   help="engine calls kept in flight (default 2: submit the next call before waiting for the "
                        "last, as a runtime that prefetches would; 1: one blocking read_rows at a time)")
    p.add_argument("--small-pages", action="store_true",
                   help="engine buffers with 4 KiB pages like fio's malloc'd ones, instead of aligned_empty's "
                        "(numpy's transparent huge pages for large arrays, as the runtime's neuron cache gets)")
    p.add_argument("--aio-depth", type=int, default=0,
                   help="reads in flight per native-AIO thread (FlashReader aio_depth; default 0: one preadv per read in each thread)")
    p.add_argument("--compare-preadv", action="store_true",
                   help="with --aio-depth > 0: also run the default engine (one blocking preadv per read in each thread)")
    p.add_argument("--cpu-hogs", type=int, default=0,
                   help="run N busy-looping processes during the measurement, to compare engine and fio on a "
                        "loaded machine (the runtime computes between reads; other tenants share the cores)")
    p.add_argument("--no-fio", action="store_true", help="skip fio even if installed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="draw throughput vs chunk size, one line per thread count")
    return p


def make_file(path: str, size: int) -> None:
    """Write ``size`` random bytes (reusing an existing fully allocated file of that size) and evict them."""
    if os.path.exists(path):
        st = os.stat(path)
        if st.st_size == size and st.st_blocks * 512 >= size:
            return
        if st.st_size != size and path != default_path(size):
            sys.exit(f"{path} exists with {st.st_size} bytes, not {size}; delete it or pass --size {st.st_size}")
    if shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < size + (1 << 30):
        sys.exit(f"not enough free space for a {fmt_size(size)} test file at {path}")
    print(f"writing {fmt_size(size)} of random data to {path}", file=sys.stderr)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for done in range(0, size, 64 * MiB):
            f.write(rng.bytes(min(64 * MiB, size - done)))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def default_path(size: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"flashllm-io-bench-{fmt_size(size)}.bin")


def dest_buffer(nbytes: int, small_pages: bool) -> np.ndarray:
    """A page-aligned, touched destination from aligned_empty, or with 4 KiB pages if ``small_pages``."""
    if not small_pages or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf = aligned_empty(nbytes, np.uint8)
    else:
        m = mmap.mmap(-1, nbytes)
        m.madvise(mmap.MADV_NOHUGEPAGE)
        buf = np.frombuffer(m, dtype=np.uint8)
    buf.fill(0)  # fault the pages in before timing, as fio's buffers are (a runtime allocates its cache once)
    return buf


def engine_run(path: str, size: int, pattern: str, chunk: int, threads: int, seconds: float, layer_bytes: int,
               rng: np.random.Generator, small_pages: bool, inflight: int = 1, per_task: bool = False,
               aio_depth: int = 0) -> tuple[float, float]:
    """(MiB/s, CPU cores this process used) of the engine with ``inflight`` calls outstanding (or of one
    executor task per read) for one cell."""
    reader = FlashReader(path, threads=threads, max_chunk_bytes=chunk,  # rows of `chunk`: no coalescing
                         aio_depth=0 if per_task else aio_depth)
    if not reader.direct:
        sys.exit(f"{path}: no direct I/O on this file system, so the numbers would measure the page cache")
    layer = pattern == "layer"
    n = 1 if layer else max(threads, min(CALL_BYTES // chunk, 8192))  # rows per read_rows call
    bufs = [dest_buffer(layer_bytes if layer else n * chunk, small_pages) for _ in range(inflight)]
    bufs = bufs if layer else [b.reshape(n, chunk) for b in bufs]
    rows, n_rows, n_layers = np.arange(n), size // chunk, size // layer_bytes
    pool = ThreadPoolExecutor(threads) if per_task else None
    pending = collections.deque()
    with reader:
        cursor, total, t0, cpu0 = int(rng.integers(0, 1 << 30)), 0, time.perf_counter(), os.times()
        while time.perf_counter() - t0 < seconds:
            if len(pending) == inflight:  # the oldest call used the buffer we are about to reuse
                total += pending.popleft().wait().bytes_requested
            dest = bufs[cursor % inflight]
            if layer:
                pending.append(reader.submit_range((cursor % n_layers) * layer_bytes, layer_bytes, dest))
            else:
                idx = rng.integers(0, n_rows, n) if pattern == "random" else (cursor * n + rows) % n_rows
                if per_task:
                    total += per_task_read(pool, reader.fileno(), idx * chunk, dest)
                else:
                    pending.append(reader.submit_rows(0, chunk, chunk, idx, dest, rows))
            cursor += 1
        while pending:
            total += pending.popleft().wait().bytes_requested
        elapsed, cpu1 = time.perf_counter() - t0, os.times()
    if pool:
        pool.shutdown()
    return total / elapsed / MiB, (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / elapsed


def per_task_read(pool: ThreadPoolExecutor, fd: int, offsets: np.ndarray, dest: np.ndarray) -> int:
    """The design the engine avoids: one executor task per read."""
    futures = [pool.submit(os.preadv, fd, (row,), off) for off, row in zip(offsets.tolist(), dest)]
    wait(futures)
    return sum(f.result() for f in futures)


def fio_run(path: str, size: int, pattern: str, chunk: int, threads: int, seconds: float) -> float:
    """MiB/s of fio psync with the same chunk size, thread count and access pattern."""
    cmd = ["fio", "--name=bench", f"--filename={path}", "--direct=1", "--ioengine=psync",
           f"--numjobs={threads}", f"--bs={chunk}", "--group_reporting", "--output-format=json",
           "--time_based", f"--runtime={int(seconds * 1000)}ms"]
    if pattern == "random":
        cmd += ["--rw=randread", f"--size={size}", "--norandommap", "--randrepeat=0"]
    else:  # each job reads its own slice sequentially, like the engine's threads share one stream
        part = size // threads // chunk * chunk
        cmd += ["--rw=read", f"--size={part}", f"--offset_increment={part}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]["read"]["bw_bytes"] / MiB


def busy_cpu_seconds() -> tuple | None:
    """(CPU seconds busy machine-wide, CPU seconds of this process and its children, wall time); Linux only."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    t = os.times()
    busy = (ticks[0] + ticks[1] + ticks[2]) / os.sysconf("SC_CLK_TCK")  # user, nice, system (not irq)
    return busy, t.user + t.system + t.children_user + t.children_system, time.perf_counter()


def other_cpu_cores(before: tuple | None) -> float | None:
    """Average number of cores other processes kept busy since ``before``: how disturbed the run was."""
    after = busy_cpu_seconds()
    if before is None or after is None:
        return None
    return round(((after[0] - before[0]) - (after[1] - before[1])) / (after[2] - before[2]), 2)


def fio_version() -> str:
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()




def run(args) -> dict:
    size = parse_size(args.size)
    path = args.file or default_path(size)
    keep = args.keep if args.keep is not None else bool(args.file)
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    patterns = args.patterns.split(",")
    layer_bytes, layer_chunk = parse_size(args.layer_bytes), parse_size(args.layer_chunk)
    use_fio = not args.no_fio and shutil.which("fio") is not None
    if layer_bytes > size or max(chunks) > size:
        sys.exit(f"--size {args.size} is smaller than a chunk or --layer-bytes")
    cells = [(p, c, t) for p in patterns if p != "layer" for c in chunks for t in threads]
    cells += [("layer", layer_chunk, t) for t in threads if "layer" in patterns]
    make_file(path, size)
    rng = np.random.default_rng()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.cpu_hogs)]
    busy_before = busy_cpu_seconds()
    results = {cell: collections.defaultdict(list) for cell in cells}
    try:
        for r in range(args.rounds):
            for cell in cells:
                pattern, chunk, t = cell
                res = results[cell]
                runs = [("engine", lambda: engine_run(path, size, *cell, args.seconds, layer_bytes, rng,
                                                         args.small_pages, args.inflight,
                                                         aio_depth=args.aio_depth))]
                if use_fio:
                    runs.append(("fio", lambda: fio_run(path, size, *cell, args.seconds)))
                if args.per_read_tasks and pattern == "random":
                    runs.append(("per_task", lambda: engine_run(path, size, *cell, args.seconds,
                                                                layer_bytes, rng, args.small_pages, per_task=True)))
                if args.compare_preadv and args.aio_depth:
                    runs.append(("preadv", lambda: engine_run(path, size, *cell, args.seconds, layer_bytes, rng,
                                                              args.small_pages, args.inflight, aio_depth=0)))
                for name, fn in (runs if r % 2 == 0 else runs[::-1]):  # alternate who goes first
                    v = fn()
                    if isinstance(v, tuple):  # an engine run: (MiB/s, CPU cores used)
                        v, cpu = v
                        res[name + "_cpu"].append(cpu)
                    res[name].append(v)
                print(f"round {r + 1}/{args.rounds} {pattern} {fmt_size(chunk)} x{t}: " +
                      " ".join(f"{k} {v[-1]:.0f}" for k, v in res.items() if v and not k.endswith("_cpu")),
                      file=sys.stderr)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        if not keep:
            os.unlink(path)
    rows = []
    for (pattern, chunk, t), res in results.items():
        eng = statistics.median(res["engine"])
        fio = statistics.median(res["fio"]) if res["fio"] else None
        ratio = statistics.median(e / f for e, f in zip(res["engine"], res["fio"])) if res["fio"] else None
        row = {"chunk_bytes": chunk, "threads": t, "pattern": pattern, "engine_mibps": round(eng, 1),
               "fio_mibps": None if fio is None else round(fio, 1),
               "ratio": None if ratio is None else round(ratio, 3),
               "engine_cpu_cores": round(statistics.median(res["engine_cpu"]), 2)}
        for extra in EXTRAS:
            if res[extra]:
                row[f"{extra}_mibps"] = round(statistics.median(res[extra]), 1)
                row[f"{extra}_cpu_cores"] = round(statistics.median(res[extra + "_cpu"]), 2)
                if res["fio"]:
                    row[f"{extra}_ratio"] = round(statistics.median(x / f for x, f in zip(res[extra], res["fio"])), 3)
        rows.append(row)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_desc(),
            "command": " ".join(["python"] + sys.argv), "file": path, "size": size, "rounds": args.rounds,
            "seconds": args.seconds, "layer_bytes": layer_bytes, "inflight": args.inflight, "aio_depth": args.aio_depth, "cpu_hogs": args.cpu_hogs,
            "small_pages": args.small_pages,
            "fio": fio_version() if use_fio else None,
            "other_cpu_cores": other_cpu_cores(busy_before), "rows": rows}


def table(result: dict) -> str:
    """Markdown: engine and fio per cell, ratio, CPU cores the engine used; then any comparison engines."""
    extras = [e for e in EXTRAS if any(f"{e}_mibps" in r for r in result["rows"])]
    f0 = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["| pattern | chunk | threads | engine MiB/s | fio MiB/s | engine/fio | engine CPU cores |" +
             "".join(f" {EXTRAS[e]} MiB/s | {EXTRAS[e]}/fio | {EXTRAS[e]} CPU cores |" for e in extras),
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|---:|" * len(extras)]
    for r in result["rows"]:
        line = (f"| {r['pattern']} | {fmt_size(r['chunk_bytes'])} | {r['threads']} | {r['engine_mibps']:.0f} | "
                f"{f0(r['fio_mibps'], '.0f')} | {f0(r['ratio'], '.2f')} | {f0(r.get('engine_cpu_cores'), '.2f')} |")
        for e in extras:
            line += (f" {f0(r.get(f'{e}_mibps'), '.0f')} | {f0(r.get(f'{e}_ratio'), '.2f')} | "
                     f"{f0(r.get(f'{e}_cpu_cores'), '.2f')} |")
        lines.append(line)
    return "\n".join(lines)


def plot(result: dict, png: str) -> None:
    """Throughput vs chunk size, one line per thread count (engine solid, fio dashed), like Fig. 2b."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    patterns = [p for p in ("random", "sequential") if any(r["pattern"] == p for r in result["rows"])]
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 4.5), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        rows = [r for r in result["rows"] if r["pattern"] == pattern]
        for i, t in enumerate(sorted({r["threads"] for r in rows})):
            pts = sorted((r["chunk_bytes"], r["engine_mibps"], r["fio_mibps"]) for r in rows if r["threads"] == t)
            x = [p[0] // 1024 for p in pts]
            ax.plot(x, [p[1] for p in pts], "o-", color=f"C{i}", label=f"{t} threads")
            if all(p[2] is not None for p in pts):
                ax.plot(x, [p[2] for p in pts], "--", color=f"C{i}", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk size (KiB)")
        ax.set_ylabel("MiB/s")
        ax.set_title(f"{pattern} reads (solid: flashio, dashed: fio psync)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> None:
    args = setup_arg_parser().parse_args(argv)
    result = run(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['date']}  {result['machine']}\n{result['command']}\n"
              f"file {result['file']} ({fmt_size(result['size'])}), {result['rounds']} rounds x "
              f"{result['seconds']} s per run, interleaved; ratio = median of per-round engine/fio; "
              f"engine: {result['inflight']} call(s) in flight, "
              f"{'native AIO, %d reads in flight per thread' % result['aio_depth'] if result['aio_depth'] else 'preadv threads'}, "
              f"{'4 KiB-page' if result['small_pages'] else 'aligned_empty'} buffers; "
              f"{result['fio'] or 'no fio'}; {result['cpu_hogs']} busy-looping processes started by the bench; "
              f"CPU cores busy with other processes during the run: "
              f"{result['other_cpu_cores']}\n")
        print(table(result))


if __name__ == "__main__":
    main()
