"""What a mode (and a predictor) is built from: the model directory's layout, the backend, the FFN
reader, the budget and the load options. Modes see this object, never the `Model` that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashllm import budget as budget_mod
from flashllm.format import manifest as fmt
from flashllm.io.ffn_reader import FFNReader, LayerChecksums
from flashllm.hooks import Hooks
from flashllm.options import LoadOptions
from flashllm.modes.sparse.activation_sparsity import CalibratedSparsity


@dataclass
class ModeContext:
    """The inputs of a mode. `budget` is the byte budget that sizes caches (the GPU budget on a GPU,
    else the DRAM budget; None: unlimited)."""

    manifest: fmt.Manifest
    backend: object
    options: LoadOptions
    budget: int | None
    model_bytes: int
    hooks: Hooks
    checksums: LayerChecksums
    sparsity: CalibratedSparsity | None = None  # calibrated thresholds of a SiLU/GELU FFN (flashllm/modes/sparse/activation_sparsity.py)
    _loader: FFNReader | None = field(default=None, repr=False)

    @property
    def spec(self):
        return self.manifest.spec

    @property
    def layout(self):
        return self.manifest.layout

    @property
    def mode(self) -> str:
        return self.options.mode

    # -- reading -------------------------------------------------------------------------------
    def ffn_reader(self, threads: int | None = None, verify: bool = True, gap_filling: bool = False,
                   layout: fmt.FFNLayout | None = None, aio_depth: int | None = None) -> FFNReader:
        """A reader of `ffn.bin` reporting to the hooks (and, with `verify`, checking layer checksums);
        with `gap_filling`, gaps up to the `gap_bytes` option (None: the disk profile's) are read through;
        `layout`: a view of the file's (`FFNLayout.only`, some parts of each bundle); `aio_depth`: the
        engine (None: the option's, where None means blocking reads in threads)."""
        o = self.options
        aio = aio_depth if aio_depth is not None else o.aio_depth or 0
        return FFNReader(self.manifest.path("ffn"), layout or self.layout, threads or o.threads, aio,
                         self.checksums if verify else None, self.hooks, o.gap_bytes if gap_filling else 0)

    def read_layer_block(self, layer: int, n: int | None = None) -> np.ndarray:
        """The first `n` (default all) neurons of one layer as uint8 bundle rows [n, stride] (for loading
        resident FFNs)."""
        if self._loader is None:
            self._loader = FFNReader(self.manifest.path("ffn"), self.layout, threads=4, checksums=self.checksums)
        n = self.layout.d_ffn if n is None else n
        block = self.backend.host_buffer((n, self.layout.stride))
        self._loader.read_block(layer, 0, n, block)
        return block

    def close(self) -> None:
        """Close the loader `read_layer_block` opened (it opens again when needed)."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    def bundle_rows(self, block: np.ndarray, parts: tuple[str, ...] | None = None, keep_quantized: bool = False) -> dict:
        """Split uint8 bundle rows [n, >=bundle_bytes] into per-part [n, d] backend tensors (`keep_quantized`:
        for the backend's `ffn` only, which may compute on quantized rows as they are)."""
        return self.backend.bundle_rows(block, self.layout, parts, keep_quantized)

    def biases(self, layer: int) -> dict:
        """The FFN biases of `layer` by part (None where the family has none)."""
        return self.backend.ffn_biases(layer)

    # -- budget arithmetic (budget.py) ---------------------------------------------------------
    def row_bytes(self, layout: fmt.FFNLayout | None = None) -> int:
        """DRAM one cached neuron costs: its bundle (or `layout`'s parts of it) as the backend holds it
        plus per-row biases."""
        return self.backend.cache_row_bytes(layout or self.layout)

    def max_layer_bytes(self) -> int:
        """DRAM one layer's weights (resident tensors and FFN) take in the compute dtype."""
        per_layer = sum(int(np.prod(s)) for n, s in fmt.resident_shapes(self.spec).items() if n.startswith("layers.0."))
        return per_layer * self.backend.itemsize + self.layout.d_ffn * self.row_bytes()

    def charged(self, host: int, device: int) -> int:
        """The bytes of (host, device) charged to `budget`."""
        return budget_mod.charged(host, device, self.backend.on_gpu)

    @property
    def budget_field(self) -> str:
        """The LoadOptions field of `budget`."""
        return "gpu_budget" if self.backend.on_gpu else "dram_budget"

    def too_small(self, needed: int, what: str):
        """The "budget too small" error, with the smallest budget and what would lower it."""
        B = self.backend
        storage = getattr(B, "storage_dtype_name", None)
        wider = self.options.dtype is None and storage in ("float16", "bfloat16") and B.dtype_name != storage
        widened = (storage, B.dtype_name, B.name) if wider else None
        hints = budget_mod.lowering_hints(self.mode, B.itemsize, B.kv_bytes(), needed, widened)
        if self.options.quantize_resident != "int4":
            hints.append("{quantize_resident=int4} (attention, embeddings and lm_head at ~1/7 of float32)")
        if self.options.kv_bits == 16 and B.kv_bytes() > needed // 8:
            hints.append("{kv_bits=8} (the KV cache in int8)")
        return budget_mod.too_small(self.budget, needed, what, self.model_bytes, hints, self.budget_field)

    def check_fits(self, needed: int, what: str) -> None:
        """Refuse (BudgetTooSmall) when `needed` bytes exceed the budget."""
        if self.budget is not None and needed > self.budget:
            raise self.too_small(needed, what)
