"""Kernel surveys behind the torch backend's choices, on a model's real shapes, one token.

- down: the down projection over cached bundle rows (n = d_ffn / 2 rows, each a bundle of up|down
  or up|gate|down, so the down parts are strided), per formulation (torch_backend.DOWN_KERNEL).
- ffn: one token's whole FFN over n = d_ffn / 2 cached bundle rows: the torch backend's path (up and gate
  products, activation, the DOWN_KERNEL down projection) against the native one-pass kernel
  (flashllm/backends/native: each row's gate and up dot products, activation, and its down row added
  to a float32 sum), at 1 and 2 threads; GB/s of the rows streamed.
- attention: one decode token's attention over S cached keys of every head: SDPA over the
  a sequence-major cache against the head-major cache's batched products
  (TorchBackend._decode_attention, what the runtime runs).

Each case rotates through copies larger than the last-level cache, so operands come from DRAM.
Used by bench/compute/roofline.py (its report prints both tables).
"""

from __future__ import annotations

import math
import time

from bench.harness import GB


def _best(fn, items, rounds: int) -> float:
    """Best seconds per call of fn(item) over `rounds` passes through `items` (one pass warms up)."""
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - t0) / len(items))
    return min(times[1:])


def _copies(nbytes: int, llc: int) -> int:
    return min(16, max(2, math.ceil(3 * llc / nbytes)))


def down_kernels(d: int, n: int, dt) -> dict:
    """Formulations of h [1, n] @ rows [n, d] over a strided view of the rows: name -> fn(rows, h)."""
    import torch

    from flashllm.backends.torch.ffn import DOWN_CHUNK, chunked_down

    out, chunk, acc = torch.empty(d, dtype=dt), torch.empty(DOWN_CHUNK, d), torch.empty(d)
    return {"h @ rows (matmul)": lambda m, h: h @ m,
            "mv(rows.t(), h)": lambda m, h: torch.mv(m.t(), h[0]),
            "addmv(out=)": lambda m, h: torch.addmv(out, m.t(), h[0], beta=0, out=out),
            "float32 upcast": lambda m, h: h.float() @ m.float(),
            f"float32 in {DOWN_CHUNK}-row pieces (chunked)": lambda m, h: chunked_down(h, m, chunk, acc)}


def down_survey(spec, dtypes, rounds: int, llc: int, parts: int = 2) -> list[dict]:
    """One token's down projection over bundle rows [n, parts * d] (the down part the last d columns)
    per kernel, and the same product over a contiguous [d, n] matrix (the dense plan's packed layout,
    the rate a layout change would buy) as "linear over [d, n] (packed)"."""
    import torch
    import torch.nn.functional as F

    d, n = spec.d_model, spec.d_ffn // 2
    rows = []
    for dtype in [t for t in dtypes if t in ("float32", "float16", "bfloat16")]:
        dt = getattr(torch, dtype)
        copies = _copies(n * parts * d * dt.itemsize, llc)
        mats = [torch.randn(n, parts * d).to(dt)[:, (parts - 1) * d:] for _ in range(copies)]
        packed = [m.t().contiguous() for m in mats]
        h = torch.randn(1, n).to(dt)
        cases = {name: (lambda fn: lambda m: fn(m, h))(fn) for name, fn in down_kernels(d, n, dt).items()}
        for name, fn in cases.items():
            s = _best(fn, mats, rounds)
            rows.append(dict(dtype=dtype, kernel=name, ms=s * 1e3, best_gbps=n * d * dt.itemsize / s / GB))
        s = _best(lambda w: F.linear(h, w), packed, rounds)
        rows.append(dict(dtype=dtype, kernel="linear over [d, n] (packed)", ms=s * 1e3,
                         best_gbps=n * d * dt.itemsize / s / GB))
    return rows


def torch_ffn(x, d: int):
    """fn(rows): the torch backend's FFN over rows {[gate], up, down} [n, d] of x's dtype (torch ops only:
    up and gate products, SiLU, the DOWN_KERNEL down projection)."""
    import torch
    import torch.nn.functional as F

    from flashllm.backends.torch.ffn import DOWN_CHUNK, DOWN_KERNEL, chunked_down

    kernel, chunk, acc = DOWN_KERNEL[str(x.dtype).removeprefix("torch.")], torch.empty(DOWN_CHUNK, d), torch.empty(d)

    def run(r):
        up = F.linear(x, r["up"])
        h = F.silu(F.linear(x, r["gate"])) * up if "gate" in r else F.silu(up)
        if kernel == "chunked":
            return chunked_down(h, r["down"], chunk, acc)
        return torch.mv(r["down"].t(), h[0]) if kernel == "mv" else h @ r["down"]
    return run


def ffn_survey(spec, dtypes, rounds: int, llc: int, threads=(1, 2)) -> list[dict]:
    """One token's FFN over n = d_ffn / 2 bundle rows ([gate|]up|down, the cache's row stride) per path."""
    import torch

    from flashllm.backends import native
    from flashllm.backends.torch.native import NATIVE_DTYPES, NativeKernels

    d, n, default_threads = spec.d_model, spec.d_ffn // 2, torch.get_num_threads()
    names = ("gate", "up", "down") if spec.gated_ffn else ("up", "down")
    lib, rows = native.library(), []
    for dtype in [t for t in dtypes if t in ("float32", "float16", "bfloat16")]:
        dt = getattr(torch, dtype)
        nbytes = n * len(names) * d * dt.itemsize
        mats = []
        for _ in range(_copies(nbytes, llc)):
            m = torch.randn(n, len(names) * d).to(dt) * d ** -0.5
            mats.append({p: m[:, k * d:(k + 1) * d] for k, p in enumerate(names)})
        x = torch.randn(1, d).to(dt)
        torch_path = torch_ffn(x, d)
        for t in threads:
            torch.set_num_threads(t)
            cases = {"torch ops": torch_path}
            if lib is not None and dt in NATIVE_DTYPES:
                kn, out = NativeKernels(lib, t), torch.zeros(1, d)
                cases["native one pass"] = lambda r, kn=kn, out=out: kn.ffn(
                    x, r, None, None, None, "silu", 0.0, None, None, out.zero_(), "gate" in r)
            for name, fn in cases.items():
                sec = _best(fn, mats, rounds)
                rows.append(dict(dtype=dtype, threads=t, kernel=name, ms=sec * 1e3, best_gbps=nbytes / sec / GB))
    torch.set_num_threads(default_threads)
    return rows + quant_ffn_survey(spec, [t for t in dtypes if t in ("int8", "int4")], rounds, llc, threads)


def quant_ffn_survey(spec, names, rounds: int, llc: int, threads=(1, 2), group: int = 64) -> list[dict]:
    """The FFN over n = d_ffn / 2 int8/int4 bundle rows as the converter stores them (asymmetric, groups of
    `group`), bfloat16 activations: the native kernel over the codes as stored (QuantRows, dequantized in
    registers) against torch's path over the same rows dequantized to bfloat16 beforehand (what the cache held
    before: rows dequantized on insert, a cost not in this table) and that dequantization per row set. GB/s of
    the bytes each case streams (codes and scales; bfloat16 rows for torch)."""
    import numpy as np
    import torch

    from flashllm.backends import native
    from flashllm.backends.torch.native import NativeKernels
    from flashllm.backends.torch.quant import QuantRows, dequantize_rows
    from flashllm.format.quant import QuantScheme

    d, n, default_threads = spec.d_model, spec.d_ffn // 2, torch.get_num_threads()
    names_ = ("gate", "up", "down") if spec.gated_ffn else ("up", "down")
    lib, dt, out = native.library(), torch.bfloat16, []
    group = math.gcd(group, d)  # tiny test shapes
    for name in names:
        q = QuantScheme.named(name, group, "asymmetric")
        label = f"{name} g{group} (bfloat16 x)"
        pb = q.part_bytes(d)
        qbytes, bbytes = n * len(names_) * pb, n * len(names_) * d * dt.itemsize
        gen = torch.Generator().manual_seed(0)
        stores, plain = [], []
        for _ in range(_copies(qbytes + bbytes, llc)):
            w = (torch.randn(len(names_), n, d, generator=gen) * d ** -0.5).numpy()
            raw = np.concatenate([q.quantize(p) for p in w], axis=1)
            stores.append({p: QuantRows(raw, k * pb, q, d) for k, p in enumerate(names_)})
            plain.append({p: dequantize_rows(raw[:, k * pb:(k + 1) * pb], q, d, dt, torch.device("cpu"))
                          for k, p in enumerate(names_)})
        x = torch.randn(1, d).to(dt)
        for t in threads:
            torch.set_num_threads(t)
            sec = _best(lambda r: {p: dequantize_rows(v.raw[:, v.offset:v.offset + pb], q, d, dt, torch.device("cpu"))
                                   for p, v in r.items()}, stores, rounds)
            out.append(dict(dtype=label, threads=t, kernel="dequantize the rows to bfloat16",
                            ms=sec * 1e3, best_gbps=qbytes / sec / GB))
            if lib is None:
                continue
            kn, acc = NativeKernels(lib, t), torch.zeros(1, d)
            cases = {"torch ops": (plain, bbytes, torch_ffn(x, d)),
                     "native one pass": (stores, qbytes, lambda r: kn.ffn(x, r, None, None, None, "silu", 0.0, None,
                                                                          None, acc.zero_(), "gate" in r))}
            for kernel, (items, nbytes, fn) in cases.items():
                sec = _best(fn, items, rounds)
                out.append(dict(dtype=label, threads=t, kernel=kernel, ms=sec * 1e3,
                                best_gbps=nbytes / sec / GB))
    torch.set_num_threads(default_threads)
    return out


def attention_survey(spec, dtypes, rounds: int, llc: int, lengths=(256, 2048)) -> list[dict]:
    """One decode token's attention (all heads, one layer) over S keys per formulation."""
    import torch
    import torch.nn.functional as F

    from flashllm.backends.torch.backend import TorchBackend

    H, Hk, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    scale, gqa = hd ** -0.5, H != Hk
    rows = []
    for dtype in [t for t in dtypes if t in ("float32", "float16", "bfloat16")]:
        dt = getattr(torch, dtype)
        for S in lengths:
            nbytes = 2 * S * Hk * hd * dt.itemsize
            copies = _copies(nbytes, llc)
            q = torch.randn(1, H, hd).to(dt)
            seq = [(torch.randn(S, Hk, hd).to(dt), torch.randn(S, Hk, hd).to(dt)) for _ in range(copies)]
            head = [(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) for k, v in seq]
            cases = {
                "SDPA, sequence-major cache": (seq, lambda kv: F.scaled_dot_product_attention(
                    q.transpose(0, 1), kv[0].transpose(0, 1), kv[1].transpose(0, 1), scale=scale, enable_gqa=gqa)),
                "SDPA, head-major cache": (head, lambda kv: F.scaled_dot_product_attention(
                    q.transpose(0, 1), kv[0], kv[1], scale=scale, enable_gqa=gqa)),
                "batched products, head-major (runtime)": (head, lambda kv: TorchBackend._decode_attention(
                    q[0], kv[0], kv[1], scale)),
            }
            for name, (items, fn) in cases.items():
                s = _best(fn, items, rounds)
                rows.append(dict(dtype=dtype, keys=S, kernel=name, ms=s * 1e3, best_gbps=nbytes / s / GB))
    return rows


def tables(down: list[dict], attention: list[dict], ffn: list[dict] = ()) -> list[str]:
    """Markdown tables of the surveys (ms per call, GB/s of the operand streamed)."""
    lines = []
    for title, rows, key in (("Down projection over bundle rows (one token, n = d_ffn/2 rows with the bundle's "
                              "row stride)", down, lambda r: r["dtype"]),
                             ("The FFN over cached bundle rows (one token, n = d_ffn/2 rows; GB/s of the rows)", ffn,
                              lambda r: f"{r['dtype']}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}"),
                             ("Decode attention, one layer, all heads (one token over S keys)", attention,
                              lambda r: f"{r['dtype']}, S={r['keys']}")):
        if not rows:
            continue
        kernels = list(dict.fromkeys(r["kernel"] for r in rows))
        lines += [f"## {title}", "", "| case | " + " | ".join(kernels) + " |", "|---|" + "---|" * len(kernels)]
        for case in dict.fromkeys(map(key, rows)):
            cell = {r["kernel"]: r for r in rows if key(r) == case}
            lines.append(f"| {case} | " + " | ".join(f"{cell[k]['ms']:.2f} ms ({cell[k]['best_gbps']:.1f} GB/s)"
                                                     if k in cell else "-" for k in kernels) + " |")
        lines.append("")
    return lines
