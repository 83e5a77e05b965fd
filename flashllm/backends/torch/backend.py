"""The decoder math on torch (CPU or CUDA): embeddings, attention with a static KV cache, FFN, head.

Attention is in attention.py, the FFN in ffn.py, a neuron cache's rows in rows.py (beside this file)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashllm import hugepages
from flashllm.errors import FlashLLMError
from flashllm.format.rope import Rope, layer_ropes
from flashllm.format.spec import ArchSpec
from flashllm.backends.base import Backend, compute_threads, default_compute_dtype
from flashllm.backends import native
from flashllm.backends.torch.staging import StagingRing, host_array
from flashllm.backends.torch.attention import TorchAttention
from flashllm.backends.torch.ffn import DOWN_KERNEL, TorchFFN
from flashllm.backends.torch.native import NATIVE_DTYPES, NativeKernels
from flashllm.backends.torch.qmatrix import NativeExpertSlots, NativeQuantMatrix
from flashllm.backends.torch.quant import Int4ExpertSlots, KVCache, QuantMatrix, QuantRows, dequantize_rows
from flashllm.backends.torch.rows import TorchRowStore

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# torch's intra-op threads before any load changed them (OMP_NUM_THREADS or the cores): the default
# --compute-threads never goes above it, and a later load may use more than an earlier busy one chose
INITIAL_THREADS = torch.get_num_threads()


class TorchBackend(TorchAttention, TorchFFN, Backend):
    """Holds resident weights and the KV cache on one torch device and computes one decoder."""

    name = "torch"
    STAGING_BYTES = 256 << 10  # per staging buffer (more would be taken from the caches, for no faster reads)
    STAGING_BUFFERS = 2  # on CUDA a ring: one is read into while the other's copy is in flight (CPU: 1)

    def __init__(self, spec: ArchSpec, device: str, dtype: str | None, storage_dtype: str, context: int,
                 quantized_ffn: bool = False, kv_bits: int = 16, kernels: str = "tuned", threads: int | None = None):
        self.spec = spec
        self.device = torch.device(_device(device))
        if self.device.type == "cpu":
            self.STAGING_BUFFERS = 1  # the cast out of staging is synchronous: nothing to overlap
        self.dtype_name = default_compute_dtype(dtype, storage_dtype, self.device.type == "cpu",
                                                quantized_ffn=quantized_ffn and not spec.is_moe)
        self.storage_dtype_name = storage_dtype
        self.dtype = cdt = DTYPES[self.dtype_name]
        self.storage_dtype = DTYPES[storage_dtype]
        self.itemsize = cdt.itemsize
        self.quantized_ffn = quantized_ffn  # FFN bundles are quantized (see native_quant for how they are held)
        self.tuned = kernels == "tuned"  # fused projections and per-dtype kernels (see fuse_resident, _down)
        self.down_kernel = DOWN_KERNEL[self.dtype_name] if self.device.type == "cpu" and self.tuned else "matmul"
        self.context = context
        self.threads = 1
        if self.device.type == "cpu":
            self.threads = compute_threads(threads, INITIAL_THREADS)
            torch.set_num_threads(self.threads)
        self._down_buf = None  # "chunked": (float32 rows [DOWN_CHUNK, d], float32 accumulator [d]), made once
        # one decode token's mat-vecs and sparse FFN in C (backends/native) where it builds; torch otherwise
        lib = native.library() if self.device.type == "cpu" and self.tuned else None
        self.native = NativeKernels(lib, self.threads) if lib is not None else None
        # the kernels, chosen once: the native ones for one decode token where they serve the compute dtype
        # (float16, bfloat16; quantized FFN rows as stored at any float dtype), else torch's
        floats = self.native if self.native is not None and self.dtype in NATIVE_DTYPES else None
        self._matvec = None if floats is None else floats.linear  # x [1, in] @ w.T + b
        self._low_rank = None if floats is None else floats.low_rank
        self._row_ffn = self.native.ffn if self.ffn_index_in_place() else None  # one token over cache rows
        self._native_attend = floats.attend if floats is not None and kv_bits == 16 and not spec.attn_softcap else None
        self.norm = self._layer_norm if spec.norm == "layernorm" else self._native_rms_norm if floats is not None \
            else self._fused_rms_norm if self.tuned else self._rms_norm
        self._block_args: list[tuple | None] = [None] * spec.n_layers  # per layer: its one-call attention block's
        # fixed arguments, made at load (prepare_attention)
        self._rope_addr: dict = {}  # rope -> (its _rope_rows entry, (values, cos address, sin address))
        self.w: dict[str, torch.Tensor] = {}
        self.kv_bits = kv_bits
        self.kvs = [self.new_kv()]  # one KV cache per sequence decoded together (set_sequences)
        self.act = self.activation(spec.activation, spec.activation_threshold)
        self.ropes = layer_ropes(spec)
        self._rope_rows: dict[Rope, tuple] = {}  # rope -> (pos, count, cos, sin) of the current call

    # -- weights -------------------------------------------------------------------------------
    def tensor(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A weight block (numpy or torch, any float dtype) as a device tensor in the compute dtype."""
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return t.to(device=self.device, dtype=self.dtype)

    def storage_view(self, raw: np.ndarray, dtype: str | None = None) -> torch.Tensor:
        return torch.from_numpy(raw).view(DTYPES[dtype] if dtype else self.storage_dtype)

    def new_kv(self) -> KVCache:
        return KVCache(self.spec, self.context, self.dtype, self.device, self.kv_bits)

    def kv_bytes(self) -> int:
        return sum(kv.nbytes() for kv in self.kvs)

    @staticmethod
    def nbytes_of(t: torch.Tensor | QuantMatrix | QuantRows) -> int:
        return t.nbytes if isinstance(t, (QuantMatrix, QuantRows)) else t.numel() * t.element_size()

    def dequantized(self, raw: np.ndarray, layout) -> torch.Tensor:
        return dequantize_rows(raw, layout.quant, layout.d_model, self.dtype, self.device)

    def quantized(self, t: torch.Tensor, bits: int, gather: bool) -> QuantMatrix:
        if self.on_gpu:  # the weights are quantized on the host before they move: refuse here, at load
            raise FlashLLMError("--quantize-resident runs on the CPU only (torch's weight-only CPU kernels); "
                                "on CUDA use --quantize-resident none")
        if self.native is not None and NativeQuantMatrix.takes(t, bits):  # int8-activation kernels (qmatrix.py)
            return NativeQuantMatrix(t, bits, self.dtype, self.native)
        return QuantMatrix(t, bits, self.dtype, gather)

    def row_store(self, capacity: int, layout, biases: dict):
        return TorchRowStore(self, capacity, layout, biases)

    def reads_in_place(self) -> bool:
        plain = self.dtype == self.storage_dtype and not self.quantized_ffn
        return self.device.type == "cpu" and (plain or self.native_quant())

    def native_quant(self) -> bool:
        """Whether quantized FFN bundles stay as stored (cache rows read in place, dense rows as read: QuantRows)
        for the native int8/int4 kernels, which dequantize in registers; else they are dequantized into rows of
        the compute dtype when read. MoE experts: expert slots."""
        return self.native is not None and self.quantized_ffn and not self.spec.is_moe

    def bundle_rows(self, block: np.ndarray, layout, parts: tuple[str, ...] | None = None,
                    keep_quantized: bool = False) -> dict:
        """As Backend.bundle_rows; with `keep_quantized` and the native kernels, quantized parts stay as read."""
        if not (keep_quantized and layout.quant and self.native_quant()):
            return super().bundle_rows(block, layout, parts, keep_quantized)
        return {p: QuantRows(block, layout.part_range(p).start, layout.quant, layout.d_model)
                for p in parts or layout.parts}

    def _experts_as_rows(self, layout) -> bool:
        """Quantized experts stored as rows stay as stored for the native expert kernel (qmatrix.py)."""
        return self.native is not None and NativeExpertSlots.fits(layout)

    def expert_slot_bytes(self, layout) -> int | None:
        """Quantized experts as stored for the native kernel, else int4 experts in torch's CPU int4 kernel layout
        (tuned kernels on the CPU)."""
        if self._experts_as_rows(layout):
            return layout.stride
        ok = self.tuned and self.device.type == "cpu" and Int4ExpertSlots.fits(layout)
        return Int4ExpertSlots.slot_bytes(layout) if ok else None

    def expert_reads_in_place(self, layout) -> bool:
        if self._experts_as_rows(layout):
            return True
        return bool(self.expert_slot_bytes(layout)) and Int4ExpertSlots.reads_in_place(layout)

    def expert_slots(self, layout, capacity: int) -> Int4ExpertSlots | NativeExpertSlots:
        if self._experts_as_rows(layout):
            return NativeExpertSlots(capacity, layout, self.host_buffer((capacity, layout.stride)))
        return Int4ExpertSlots(capacity, layout, self.dtype, self.host_buffer((capacity, Int4ExpertSlots.slot_bytes(layout))))

    def staging(self, stride: int) -> StagingRing:
        """One staging ring shared by every cache of this backend (caches fill one after another)."""
        if getattr(self, "_staging", None) is None or self._staging.buffers[0].shape[1] != stride:
            self._staging = StagingRing(self.staging_rows(stride), stride, self.device, self.STAGING_BUFFERS)
        return self._staging

    def host_buffer(self, shape) -> np.ndarray:
        """A page-aligned host buffer for flash reads (pinned when the device is a GPU)."""
        return host_array(int(np.prod(shape)), self.on_gpu).reshape(shape)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def kernels(self) -> str:
        served = "/".join(NATIVE_DTYPES.values())
        if self.native is None:
            return "torch" if self.device.type != "cpu" or not self.tuned else native.describe()
        quant = "; int8/int4 FFN rows as stored (native)" if self.native_quant() else ""
        quant += "; int8/int4 resident matrices and experts as quantized rows (native, int8 activations)"
        if self.dtype not in NATIVE_DTYPES:
            return f"torch (the native kernels serve {served} compute){quant}"
        return f"{native.describe()}: {served} decode mat-vecs and cache-row FFN{quant}; torch otherwise"

    def linear(self, x: torch.Tensor, w: torch.Tensor | QuantMatrix | QuantRows, b: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, QuantRows):  # FFN rows as stored (native_quant): natively for one token, else dequantized
            y = self.native.qlinear(x, w, b) if self.native is not None else None
            return y if y is not None else F.linear(x, w.values(x.dtype), b)
        if isinstance(w, QuantMatrix):
            return w.linear(x, b)
        if self._matvec is not None and x.shape[0] == 1:
            y = self._matvec(x, w, b)
            if y is not None:  # (a weight of another layout: torch's)
                return y
        return F.linear(x, w, b)

    def low_rank(self, x: torch.Tensor, proj_in, proj_out, bias) -> np.ndarray:
        if self._low_rank is not None and x.shape[0] == 1:
            logits = self._low_rank(x, proj_in, proj_out, bias)
            if logits is not None:  # (predictor weights of another layout: torch's)
                return logits
        return super().low_rank(x, proj_in, proj_out, bias)

    def columns(self, x: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
        return x.index_select(1, torch.from_numpy(ids).to(x.device))

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()

    def sync(self, out) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    relu, square, gelu, silu, tanh = map(staticmethod, (F.relu, torch.square, F.gelu, F.silu, torch.tanh))

    @staticmethod
    def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype)

    def rope_array(self, table: np.ndarray) -> torch.Tensor:
        """[count, 1, rope dim] on the device (broadcast over heads of [T, heads, head_dim])."""
        return torch.from_numpy(table)[:, None, :].to(self.device)

    def zeros_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def zeros(self, shape) -> torch.Tensor:
        """A preallocated array of `shape` in the compute dtype on the device (e.g. expert slots)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- forward pieces ------------------------------------------------------------------------
    # `norm(name, x)` is one of these, chosen in __init__
    def _layer_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        t0, w, b = self._tic(), self.w[name + ".weight"], self.w.get(name + ".bias")
        return self._toc("norms", t0, F.layer_norm(x, (x.shape[-1],), w, b, self.spec.norm_eps))

    def _native_rms_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """`_fused_rms_norm`'s result in one C pass."""
        t0, w = self._tic(), self.w[name + ".weight"]
        y = self.native.rms_norm(x, w, self.spec.norm_eps)
        return self._toc("norms", t0, y) if y is not None else self._fused_rms_norm(name, x)

    def _fused_rms_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """One fused float32 kernel (torch's rms_norm), then transformers' cast and scale."""
        t0, w = self._tic(), self.w[name + ".weight"]
        return self._toc("norms", t0, w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.spec.norm_eps).to(x.dtype))

    def _rms_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm, op by op (the "plain" kernels)."""
        t0, w, xf = self._tic(), self.w[name + ".weight"], x.float()
        y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps)).to(x.dtype)
        return self._toc("norms", t0, y)

    def embedding_rows(self, ids: list[int]) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        table = self.w["embed.weight"]
        return table.rows(idx) if isinstance(table, QuantMatrix) else table[idx]

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def resident_empty(self, shape) -> torch.Tensor:
        """An uninitialised tensor of the compute dtype for a weight built at load (fused, packed): on the
        CPU on 2 MiB huge pages (`hugepages`; torch's allocator gives 4 KiB pages), as numpy already gives
        the loader's reads."""
        if self.device.type != "cpu" or not hugepages.enabled():
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        raw = hugepages.empty(int(np.prod(shape)) * self.dtype.itemsize)
        return torch.from_numpy(raw).view(self.dtype).view(tuple(shape))

    def fuse_resident(self) -> None:
        """At load: each layer's q, k, v weights (and biases) as one matrix, so a token's projections
        are one call streaming one matrix. Same math; skipped for layers whose q/k/v are not plain
        tensors of the compute dtype (e.g. quantized) and with the "plain" kernels. Then each layer's
        one-call attention block is prepared where it applies (`prepare_attention`)."""
        if self.tuned:
            self._fuse_qkv()
        self.prepare_attention()

    def _fuse_qkv(self) -> None:
        for layer in range(self.spec.n_layers):
            p = f"layers.{layer}."
            names = [p + n + ".weight" for n in "qkv"]
            if all(type(self.w.get(n)) is NativeQuantMatrix for n in names) \
                    and len({self.w[n].bits for n in names}) == 1 and not any(p + n + ".bias" in self.w for n in "qkv"):
                self.w[p + "qkv.weight"] = NativeQuantMatrix.concat([self.w.pop(n) for n in names])
                continue
            if not all(type(self.w.get(n)) is torch.Tensor and self.w[n].dtype == self.dtype for n in names):
                continue
            for kind in ("weight", "bias"):
                parts = [self.w.get(f"{p}{n}.{kind}") for n in "qkv"]
                if all(t is not None for t in parts):
                    out = self.resident_empty((sum(map(len, parts)), *parts[0].shape[1:])) if kind == "weight" else None
                    self.w[f"{p}qkv.{kind}"] = torch.cat(parts, out=out)
                    for n in "qkv":
                        del self.w[f"{p}{n}.{kind}"]


def _device(device: str | None) -> str:
    device = "cuda" if device == "gpu" else device or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FlashLLMError(f"device {device!r}: CUDA is not available on this machine (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise FlashLLMError(f"device {device!r}: the torch backend supports cpu and cuda")
    return device
