"""The torch half of `flashllm profile`: cast and one-token matvec throughput, measured with torch (kept
here so the runtime core stays free of torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def threads() -> int:
    return torch.get_num_threads()


def measure_casts(dtypes, best, nbytes: int = 32 << 20) -> dict:
    """Bytes per second of a tensor copy from each compute dtype to each other."""
    out = {}
    for src in dtypes:
        x = torch.ones(nbytes // 4, dtype=getattr(torch, src))
        for dst in dtypes:
            if src != dst:
                y = torch.empty(x.shape, dtype=getattr(torch, dst))
                out[f"{src}->{dst}"] = y.numel() * y.element_size() / best(lambda: y.copy_(x), 5)
    return out


def measure_matvec(dtypes, shapes, best, device: str = "cpu") -> dict:
    """Per compute dtype, one-token `linear` times as per_call_s + bytes / bytes_per_s: the bandwidth from
    the largest weight (where the per-call cost vanishes), the per-call cost from the smallest."""
    out = {}
    for name in dtypes:
        dt = getattr(torch, name)
        sizes, times = [], []
        for rows, d in shapes:
            w = torch.randn(rows, d, device=device).to(dt)
            x = torch.randn(1, d, device=device).to(dt)
            sizes.append(rows * d * w.element_size())
            times.append(best(lambda: F.linear(x, w)))
        bw = sizes[-1] / times[-1]
        out[name] = {"per_call_s": float(max(times[0] - sizes[0] / bw, 0.0)), "bytes_per_s": float(bw)}
    return out
