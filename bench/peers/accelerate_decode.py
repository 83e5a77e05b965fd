"""HF transformers + accelerate disk offload decoding token ids one at a time: bench/peers/run.py's peer run.

What a user of HF transformers does to run a model bigger than the memory given to it:
`from_pretrained(..., device_map="auto", max_memory={"cpu": BUDGET}, offload_folder=DIR)`:
accelerate keeps the first modules that fit in BUDGET in DRAM and offloads the rest to "disk";
an offloaded module's weights are read again at every forward. For a safetensors checkpoint
transformers maps offloaded weights to where they already are (no second copy is written; the
bytes found in DIR afterwards are reported). The prompt is one token; then each decode token is
timed and appended as a JSON line to --progress as soon as it is done, so a run stopped by a
timeout still tells how far it got.

    python -m bench peers accelerate HF_DIR --max-memory BYTES --tokens 4 --progress FILE [--offload-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir")
    p.add_argument("--max-memory", type=int, required=True, help="accelerate's max_memory for the CPU, bytes")
    p.add_argument("--tokens", type=int, default=4, help="decode tokens after the 1-token prompt (default: %(default)s)")
    p.add_argument("--progress", required=True, help="JSON lines: one event per line (load, each token)")
    p.add_argument("--offload-dir", default=None, help="accelerate's offload_folder (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    log = open(args.progress, "a", buffering=1)

    def emit(**event):
        log.write(json.dumps(event) + "\n")

    with tempfile.TemporaryDirectory(prefix="peers-offload-", dir=args.offload_dir) as offload:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float16, device_map="auto",
                                                     max_memory={"cpu": args.max_memory}, offload_folder=offload)
        model.eval()
        placement = list(getattr(model, "hf_device_map", {}).values())
        emit(event="load", load_s=time.perf_counter() - t0, offload_folder_bytes=folder_bytes(Path(offload)),
             modules_cpu=placement.count("cpu"), modules_disk=placement.count("disk"),
             torch=torch.__version__, threads=torch.get_num_threads())
        vocab = model.config.vocab_size
        ids = np.random.default_rng(args.seed).integers(3, vocab, size=1 + args.tokens).tolist()
        past = None
        with torch.inference_mode():
            for pos, token in enumerate(ids):
                t = time.perf_counter()
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                if pos:  # position 0 is the prompt
                    emit(event="token", ms=(time.perf_counter() - t) * 1e3)
    emit(event="done", rss_peak=_vm_hwm())
    log.close()
    os._exit(0)  # accelerate's hooks can make interpreter teardown slow; everything is written


def _vm_hwm() -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


if __name__ == "__main__":
    main()
