"""The backend contract: what the runtime asks of an array library, and the code backends share.

A backend holds the resident weights (`w`, canonical names) and the KV cache on one device and
computes one decoder. Everything else (which neurons, when to read, budgets, sampling) is the
runtime's. Dtypes cross this boundary as neutral names ("float32", "float16", "bfloat16"); raw
flash bytes cross as uint8 numpy arrays.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager

import numpy as np

from flashllm.budget import row_bytes
from flashllm.errors import FlashLLMError

DTYPE_NAMES = ("float32", "float16", "bfloat16")
RESIDENT_QUANT_BITS = {"none": None, "int8": 8, "int4": 4}  # --quantize-resident choices
# the resident matrices --quantize-resident holds quantized: attention projections, embeddings, lm_head
QUANTIZED_RESIDENT = re.compile(r"(embed|lm_head|layers\.\d+\.[qkvo])\.weight")


def default_compute_dtype(requested: str | None, storage: str, on_cpu: bool, float16_on_cpu: bool = True,
                          quantized_ffn: bool = False) -> str:
    """The compute dtype: the requested one, else the storage dtype, except float16 files on a CPU
    whose backend is slow in float16 (`float16_on_cpu` False: MLX's CPU build), which compute in
    float32. torch CPU keeps float16: its matrix-vector products stream float16 at least as many
    values per second as float32 at half the bytes, and a 7B float16 model fits in DRAM only so.
    Quantized FFN bundles (not experts) with float16 resident tensors on torch's CPU compute in bfloat16:
    their rows are dequantized into cache rows of the compute dtype, where a token's FFN over bfloat16 rows
    is faster than over float16 rows, and torch's weight-only kernels for quantized resident matrices take
    bfloat16 activations too (measurements: docs/architecture.md, "Defaults")."""
    if requested is not None:
        return requested
    if on_cpu and storage == "float16" and not float16_on_cpu:
        return "float32"
    return "bfloat16" if on_cpu and storage == "float16" and quantized_ffn else storage


def compute_threads(requested: int | None, most: int) -> int:
    """Intra-op threads of the math: the requested count, else every core this process may run on (at most
    `most`: the process's own setting before any load changed it). With OpenMP workers sleeping at barriers
    and decode attention in one thread, more threads are faster or equal (docs/architecture.md, "Defaults")."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(most, cores))


class Backend:
    """Base class of TorchBackend and MLXBackend. Subclasses provide the members marked 'backend'."""

    name: str  # "torch" / "mlx"
    STAGING_BYTES: int  # bound of one staging buffer for reads that cannot land in cache rows
    spec = None  # the ArchSpec
    dtype_name: str  # compute dtype (neutral name)
    storage_dtype_name: str  # the model file's dtype
    itemsize: int  # bytes per value in the compute dtype
    on_gpu: bool  # weights, KV and caches count against the GPU budget (host staging against DRAM)
    w: dict
    kvs: list  # one KV cache per sequence decoded together (set_sequences); [0] serves one sequence
    _rope_rows: dict  # rope -> (pos, count, cos, sin) of the current forward call (rope_tables)
    parts = None  # a stats.PartTimer while a benchmark times the compute parts, else None (free)

    # -- backend: arrays ---------------------------------------------------------------------
    def tensor(self, array):
        """A numpy array or backend array as a backend array in the compute dtype, on the device."""
        raise NotImplementedError

    def storage_view(self, raw: np.ndarray, dtype: str | None = None):
        """uint8 bytes [..., n * itemsize] reinterpreted as values of `dtype` (default: the storage dtype)."""
        raise NotImplementedError

    def nbytes_of(self, t) -> int:
        raise NotImplementedError

    def quantized(self, t, bits: int, gather: bool):
        """A resident [out, in] matrix held quantized in the backend's kernel format; `linear` and
        `embed` take it where they take a matrix (`gather`: embeddings are looked up by row too)."""
        raise NotImplementedError

    def kv_bytes(self) -> int:
        raise NotImplementedError

    def new_kv(self):
        """An empty KV cache for one more sequence (backends that decode several sequences together)."""
        raise FlashLLMError(f"batch decoding (several sequences together) is not supported by the {self.name} "
                            f"backend yet; use --backend torch")

    def to_host(self, x) -> np.ndarray:
        """float32 numpy values of x (brings predictor scores and logits to the host)."""
        raise NotImplementedError

    def host_buffer(self, shape) -> np.ndarray:
        """A page-aligned uint8 host buffer for flash reads (pinned where the device needs it)."""
        raise NotImplementedError

    def reads_in_place(self) -> bool:
        """Whether flash reads can land in cache rows directly (host memory, compute dtype = storage)."""
        raise NotImplementedError

    def expert_slot_bytes(self, layout) -> int | None:
        """Bytes of one expert cache slot when the backend keeps quantized experts in a kernel's own
        layout (`expert_slots`), or None (experts are dequantized)."""
        return None

    def expert_reads_in_place(self, layout) -> bool:
        """Whether stored expert bundles are already in the layout of `expert_slots` (no insert)."""
        return False

    def expert_slots(self, layout, capacity: int):
        """`capacity` preallocated slots in that layout: `insert(slot, raw bundle)`, `rows(slot)` (what
        `ffn` takes), `nbytes()`, `KIND`; with `expert_reads_in_place`, flash reads land in `buffer`
        (uint8 [capacity, stride]) and need no insert."""
        raise NotImplementedError

    def row_store(self, capacity: int, layout, biases: dict):
        """A neuron cache's rows: move(dst, src), fill(read, ids, rows, cost), views(n), nbytes()."""
        raise NotImplementedError

    STAGING_BUFFERS: int  # staging buffers the row stores share (reads alternate between them)

    def embedding_rows(self, ids: list[int]):
        """Rows `ids` of the embedding table (dequantized where the table is held quantized)."""
        raise NotImplementedError

    def scalar(self, value: float, dtype):
        """A 0-d backend array of `value` in `dtype`."""
        raise NotImplementedError

    def rope_array(self, table: np.ndarray):
        """A [count, rope dim] float32 cos or sin table (flashllm.format.rope) as the backend's rotary operand."""
        raise NotImplementedError

    # -- backend: math -----------------------------------------------------------------------
    def linear(self, x, w, b):
        raise NotImplementedError

    def columns(self, x, ids: np.ndarray):
        """Columns `ids` (numpy int) of a [T, n] array."""
        raise NotImplementedError

    # elementwise primitives the shared activation table and head are built from
    def relu(self, x):
        raise NotImplementedError

    def square(self, x):
        raise NotImplementedError

    def gelu(self, x):
        raise NotImplementedError

    def gelu_tanh(self, x):
        raise NotImplementedError

    def silu(self, x):
        raise NotImplementedError

    def tanh(self, x):
        raise NotImplementedError

    def norm(self, name: str, x):
        raise NotImplementedError

    def attention(self, layer: int, x, pos, slot=0):
        """(output, normed input) of block `layer` for one sequence's tokens at positions pos.., updating
        its KV cache `slot`; or, `pos` and `slot` lists (batch decode), row i is one token of sequence
        slot[i] at position pos[i]."""
        raise NotImplementedError

    def attention_residual(self, layer: int, x, pos, slot=0):
        """(x + attention output, that sum's FFN norm): the first half of a block whose sublayers add to the
        residual stream in turn (neither parallel nor post-normed); a backend may compute it in fewer calls."""
        attn, _ = self.attention(layer, x, pos, slot)
        x = x + attn
        return x, self.norm(f"layers.{layer}.ffn_norm", x)

    def ffn(self, x, rows: dict, up_bias, gate_bias, down_bias, threshold: float | None = None, gate_pre=None,
            index=None, acc=None, finish: bool = False):
        """FFN over the neurons whose bundle parts are rows[part] ([n, d] each; down rows = columns);
        with `threshold`, neurons with |act(pre)| <= threshold contribute zero (calibrated sparsity);
        `gate_pre` [T, n]: the gate pre-activations, from resident gate rows (then `rows` has no gate).
        `index` (int array): only these row positions (biases and gate_pre stay aligned with `rows`);
        `acc` (from `ffn_acc`): the rows' contributions are added to this float32 sum, which is returned
        (use the result), or with `finish` (a layer's last rows) the FFN's output from it,
        `ffn_result(acc, x, down_bias)` (without `finish`, down_bias is not used)."""
        raise NotImplementedError

    def ffn_acc(self, x):
        """A float32 zero sum [T, d_model] for `ffn(..., acc=)` calls over parts of one layer's rows."""
        raise NotImplementedError

    def ffn_index_in_place(self) -> bool:
        """True when one decode token's `ffn(..., index=)` reads the chosen rows where they are (a kernel
        over row indices); False when it copies them first (then splitting a layer's FFN costs a copy)."""
        return False

    def ffn_result(self, acc, x, down_bias):
        """The FFN output from its float32 sum `acc`: rounded once to x's dtype, plus the down bias."""
        raise NotImplementedError

    def kernels(self) -> str:
        """Which kernels compute (stats and --stats): e.g. "native (AVX2+F16C+FMA) ..." or "torch"."""
        return self.name

    def fuse_resident(self) -> None:
        """At load, once the resident tensors are in: fuse what one call can compute (optional)."""

    def pack_ffn(self, rows: dict) -> dict:
        """A resident FFN's rows in the layout `ffn` computes fastest (optional; default as they are)."""
        return rows

    def ffn_part(self, rows: dict, part: str):
        """One part's [n, d] rows ("up", "gate" or "down") of FFN rows, packed by `pack_ffn` or not."""
        return rows[part]

    def sync(self, out) -> None:
        """Wait until `out` is computed (the part timer's clock; nothing to do on a synchronous CPU)."""

    # -- shared --------------------------------------------------------------------------------
    def _tic(self) -> float:
        """Start timing a compute part (free when no part timer is set)."""
        return time.perf_counter() if self.parts is not None else 0.0

    @contextmanager
    def untimed_parts(self):
        """No compute part is charged inside (the read-ahead's predictor norms its input: predictor time)."""
        parts, self.parts = self.parts, None
        try:
            yield
        finally:
            self.parts = parts

    def _toc(self, part: str, t0: float, out):
        """Charge the time since `t0` to `part` once `out` is computed; returns `out`."""
        if self.parts is not None:
            self.parts.add(part, t0, out)
        return out

    def activation(self, name: str, threshold: float):
        """The FFN activation of an ArchSpec by name, built from the backend's primitives."""
        relu = self.relu
        return {"relu": relu, "relu2": lambda x: self.square(relu(x)), "fatrelu": lambda x: x * (x > threshold),
                "gelu": self.gelu, "gelu_tanh": self.gelu_tanh, "silu": self.silu}[name]

    def set_sequences(self, n: int) -> None:
        """Hold KV caches for `n` sequences decoded together (batch mode); all count in `nbytes`."""
        self.kvs = self.kvs[:n] + [self.new_kv() for _ in range(n - len(self.kvs))]

    def embed(self, ids: list[int], pos):
        """Embeddings of tokens `ids` at positions pos.. (or, a list, at positions pos[i])."""
        t0, x = self._tic(), self.embedding_rows(ids)
        if self.spec.embed_scale != 1.0:  # Gemma: the scale rounded to the compute dtype, as transformers does
            x = x * self.scalar(self.spec.embed_scale, x.dtype)
        if self.spec.positional == "learned":
            table = self.w["pos_embed.weight"]
            x = x + (table[pos:pos + len(ids)] if isinstance(pos, int) else table[list(pos)])
        return self._toc("embed", t0, x)

    def logits(self, x) -> np.ndarray:
        """[tokens, vocab] float32 logits of the final hidden states."""
        h = self.norm("final_norm", x)
        t0, w = self._tic(), self.w["embed.weight"] if self.spec.tied_embeddings else self.w["lm_head.weight"]
        logits = self.linear(h, w, self.w.get("lm_head.bias"))
        if self.spec.final_softcap:
            logits = self.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return self.to_host(self._toc("logits", t0, logits))

    def rope_tables(self, rope, pos: int, count: int) -> tuple:
        """(cos, sin) of `rope` for `count` positions from pos, made once per forward call and rope."""
        hit = self._rope_rows.get(rope)
        if hit is None or hit[:2] != (pos, count):
            hit = self._rope_rows[rope] = (pos, count, *(self.rope_array(a) for a in rope.cos_sin(pos, count)))
        return hit[2], hit[3]

    def staging_bytes(self, stride: int) -> int:
        """Host bytes of the staging buffers the row stores share (0 when reads land in place)."""
        return 0 if self.reads_in_place() else self.STAGING_BUFFERS * self.staging_rows(stride) * stride

    def put(self, name: str, array) -> None:
        """Make a resident tensor live in the compute dtype."""
        self.w[name] = self.tensor(array)

    def put_bytes(self, name: str, raw: np.ndarray, dtype: str, shape, quantize: str = "none") -> None:
        """A resident tensor from its raw bytes (of dtype `dtype`); a matrix of QUANTIZED_RESIDENT is
        quantized ("int8", "int4") straight from these stored values, so loading never holds a float
        copy of more than the one tensor being read."""
        values = self.storage_view(raw, dtype).reshape(tuple(shape))
        bits = RESIDENT_QUANT_BITS[quantize]
        if bits and QUANTIZED_RESIDENT.fullmatch(name):
            self.w[name] = self.quantized(values, bits, gather=name == "embed.weight")
        else:
            self.put(name, values)

    def read_tensor(self, st, name: str):
        """Tensor `name` of a SafetensorsFile in the compute dtype (not made resident)."""
        return self.tensor(self.storage_view(st.read_bytes(name), st.dtype(name)).reshape(st.shape(name)))

    def nbytes(self) -> int:
        """Bytes held: resident weights plus the KV cache."""
        return sum(map(self.nbytes_of, self.w.values())) + self.kv_bytes()

    STAGING_MIN_ROWS = 64  # a decode token's missing neurons of a layer go to the engine in one call, mostly

    def staging_rows(self, stride: int) -> int:
        """Bundle rows one staging buffer holds: STAGING_BYTES worth but at least STAGING_MIN_ROWS, at most
        one layer. Every byte of it is taken from the neuron caches at a budget."""
        return max(1, min(max(self.STAGING_BYTES // stride, self.STAGING_MIN_ROWS), self.spec.d_ffn))

    def bundle_rows(self, block: np.ndarray, layout, parts: tuple[str, ...] | None = None,
                    keep_quantized: bool = False) -> dict:
        """uint8 bundle rows [n, >= bundle_bytes] of the storage dtype as part -> [n, d_model] arrays
        (quantized bundles are dequantized here, unless `keep_quantized` and the backend's `ffn`
        computes on them as they are)."""
        if layout.quant:  # part by part: no float32 copy of the whole block
            return {part: self.dequantized(block[:, layout.part_range(part)], layout) for part in parts or layout.parts}
        values = self.storage_view(block)
        return {part: self.tensor(values[:, layout.part_slice(part)]) for part in parts or layout.parts}

    def dequantized(self, raw: np.ndarray, layout):
        """One quantized part of bundle rows (uint8 [n, part_bytes]) as [n, d_model] values in the compute dtype."""
        return self.tensor(layout.quant.dequantize(raw, layout.d_model))

    def cache_row_bytes(self, layout) -> int:
        """DRAM one cached neuron costs: its bundle as the row store holds it, plus per-row biases."""
        return row_bytes(layout, self.reads_in_place(), self.itemsize)

    def ffn_biases(self, layer: int) -> dict:
        """The FFN biases of `layer` (None where the model has none): the one place they come from."""
        p = f"layers.{layer}."
        return {k: self.w.get(p + k + "_bias") for k in ("up", "gate", "down")}

    def low_rank(self, x, proj_in, proj_out, bias) -> np.ndarray:
        """A low-rank predictor's logits proj_out (proj_in x) + bias [T, n] as float32 numpy: two products by
        `linear` (one token's through the native mat-vec where the backend has it), each rounded to the compute dtype."""
        return self.to_host(self.linear(self.linear(x, proj_in, None), proj_out, bias))

    def greater(self, x, threshold: float) -> np.ndarray:
        """Boolean numpy mask x > threshold."""
        return self.to_host(x) > threshold

    def add(self, a, b):
        return a + b
