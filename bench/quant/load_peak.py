"""Peak memory of loading a model with --quantize-resident: how far the process's resident set rises
while the model loads, against what the loaded model holds and the largest stored tensor.

Each load runs in a fresh child process: it imports the runtime, resets the kernel's RSS high-water
mark (/proc/self/clear_refs, value 5), records VmRSS, loads the model, then reads VmHWM. The child
runs with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), so every large block
freed goes back to the kernel and VmHWM follows the bytes allocated, not what glibc's free lists
happen to retain (its default raises the threshold after the first large free).
`peak` = VmHWM - VmRSS before the load; `held` = the bytes the model reports holding (resident
weights, KV cache, caches, read buffers); `transient` = peak - held: what loading needed on top.
Quantizing each resident tensor as it is read keeps `transient` near one stored tensor; quantizing
after loading everything in the compute dtype needs the float copy of every resident matrix.

    python -m bench quant load-peak MODEL_DIR [--quantize-resident int4,none] [--out X.md]
    python -m bench quant load-peak --shape opt-1.3b  # writes the random model, measures, deletes it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import ROOT, MiB, module_argv


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _child(model_dir: str, options: dict, decode_tokens: int = 0) -> dict:
    """In the child: load once and measure (see the module docstring); then, with `decode_tokens`, decode
    that many tokens one at a time: `run_peak` is the rise over the load and the decoding, `run_transient`
    = run_peak - what the model then holds (streaming plans count the rows of the layer being computed)."""
    import flashllm
    from flashllm.format import manifest as fmt
    from flashllm.backends.torch import backend as torch_backend  # noqa: F401  (imports are not part of the load)
    from flashllm.format.safetensors_io import SafetensorsFile

    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    model = flashllm.Model(model_dir, **options)
    peak = _status("VmHWM") - before
    host, device = model.memory()
    st = SafetensorsFile(model.manifest.path("resident"))
    sizes = [e["data_offsets"][1] - e["data_offsets"][0] for e in st.entries.values()]
    float_resident = sum(n // fmt.STORAGE_DTYPES[model.manifest.dtype] * model.backend.itemsize for n in sizes)
    out = {"peak": peak, "held": host + device, "transient": peak - host - device,
           "largest_tensor": max(sizes), "float_resident": float_resident,
           "resident_held": model.backend.nbytes() - model.backend.kv_bytes(),
           "resident_neurons": getattr(model.mode_impl, "resident_rows", 0)}
    if decode_tokens:
        for pos in range(decode_tokens):
            model.forward([1 + pos % 8], pos)
        out["run_peak"] = _status("VmHWM") - before
        out["run_transient"] = out["run_peak"] - sum(model.memory())
    return out


def measure(model_dir, decode_tokens: int = 0, glibc_defaults: bool = False, **options) -> dict:
    """Load `model_dir` with LoadOptions `options` in a child process (then decode `decode_tokens`
    tokens); its measurements (bytes). `glibc_defaults`: leave glibc's malloc settings as a user's
    process has them (then the peak includes freed blocks glibc keeps)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if not glibc_defaults:
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
    out = subprocess.run(module_argv("bench.quant.load_peak", "--child", model_dir, json.dumps(options), decode_tokens),
                         capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"loading {model_dir} with {options} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="a flashllm model directory (or --shape)")
    p.add_argument("--shape", help="write a random bench/models/make_model.py model of this shape into a temporary "
                   "directory under --work-dir, measure it, delete it")
    p.add_argument("--work-dir", default=tempfile.gettempdir(), help="(default: %(default)s)")
    p.add_argument("--quantize-resident", default="int4,int8,none", help="comma-separated (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default: %(default)s)")
    p.add_argument("--out", help="markdown report to write")
    return p


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # measure()'s child process
        print(json.dumps(_child(argv[1], json.loads(argv[2]), int(argv[3]))))
        return
    args = setup_arg_parser().parse_args(argv)
    tmp = None
    try:
        if args.shape:
            from bench.models.make_model import spec_for, write_model

            tmp = Path(tempfile.mkdtemp(prefix="load-peak-", dir=args.work_dir))
            model_dir = write_model(spec_for(args.shape), tmp / args.shape, "float16", shape_name=args.shape)
        else:
            model_dir = args.model_dir
        rows = []
        for q in args.quantize_resident.split(","):
            # hybrid with no resident FFN rows: the resident tensors, a 64-token KV cache and one layer's
            # (untouched) read buffer, so the peak is the resident loading's
            opts = {"mode": "hybrid", "hybrid_fraction": 0.0, "quantize_resident": q, "context": 64,
                    "dtype": args.dtype}
            print(f"loading with --quantize-resident {q} ...", file=sys.stderr, flush=True)
            rows.append({"quantize_resident": q, **measure(model_dir, **opts)})
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    L = ["| --quantize-resident | load peak (MiB) | held after load (MiB) | transient (MiB) | "
         f"resident weights held (MiB) | float resident (MiB) | largest stored tensor (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['quantize_resident']} | {r['peak'] / MiB:,.0f} | {r['held'] / MiB:,.0f} | "
                 f"{r['transient'] / MiB:,.0f} | {r['resident_held'] / MiB:,.0f} | {r['float_resident'] / MiB:,.0f} | "
                 f"{r['largest_tensor'] / MiB:,.0f} |")
    text = "\n".join(L) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
