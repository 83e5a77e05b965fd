"""The decoder math on torch (CPU or CUDA): embeddings, attention with a static KV cache, FFN, head.

Attention is in flashllm/backends/torch/attention.py, a neuron cache's rows in rows.py beside it."""

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
from flashllm.backends.torch.native import NATIVE_DTYPES, NativeKernels
from flashllm.backends.torch.quant import Int4ExpertSlots, KVCache, QuantMatrix, QuantRows, dequantize_rows
from flashllm.backends.torch.rows import TorchRowStore

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# torch's intra-op threads before any load changed them (OMP_NUM_THREADS or the cores): the default
# --compute-threads never goes above it, and a later load may use more than an earlier busy one chose
INITIAL_THREADS = torch.get_num_threads()


# How one token's down projection h[1, n] @ rows[n, d] (rows = cache rows, any row stride) runs on the CPU
# where the native kernels do not, per compute dtype (the fastest measured: docs/architecture.md, "Defaults"):
# torch's float16/bfloat16 vector-matrix `h @ rows` takes a scalar path and its matrix-vector `mv(rows.t(), h)`
# converts float16 one value at a time; "chunked" casts DOWN_CHUNK rows at a time into a cache-sized float32
# buffer (vectorized) and accumulates float32 BLAS addmv over them: the products and the float32 sum of mv,
# rounded once. float32 goes to BLAS either way. "matmul": torch's default ("plain").
DOWN_KERNEL = {"float32": "matmul", "bfloat16": "mv", "float16": "chunked"}
DOWN_CHUNK = 64  # rows per float32 piece: 64 x 4096 x 4 B = 1 MiB, about a core's L2


class TorchBackend(TorchAttention, Backend):
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

    def expert_slot_bytes(self, layout) -> int | None:
        """Int4 experts stay quantized in torch's CPU int4 kernel layout (tuned kernels on the CPU)."""
        ok = self.tuned and self.device.type == "cpu" and Int4ExpertSlots.fits(layout)
        return Int4ExpertSlots.slot_bytes(layout) if ok else None

    def expert_reads_in_place(self, layout) -> bool:
        return bool(self.expert_slot_bytes(layout)) and Int4ExpertSlots.reads_in_place(layout)

    def expert_slots(self, layout, capacity: int) -> Int4ExpertSlots:
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
            if not all(type(self.w.get(n)) is torch.Tensor and self.w[n].dtype == self.dtype for n in names):
                continue
            for kind in ("weight", "bias"):
                parts = [self.w.get(f"{p}{n}.{kind}") for n in "qkv"]
                if all(t is not None for t in parts):
                    out = self.resident_empty((sum(map(len, parts)), *parts[0].shape[1:])) if kind == "weight" else None
                    self.w[f"{p}qkv.{kind}"] = torch.cat(parts, out=out)
                    for n in "qkv":
                        del self.w[f"{p}{n}.{kind}"]

    def ffn(self, x: torch.Tensor, rows: dict[str, torch.Tensor], up_bias, gate_bias, down_bias,
            threshold: float | None = None, gate_pre: torch.Tensor | None = None, index: np.ndarray | None = None,
            acc: torch.Tensor | None = None, finish: bool = False) -> torch.Tensor:
        """FFN over the neurons whose bundle parts are `rows[part]` ([n, d] each; down rows = columns),
        or packed by `pack_ffn`; with `threshold`, neurons with |act(pre)| <= threshold contribute
        zero (calibrated sparsity); `gate_pre` [T, n]: the gate pre-activations, already computed
        from resident gate rows (then `rows` has no gate). `index`: compute only these row positions
        (biases and gate_pre stay aligned with `rows`); `acc` (from `ffn_acc`): add the rows' float32
        contributions into it and return it, or with `finish` (a layer's last rows) return the FFN's
        output from it, `ffn_result(acc, x, down_bias)`."""
        t0, gated, packed = self._tic(), self.spec.gated_ffn, "down_t" in rows
        if self._row_ffn is not None and not packed and x.shape[0] == 1:  # the output rounded in the kernel call
            y = torch.empty_like(x) if acc is None or finish else None
            out = self._row_ffn(x, rows, up_bias, gate_bias, gate_pre, self.spec.activation,
                                self.spec.activation_threshold, threshold, index,
                                acc if acc is not None else self._ffn_buffer(x), gated, y=y,
                                down_bias=None if y is None else down_bias, zero=acc is None)
            if out is not None:  # (rows of another layout, e.g. experts: torch's)
                return self._toc("ffn", t0, out if y is None else y)
        if isinstance(rows.get("up"), QuantRows):  # no kernel for this call (e.g. prefill): dequantized rows
            rows = {p: t.values(self.dtype) for p, t in rows.items()}
        if index is not None:  # the selected rows (copies), their biases and pre-activations
            idx = torch.from_numpy(np.asarray(index, dtype=np.int64)).to(self.device)
            parts = ("up", "gate", "down") if gated and gate_pre is None else ("up", "down")
            rows = {p: self.ffn_part(rows, p).index_select(0, idx) for p in parts}
            up_bias, gate_bias = (None if b is None else b.index_select(0, idx) for b in (up_bias, gate_bias))
            gate_pre, packed = None if gate_pre is None else gate_pre.index_select(1, idx), False
        if acc is not None:  # float32 contributions of the rows, without the down bias
            h = self._hidden(x, rows, up_bias, gate_bias, threshold, gate_pre, packed)
            down = self.ffn_part(rows, "down")
            if self.down_kernel == "chunked" and h.shape[0] == 1:
                self._chunked_buffers(down.shape[1])
                acc.add_(chunked_down(h, down, self._down_buf[0], self._down_buf[1], True))
            else:
                acc.add_(h.float() @ down.float())
            return self._toc("ffn", t0, self.ffn_result(acc, x, down_bias) if finish else acc)
        h = self._hidden(x, rows, up_bias, gate_bias, threshold, gate_pre, packed)
        if packed:
            return self._toc("ffn", t0, self.linear(h, rows["down_t"], down_bias))
        y = self._down(h, rows["down"])
        return self._toc("ffn", t0, y + down_bias if down_bias is not None else y)

    def ffn_index_in_place(self) -> bool:
        return self.native is not None and (self.dtype in NATIVE_DTYPES or self.native_quant())

    def ffn_acc(self, x: torch.Tensor) -> torch.Tensor:
        """A float32 accumulator [T, d_model] for `ffn(..., acc=)` calls over parts of a layer's rows."""
        return torch.zeros(x.shape[0], self.spec.d_model, dtype=torch.float32, device=x.device)

    @staticmethod
    def ffn_result(acc: torch.Tensor, x: torch.Tensor, down_bias) -> torch.Tensor:
        """The FFN output from its float32 sum: rounded once to x's dtype, then the down bias added (a new tensor:
        the one-call native FFN reuses its sum's buffer)."""
        y = acc.to(x.dtype, copy=True)
        return y + down_bias if down_bias is not None else y

    def _ffn_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """The one-call native FFN's float32 accumulator [1, d_model], made once (the kernel zeroes it)."""
        if getattr(self, "_ffn_buf", None) is None:
            self._ffn_buf = torch.empty(1, self.spec.d_model, dtype=torch.float32)
        return self._ffn_buf

    def _hidden(self, x, rows, up_bias, gate_bias, threshold, gate_pre, packed) -> torch.Tensor:
        """h [T, n]: act(gate) * up (gated) or act(up), each rounded to the compute dtype as torch does."""
        gated = self.spec.gated_ffn
        if gate_pre is not None:
            up, pre = F.linear(x, rows["up"], up_bias), gate_pre
        elif packed:  # one up(+gate) product; down as a contiguous [d, n] matrix (or int4 expert slots)
            z = self.linear(x, rows["up_gate"] if gated else rows["up"], None)
            up, pre = z.chunk(2, dim=-1) if gated else (z, z)
            up = up if up_bias is None else up + up_bias
            pre = (pre if gate_bias is None else pre + gate_bias) if gated else up
        else:
            up = F.linear(x, rows["up"], up_bias)
            pre = F.linear(x, rows["gate"], gate_bias) if gated else up
        a = self.act(pre)
        if threshold is not None:
            a = a * (a.abs() > threshold)
        return a * up if gated else a

    def _down(self, h: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """h [T, n] @ down [n, d] with the kernel DOWN_KERNEL chose for the compute dtype."""
        if self.down_kernel == "matmul":
            return h @ down
        if h.shape[0] > 1:
            return (h.float() @ down.float()).to(h.dtype)  # several tokens: BLAS in float32 (prefill)
        if self.down_kernel == "mv":
            return torch.mv(down.t(), h[0])[None]
        self._chunked_buffers(down.shape[1])
        return chunked_down(h, down, *self._down_buf)

    def _chunked_buffers(self, d: int) -> None:
        if self._down_buf is None or self._down_buf[1].shape[0] != d:
            self._down_buf = (torch.empty(DOWN_CHUNK, d), torch.empty(d))

    def pack_ffn(self, rows: dict) -> dict:
        """A resident FFN's rows packed at load (dense and hybrid modes): up and gate as one [2n, d]
        matrix, down transposed to a contiguous [d, n] matrix; every token's FFN is then two
        contiguous matrix-vector products. Same math; rows that are not plain tensors of the compute
        dtype (quantized) and the "plain" kernels keep the rows as they are."""
        if not self.tuned or not all(type(t) is torch.Tensor and t.dtype == self.dtype for t in rows.values()):
            return rows
        down = rows["down"]
        packed = {"down_t": self.resident_empty(down.shape[::-1]).copy_(down.t())}
        if self.spec.gated_ffn:
            packed["up_gate"] = torch.cat((rows["up"], rows["gate"]), out=self.resident_empty(
                (2 * len(rows["up"]), *rows["up"].shape[1:])))
        else:
            packed["up"] = self.resident_empty(rows["up"].shape).copy_(rows["up"])
        return packed

    def ffn_part(self, rows: dict, part: str):
        if part in rows:
            return rows[part]
        if part == "down":
            return rows["down_t"].t()
        return rows["up"] if "up" in rows else rows["up_gate"].chunk(2)[part == "gate"]

    def moe_experts(self, x: torch.Tensor, groups: list, acc: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts: for each (rows, token ids, float32 weights) group, weights * expert(x[tokens]) added
        to those tokens' rows of a float32 accumulator [T, d_model] (a new one when `acc` is None). Summing in
        float32 makes the result independent of how a mode splits the experts (dense: all at once; streamed:
        cached ones, then chunks read into the slots), up to float32 rounding."""
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if acc is None else acc
        for rows, tokens, weights in groups:
            idx = torch.from_numpy(tokens).to(self.device)
            out = self.ffn(x[idx], rows, None, None, None).float() * torch.from_numpy(weights).to(self.device)[:, None]
            acc[idx] += out  # a token meets an expert once; index_add_ measured ~1000x slower on CPU
        return acc

    def moe_output(self, x: torch.Tensor, acc: torch.Tensor, shared: dict | None = None, shared_gate=None) -> torch.Tensor:
        """The MoE FFN's output in x's dtype: the routed experts' float32 sum `acc` plus the shared expert,
        scaled by sigmoid(shared_gate . x) if given; rounded once."""
        if shared is not None:
            out = self.ffn(x, shared, None, None, None)
            acc = acc + (torch.sigmoid(F.linear(x, shared_gate)) * out if shared_gate is not None else out).float()
        return acc.to(x.dtype)


def chunked_down(h: torch.Tensor, down: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor,
                 float32: bool = False) -> torch.Tensor:
    """h [1, n] @ down [n, d] (any row stride) as float32 BLAS over pieces of `buf`'s rows ([chunk, d] float32)
    cast from `down`, summed into `acc` [d] (float32), rounded once to h's dtype: [1, d] (`float32`: the
    sum itself, a view of `acc`)."""
    hf = h[0].float()
    acc.zero_()
    for i in range(0, down.shape[0], buf.shape[0]):
        piece = buf[:min(buf.shape[0], down.shape[0] - i)].copy_(down[i:i + buf.shape[0]])
        acc.addmv_(piece.t(), hf[i:i + len(piece)])
    return acc[None] if float32 else acc.to(h.dtype)[None]


def _device(device: str | None) -> str:
    device = "cuda" if device == "gpu" else device or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FlashLLMError(f"device {device!r}: CUDA is not available on this machine (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise FlashLLMError(f"device {device!r}: the torch backend supports cpu and cuda")
    return device
