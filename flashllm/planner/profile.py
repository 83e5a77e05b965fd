"""`flashllm profile`: what this machine's compute and memory cost, measured once and cached.

Beside the disk profile (flashllm/io/disk_profile.py: random-read throughput and latency per request size and
reads in flight, cached per disk), this measures for one backend and device:
- DRAM copy bandwidth (numpy copies of 64 MiB blocks) and the cast bandwidth from each storage dtype
  to each compute dtype (what placing a streamed row costs when the dtypes differ);
- matrix-vector throughput per compute dtype: the time of `backend.linear` on one token for a ladder
  of weight sizes, fitted to `per_call_s + bytes / bytes_per_s`;
- the runtime's own fixed cost per layer and decode token (Python, small ops, attention over a short
  context), dense and sparse, and the sparse caches' bookkeeping (timed as memory management): the
  embedded model runs a few decode tokens in each mode and what its matvecs, reads and row copies
  explain is subtracted.

The cost model (docs/cost_model.md) combines these with a model's shapes; `flashllm plan` uses it.
Profiles are cached as JSON in profile/<host>-<backend>-<device>.json of flashllm's cache (paths.cache_home).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.paths import cache_home

FORMAT, VERSION = "flashllm-machine-profile", 1
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
MATVEC_SHAPES = ((64, 256), (1024, 1024), (8192, 2048))  # (rows, d_model): smallest and largest are used


@dataclass
class MachineProfile:
    host: str
    backend: str
    device: str
    torch_threads: int
    dram_copy_Bps: float
    cast_Bps: dict  # "float32->bfloat16" -> bytes of output per second
    matvec: dict  # dtype -> {"per_call_s", "bytes_per_s"}
    layer_s: dict  # "dense" / "sparse" / "sparse_mem" / "predictor" -> fixed seconds per layer per decode token
    measured_at: str = ""
    notes: list = field(default_factory=list)

    def matvec_s(self, dtype: str, rows: int, d: int, itemsize: int, calls: int = 1) -> float:
        """Seconds of `calls` matvecs over a [rows, d] weight in `dtype` (itemsize bytes per value)."""
        m = self.matvec[dtype]
        return calls * m["per_call_s"] + rows * d * itemsize / m["bytes_per_s"]

    def cast_s(self, src: str, dst: str, nbytes_out: int) -> float:
        """Seconds to place `nbytes_out` bytes of rows: a copy when the dtypes agree, else a cast."""
        bps = self.dram_copy_Bps if src == dst else self.cast_Bps.get(f"{src}->{dst}", self.dram_copy_Bps / 4)
        return nbytes_out / bps

    def to_dict(self) -> dict:
        return {"format": FORMAT, "format_version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "MachineProfile":
        if d.get("format") != FORMAT or d.get("format_version") != VERSION:
            raise FlashLLMError("not a flashllm machine profile (format/version)")
        return cls(**{k: v for k, v in d.items() if k not in ("format", "format_version")})

    def table(self) -> str:
        lines = [f"machine profile: {self.host}, backend {self.backend} on {self.device} "
                 f"({self.torch_threads} torch threads), measured {self.measured_at}",
                 f"  DRAM copy: {self.dram_copy_Bps / 2**30:.2f} GiB/s",
                 "  casts: " + ", ".join(f"{k} {v / 2**30:.2f} GiB/s" for k, v in self.cast_Bps.items())]
        for dt, m in self.matvec.items():
            lines.append(f"  matvec {dt:<9}: {m['bytes_per_s'] / 2**30:6.2f} GiB/s of weights + "
                         f"{m['per_call_s'] * 1e6:.1f} us per call")
        lines.append(f"  runtime fixed cost per layer and token: dense {self.layer_s['dense'] * 1e3:.3f} ms, "
                     f"sparse {self.layer_s['sparse'] * 1e3:.3f} ms + cache bookkeeping "
                     f"{self.layer_s.get('sparse_mem', 0.0) * 1e3:.3f} ms")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def cache_path(backend: str = "torch", device: str = "cpu") -> Path:
    return cache_home() / "profile" / f"{socket.gethostname()}-{backend}-{device}.json"


def _best(fn, repeats: int = 9) -> float:
    """The median wall time of fn() over `repeats` runs after one warm-up (the median, not the minimum:
    the runtime meets the machine as it is, shared or not)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_dram(nbytes: int = 64 << 20) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / _best(lambda: np.copyto(dst, src), 5)


def measure_layer_overhead(profile: MachineProfile, tokens: int = 24, seconds: float = 0.5) -> dict:
    """Fixed seconds per layer and decode token of the runtime (dense and sparse), from the embedded model:
    its compute time minus what its matvecs explain (costmodel), divided by its layers; the typical token
    (calibration.typical) of a warmed-up model decoding for `seconds`."""
    from flashllm.planner import calibration
    from flashllm.planner import cost_model as cm
    from flashllm import load
    from flashllm.embedded import prepare

    model_dir = prepare()
    out = {}
    for kind in ("dense", "sparse"):
        m = load(model_dir, mode=kind, dtype="float32", context=64, **({"predictor": "lowrank"} if kind == "sparse" else {}))
        t = calibration.typical(calibration.token_costs(m, list(range(5, 5 + tokens)), 4, 2, seconds, warm_passes=1))
        spec = m.spec
        rows = m.stats.get("neurons_cached_per_layer") or [spec.d_ffn] * spec.n_layers
        explained = cm.head_s(profile, spec, "float32") + sum(
            cm.attention_s(profile, spec, "float32") + cm.ffn_s(profile, spec, "float32", r) for r in rows)
        out[kind] = max(t.compute_ms / 1e3 - explained, 0.0) / spec.n_layers
        if kind == "sparse":  # the caches' bookkeeping (evicting, row lists), timed as memory, beyond placing rows
            placed = profile.cast_s("float32", "float32", t.bytes_read)
            out["sparse_mem"] = max(t.mem_ms / 1e3 - placed, 0.0) / spec.n_layers
            rank = int(m.mode_impl.predictor.proj_in[0].shape[0])
            out["predictor"] = max(t.predictor_ms / 1e3 / spec.n_layers - cm.predictor_s(profile, spec, "float32", rank), 0)
    return out


def measure(backend: str = "torch", device: str = "cpu", progress=None) -> MachineProfile:
    """Measure this machine now (about ten seconds)."""
    from flashllm.backends.torch import profile as torch_profile

    if backend != "torch":
        raise FlashLLMError(f"flashllm profile: backend {backend!r} is not profiled yet (torch only)")
    say = progress or (lambda msg: None)
    say("DRAM copy and cast bandwidth")
    p = MachineProfile(socket.gethostname(), backend, device, torch_profile.threads(), measure_dram(),
                       torch_profile.measure_casts(COMPUTE_DTYPES, _best),
                       {}, {}, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    say("matrix-vector throughput per dtype")
    p.matvec = torch_profile.measure_matvec(COMPUTE_DTYPES, MATVEC_SHAPES, _best, device)
    say("runtime fixed cost per layer (embedded model)")
    p.layer_s = measure_layer_overhead(p)
    return p


def save(p: MachineProfile) -> Path:
    path = cache_path(p.backend, p.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(p.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def profile(backend: str = "torch", device: str = "cpu", refresh: bool = False, progress=None) -> MachineProfile:
    """The cached profile of this machine (measured now when missing, unreadable or `refresh`)."""
    path = cache_path(backend, device)
    if not refresh and path.is_file():
        try:
            return MachineProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, FlashLLMError):
            pass  # a stale or foreign file: measure again
    p = measure(backend, device, progress)
    save(p)
    return p
