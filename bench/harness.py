"""What every suite shares: where things are, timing, child processes, page-cache eviction, cgroup v1 memory
limits, and the result record appended to bench/results/<suite>.jsonl (git sha, date, machine, load)."""

from __future__ import annotations

import atexit
import ctypes
import datetime
import errno
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bench import invocation

ROOT = Path(__file__).resolve().parent.parent  # the checkout: children run `python -m ...` from here
RESULTS = ROOT / "bench" / "results"
GB = 1e9  # decimal, as the paper (13.4 GB = 6.7e9 float16 parameters)
MiB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def cache_dir(name: str) -> Path:
    """A folder of bench's own under flashllm's cache ($FLASHLLM_CACHE/bench/NAME): default work directories."""
    from flashllm.paths import cache_home

    return cache_home() / "bench" / name


def llama_cpp_dir() -> Path:
    """Where bench/build_llama_cpp.sh installed llama.cpp: $LLAMA_CPP_DIR, else $FLASHLLM_CACHE/llama.cpp."""
    from flashllm.paths import cache_home

    return Path(os.environ.get("LLAMA_CPP_DIR") or cache_home() / "llama.cpp")


# -- timing ------------------------------------------------------------------------------------
def interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each case, the cases alternated within each round (a noisy machine drifts)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def spread(values, fmt: str = "{:.1f}") -> str:
    """min–max of a list of numbers (one number where they print alike)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def number(x, nd: int = 0) -> str:
    """x with thousands separators and nd decimals; "-" for None or NaN (a table's empty cell)."""
    return "-" if x is None or x != x else f"{x:,.{nd}f}"


def load() -> float | None:
    """The 1-minute load average (the machine is shared: every record says how busy it was)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# -- child processes ---------------------------------------------------------------------------
def module_argv(module: str, *args) -> list[str]:
    """argv running a bench module in a fresh interpreter; run it with cwd=ROOT so that `bench` imports."""
    return [sys.executable, "-m", module, *map(str, args)]


def command_line(module: str, argv=None) -> str:
    """How a person re-runs what ran: `python -m bench SUITE COMMAND ARGS` for a bench module (argv: its own
    arguments, default sys.argv[1:])."""
    args = map(str, argv if argv is not None else sys.argv[1:])
    return " ".join(["python -m bench", invocation(module), *map(shlex.quote, args)])


def vm(key: str) -> int | None:
    """A /proc/self/status size in bytes (VmRSS, VmHWM, ...)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def baseline_rss() -> int:
    """RSS of a Python process that imported what a run imports (torch, numpy, flashllm), before loading."""
    code = ("import torch, numpy, flashllm, flashllm.backends.torch.backend, flashllm.modes.registry\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return int(out.strip()) * 1024


# -- page cache ---------------------------------------------------------------------------------
def model_files(model_dir) -> list[Path]:
    """The files of a flashllm model directory (manifest, resident tensors, FFN file, ...)."""
    from flashllm.format import manifest as fmt

    m = fmt.read_manifest(model_dir, verify=False)
    return [m.path(k) for k in m.data["files"]]


def drop_page_cache(paths) -> None:
    """Evict the files' pages from the page cache (flushing first; dirty pages cannot be dropped)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths) -> float | None:
    """Fraction of the files' pages in the page cache (mincore), None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        cached = total = 0
        for p in paths:
            size = os.path.getsize(p)
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    pages = -(-size // page)
                    vec = (ctypes.c_ubyte * pages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    cached += int(np.frombuffer(vec, dtype=np.uint8).__and__(1).sum())
                    total += pages
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return cached / total if total else 0.0
    except (OSError, AttributeError):
        return None


# -- cgroup v1 memory limit ---------------------------------------------------------------------
def own_memory_cgroup() -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return path
    except OSError:
        pass
    return None


class MemoryGroup:
    """One cgroup v1 memory group (a child of our own) for child processes; removed by `remove()`/at exit."""

    def __init__(self, limit: int, name: str | None = None):
        own = own_memory_cgroup() or "/"
        parent = CGROUP_ROOT / own.lstrip("/")
        if not os.access(parent, os.W_OK):
            parent = CGROUP_ROOT
        self.path = parent / (name or f"flashllm-bench-{os.getpid()}")
        self.path.mkdir()
        atexit.register(self.remove)
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            self.limit = int((self.path / "memory.limit_in_bytes").read_text())
        except OSError:
            self.remove()
            raise

    @staticmethod
    def available() -> str | None:
        """None if a group can be made here, else why not."""
        if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
            return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
        if os.geteuid() != 0 or not os.access(CGROUP_ROOT, os.W_OK):
            return f"{CGROUP_ROOT} is not writable (needs root)"
        return None

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside the group: a shell moves itself in, then execs (all memory is charged there)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *argv]

    def reset_peak(self) -> None:
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            try:
                (self.path / name).write_text("0")
            except OSError:
                pass

    def usage(self) -> dict:
        def read(name):
            try:
                return int((self.path / name).read_text())
            except (OSError, ValueError):
                return None
        oom_kills = None  # memory.oom_control's "oom_kill N" line (kernels >= 4.13)
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    oom_kills = int(line.split()[1])
        except (OSError, ValueError):
            pass
        return {"peak_bytes": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt"),
                "oom_kills": oom_kills}

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    return
                time.sleep(0.1)  # the last child's exit is still being accounted


# -- the setting and the result record ------------------------------------------------------------
def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def code_version() -> str:
    """The commit measured, and the runtime files that differ from it."""
    head = git_sha()
    if head is None:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "flashllm", "converters"], capture_output=True,
                           text=True, cwd=ROOT).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip() and not line[3:].startswith("flashllm/data")]
    return f"commit {head}" + (f", with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def machine() -> dict:
    """CPU model, cores, RAM, OS and the versions that matter."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        ram = None
    out = {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(ram, 1) if ram else None,
           "system": f"{platform.system()} {platform.release()}", "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def machine_desc(m: dict | None = None) -> str:
    m = m or machine()
    ram = f"{m['ram_gib']:.0f} GiB RAM" if m.get("ram_gib") else "RAM unknown"
    return (f"{m['system']}, {m['cores']} CPUs ({m['cpu']}), {ram}, Python {m['python']}"
            + (f", torch {m['torch']}" if m.get("torch") else ""))


def record(suite: str, command: str | None, argv: list[str], result, load_start: float | None) -> dict:
    """One result record: what ran (suite, command, arguments), on which code and machine, how busy it was,
    and what it measured."""
    line = " ".join(["python -m bench", suite, *([command] if command else []), *map(str, argv)])
    return {"suite": suite, "command": command, "command_line": line, "argv": list(argv), "git_sha": git_sha(),
            "code": code_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "load_start": load_start, "load_end": load(), "result": result}


def append(rec: dict, results: Path = RESULTS) -> Path:
    """Append a record to results/<suite>.jsonl."""
    path = Path(results) / f"{rec['suite']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return path


def records(suite: str, results: Path = RESULTS) -> list[dict]:
    path = Path(results) / f"{suite}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
