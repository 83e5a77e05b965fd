"""The decode-token cost model (docs/cost_model.md): predicted seconds per token from a machine profile
(flashllm/planner/profile.py), the disk profile (flashllm/io/disk_profile.py) and a model's shapes and per-layer read statistics.

    token = head + sum over layers of [attention + predictor + FFN(rows held) + fixed(mode)   compute
                                       + reads * per_read(inflight) + bytes / bandwidth       I/O
                                       + placed bytes / (copy or cast bandwidth)]             memory

Every term is a measured rate times a count the runtime's own bookkeeping determines (rows held,
bundles and reads per token); nothing is fitted to the model being planned.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Parts:
    """Predicted seconds per decode token, split as the runtime's stats split them."""

    compute_s: float = 0.0  # outside the FFN kernels: attention, head, the runtime's fixed cost per layer
    predictor_s: float = 0.0
    io_s: float = 0.0
    mem_s: float = 0.0
    ffn_s: float = 0.0  # the FFN kernels (the runtime counts them in compute_ms)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.ffn_s + self.predictor_s + self.io_s + self.mem_s

    def __add__(self, other: "Parts") -> "Parts":
        return Parts(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_ms(self) -> dict:
        return {"total_ms": self.total_s * 1e3, "compute_ms": (self.compute_s + self.ffn_s) * 1e3,
                "ffn_ms": self.ffn_s * 1e3, "predictor_ms": self.predictor_s * 1e3, "io_ms": self.io_s * 1e3,
                "mem_ms": self.mem_s * 1e3}


def attention_s(machine, spec, dtype: str) -> float:
    """One layer's q, k, v, o matvecs."""
    d, hd, it = spec.d_model, spec.head_dim, ITEMSIZE[dtype]
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd
    return (machine.matvec_s(dtype, q, d, it) + 2 * machine.matvec_s(dtype, kv, d, it)
            + machine.matvec_s(dtype, d, q, it))


def head_s(machine, spec, dtype: str) -> float:
    return machine.matvec_s(dtype, spec.vocab_size, spec.d_model, ITEMSIZE[dtype])


def ffn_s(machine, spec, dtype: str, rows: float, parts: int | None = None) -> float:
    """The FFN over `rows` neurons: up (and gate) rows and down columns (`parts` of them: a resident gate
    predictor computes the gate rows itself)."""
    parts = parts or (3 if spec.gated_ffn else 2)
    return machine.matvec_s(dtype, parts * rows, spec.d_model, ITEMSIZE[dtype], calls=parts)


def predictor_s(machine, spec, dtype: str, rank: int, fixed: bool = False) -> float:
    """One layer's low-rank predictor (with the runtime's fixed cost of a prediction when `fixed`)."""
    it = ITEMSIZE[dtype]
    return machine.matvec_s(dtype, rank, spec.d_model, it) + machine.matvec_s(dtype, spec.d_ffn, rank, it) + \
        (machine.layer_s.get("predictor", 0.0) if fixed else 0.0)


def io_s(disk, reads: float, nbytes: float, threads: int, calls: float = 1.0) -> float:
    """A layer's reads, issued in `calls` engine calls of reads in flight together: each call costs the
    disk profile's per-call cost (waking the threads, waiting for the slowest read), each read the
    amortised per-read time at the depth in flight (profiles without call costs: the amortised cost of
    one-wave calls, which carries the call's cost in every read)."""
    if reads <= 0:
        return 0.0
    calls = max(calls, 1e-9)
    depth = max(1, min(threads, int(round(reads / max(calls, 1.0)))))
    model = getattr(disk, "call_cost_model", lambda q: None)(depth)
    if model is None:
        per_read, bandwidth = disk.cost_model(depth)
        return reads * per_read + nbytes / bandwidth
    call, per_read, bandwidth = model
    return calls * call + reads * per_read + nbytes / bandwidth


def resident_s(machine, spec, dtype: str, kind: str) -> float:
    """What every decode token computes regardless of the FFN plan: attention, head, fixed costs."""
    return spec.n_layers * (attention_s(machine, spec, dtype) + machine.layer_s[kind]) + head_s(machine, spec, dtype)
