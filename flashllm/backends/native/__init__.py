"""flashllm's native CPU kernels (kernels.c: a one-token mat-vec, the sparse FFN over cache rows, RMS norm and
decode attention; kernels_quant.c: int8/int4 mat-vec and sparse FFN over quantized bundle parts as stored;
kernels_qdot.c and kernels_experts.c: the same parts' mat-vec and several experts' FFN with int8 activations and
integer dots;
kernels_pool.c: their thread pool; kernels.h: what they share), compiled on first use into one library with
the machine's C compiler into a per-user cache and loaded with ctypes (whose calls release the GIL).
`library()` is None where there is no compiler, the build failed, or FLASHLLM_NATIVE=0: callers then take
their torch path. No network: the source ships with the package."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from flashllm.paths import cache_home

SOURCE = Path(__file__).with_name("kernels.c")
SOURCES = tuple(SOURCE.with_name(n) for n in ("kernels.c", "kernels_quant.c", "kernels_qdot.c", "kernels_experts.c",
                                               "kernels_pool.c"))  # one library
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}  # kernels.h's DT_* codes
ACTIVATIONS = {"relu": 0, "relu2": 1, "fatrelu": 2, "silu": 3, "gelu": 4, "gelu_tanh": 5}  # its ACT_* codes
BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread"]
_state: dict = {}  # "lib": the loaded kernels or None, "why": what `describe` says


def cache_dir() -> Path:
    """Where built libraries live: $FLASHLLM_NATIVE_CACHE, else native/ under flashllm's cache (paths.cache_home)."""
    if os.environ.get("FLASHLLM_NATIVE_CACHE"):
        return Path(os.environ["FLASHLLM_NATIVE_CACHE"])
    return cache_home() / "native"


def enabled() -> bool:
    return os.environ.get("FLASHLLM_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def library() -> "Kernels | None":
    """The native kernels, built and loaded once per process; None when disabled or unavailable."""
    if not enabled():
        return None
    if "lib" not in _state:
        try:
            _state["lib"] = Kernels(ctypes.CDLL(str(build())))
            _state["why"] = f"native ({'AVX2+F16C+FMA' if _state['lib'].simd else 'portable C'})"
        except (OSError, subprocess.SubprocessError) as e:
            _state["lib"], _state["why"] = None, f"torch (native kernels unavailable: {str(e).splitlines()[0][:160]})"
    return _state["lib"]


def describe() -> str:
    """Which kernels a CPU backend uses: "native (AVX2+F16C+FMA)", or "torch (...)" and why."""
    if not enabled():
        return "torch (FLASHLLM_NATIVE=0)"
    library()
    return _state["why"]


def _compiler() -> str:
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    return cc


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux) or its model."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(portable: bool = False, source: Path | tuple[Path, ...] = SOURCES) -> Path:
    """The library for these sources (and the headers they include), compiler, flags and CPU: from the cache,
    or compiled into it (into a temporary file, then renamed, so concurrent builds never see a partial
    library); for the machine's vector units (-march/-mcpu=native), else (or `portable`) for the compiler's
    default target. `source`: another C file of the package (the io_uring engine, uring.c)."""
    sources = (source,) if isinstance(source, Path) else tuple(source)
    texts = [s.read_text() for s in sources]
    headers = sorted({h for t in texts for h in re.findall(r'^#include "([^"]+)"', t, re.MULTILINE)})
    texts += [sources[0].with_name(h).read_text() for h in headers]
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    native = ["-mcpu=native"] if platform.machine() in ("arm64", "aarch64") else ["-march=native"]
    errors = []
    for flags in ([BASE_FLAGS] if portable else [[*BASE_FLAGS, *native], BASE_FLAGS]):
        key = hashlib.sha256("\0".join([*texts, cc, version, *flags, platform.machine(), _cpu_id()])
                             .encode()).hexdigest()[:20]
        path = cache_dir() / f"flashllm_{sources[0].stem}_{key}.so"
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
            errors.append(f"{cc} {' '.join(flags)}: {done.stderr.strip()[:300]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("the C build failed: " + " | ".join(errors))


class Kernels:
    """ctypes signatures of the kernels' entry points (pointers as integers; see kernels.c and kernels_quant.c for
    the math). An entry point the library lacks (a build of older sources) is None."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        signatures = {
            "matvec": [i32, p, i64, i64, i64, p, p, p, i32],
            "ffn": [i32, p, p, p, i64, i64, p, i64, p, p, p, p, i32, i32, f32, i32, f32, p, i32, i32, p, p],
            "rmsnorm": [i32, p, p, i64, i64, f32, p],
            "attend": [i32, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, p, p, f32, p, i32],
            "attn_block": [i32, p, p, f32, i64, p, i64, p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64,
                           p, p, f32, p, p, p, p, p, i32, p],
            # quantized parts (flashllm/format/quant.py's layout): bits, symmetric, group size first
            "qmatvec": [i32, i32, i64, p, i64, i64, i64, i32, p, p, p, i32],
            "qffn": [i32, i32, i64, p, p, p, i64, i64, p, i64, i32, p, p, p, p, i32, i32, f32, i32, f32, p, i32, i32, p,
                     p],
            # int8-activation kernels over the same parts (kernels_qdot.c)
            "qmatmul": [i32, i32, i64, p, i64, i64, i64, i32, i64, p, p, p, i32],
            "experts": [i32, i32, i64, i64, p, p, p, p, i64, i64, i64, i64, i32, i64, p, i32, f32, p, i32],
            "simd": [],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, "fl_" + name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, i32
            setattr(self, name, fn)
        self.simd = bool(lib.fl_simd())
        self.stream_read = getattr(lib, "fl_stream_read", None)  # the streaming-read bandwidth (bench)
        if self.stream_read is not None:
            self.stream_read.argtypes, self.stream_read.restype = [p, i64, i32], ctypes.c_uint64
