"""The runtime model: load a model directory, run the per-token path, generate text."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from . import format as fmt
from .errors import FlashLLMError
from .generate import generate_tokens
from .st_io import SafetensorsFile
from .stats import TokenCost, summarize
from .tokenizer import Tokenizer

MODES = ("dense", "naive", "hybrid", "sparse")
DEFAULT_CONTEXT = 4096


def make_backend(name: str, spec, device: str, dtype: str | None, storage_dtype, context: int):
    if name == "torch":
        from .backends.torch_backend import TorchBackend
        return TorchBackend(spec, device, dtype, storage_dtype, context)
    if name == "mlx":
        from .backends.mlx_backend import MLXBackend
        return MLXBackend(spec, device, dtype, storage_dtype, context)
    raise FlashLLMError(f"backend {name!r}: expected torch or mlx")


class Model:
    """A loaded model. `logits`, `generate` and `stream` run the same per-token path."""

    def __init__(self, model_dir: str | Path, backend: str = "torch", device: str = "cpu", mode: str = "dense",
                 dtype: str | None = None, context: int | None = None, verify: bool | None = None):
        if mode not in MODES:
            raise FlashLLMError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.manifest = fmt.read_manifest(model_dir, verify=verify)
        self.spec, self.layout, self.mode = self.manifest.spec, self.manifest.layout, mode
        self.context = min(context or DEFAULT_CONTEXT, self.spec.max_positions)
        if self.context < 1:
            raise FlashLLMError(f"context {context}: must be at least 1")
        self.backend = make_backend(backend, self.spec, device, dtype, self.manifest.dtype, self.context)
        self._tokenizer = None
        self._costs: list[TokenCost] = []
        self._load_resident()
        self._load_dense_ffn()

    # -- loading -------------------------------------------------------------------------------
    def _load_resident(self) -> None:
        path = self.manifest.path("resident")
        st = SafetensorsFile(path)
        for name, shape in fmt.resident_shapes(self.spec).items():
            if name not in st.entries:
                raise FlashLLMError(f"{path}: tensor {name!r} is missing")
            if st.shape(name) != shape:
                raise FlashLLMError(f"{path}: tensor {name!r} has shape {st.shape(name)}, expected {shape}")
            self.backend.put(name, st.read(name))
        self.ffn_biases = [
            tuple(self.backend.w.get(f"layers.{i}.{b}") for b in ("up_bias", "gate_bias", "down_bias"))
            for i in range(self.spec.n_layers)]

    def read_layer_block(self, layer: int) -> np.ndarray:
        """All bundles of one layer as uint8 [d_ffn, stride] (plain buffered read)."""
        lay, path = self.layout, self.manifest.path("ffn")
        block = np.fromfile(path, dtype=np.uint8, count=lay.layer_bytes, offset=lay.layer_offsets[layer])
        if block.size != lay.layer_bytes:
            raise FlashLLMError(f"{path}: truncated in layer {layer}")
        return block.reshape(lay.d_ffn, lay.stride)

    def bundle_rows(self, block: np.ndarray) -> dict[str, torch.Tensor]:
        """Split uint8 bundle rows [n, >=bundle_bytes] into per-part [n, d] backend tensors."""
        lay = self.layout
        values = torch.from_numpy(np.ascontiguousarray(block[:, :lay.bundle_bytes])).view(self.manifest.dtype)
        return {part: self.backend.tensor(values[:, lay.part_slice(part)]) for part in lay.parts}

    def _load_dense_ffn(self) -> None:
        self.dense_ffn = [self.bundle_rows(self.read_layer_block(i)) for i in range(self.spec.n_layers)]

    # -- the per-token path --------------------------------------------------------------------
    def _ffn(self, layer: int, x, cost: TokenCost):
        up_b, gate_b, down_b = self.ffn_biases[layer]
        return self.backend.ffn(x, self.dense_ffn[layer], up_b, gate_b, down_b)

    def forward(self, ids: list[int], pos: int) -> np.ndarray:
        """Logits [len(ids), vocab] for `ids` at positions pos.. (the KV cache holds 0..pos-1)."""
        if pos + len(ids) > self.context:
            raise FlashLLMError(f"{pos + len(ids)} tokens exceed the context of {self.context}")
        cost, t0 = TokenCost(tokens=len(ids)), time.perf_counter()
        B, s = self.backend, self.spec
        x = B.embed(ids, pos)
        for layer in range(s.n_layers):
            attn, h = B.attention(layer, x, pos)
            if s.parallel_attn:
                f_in = B.norm(f"layers.{layer}.ffn_norm", x) if s.ffn_norm else h
                x = x + attn + self._ffn(layer, f_in, cost)
            else:
                x = x + attn
                x = x + self._ffn(layer, B.norm(f"layers.{layer}.ffn_norm", x), cost)
        logits = B.logits(x)
        cost.total_ms = (time.perf_counter() - t0) * 1e3
        cost.compute_ms = cost.total_ms - cost.io_ms - cost.mem_ms - cost.predictor_ms
        self._costs.append(cost)
        return logits

    # -- public API ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.manifest.root, self.spec.bos_token_id)
        return self._tokenizer

    @property
    def stats(self) -> dict:
        return summarize(self._costs, self.dram_bytes(), {"mode": self.mode, "backend": self.backend.name})

    def dram_bytes(self) -> int:
        return self.backend.nbytes() + sum(t.numel() * t.element_size()
                                           for rows in getattr(self, "dense_ffn", []) for t in rows.values())

    def logits(self, token_ids, prefill: int | None = None) -> np.ndarray:
        """[len, vocab] float32 logits: the first `prefill` ids as one prompt, the rest one at a time."""
        ids = [int(t) for t in token_ids]
        prefill = len(ids) if prefill is None else prefill
        if not 1 <= prefill <= len(ids):
            raise FlashLLMError(f"prefill {prefill}: expected 1..{len(ids)}")
        if len(ids) > self.context:
            raise FlashLLMError(f"{len(ids)} tokens exceed the context of {self.context}")
        self._costs = []
        rows = [self.forward(ids[:prefill], 0)]
        rows += [self.forward([t], prefill + i) for i, t in enumerate(ids[prefill:])]
        return np.concatenate(rows, axis=0)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int | None = 0) -> Iterator[int]:
        self._costs = []
        yield from generate_tokens(self.forward, list(prompt_ids), self.context, max_new_tokens, temperature,
                                   top_p, seed, self.spec.eos_token_id)

    def stream(self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = 0) -> Iterator[str]:
        """Yield text pieces as tokens are generated (pieces never split a UTF-8 character)."""
        tok, ids, shown, text = self.tokenizer, [], "", ""
        for token in self.generate_ids(tok.encode(prompt), max_new_tokens, temperature, top_p, seed):
            ids.append(token)
            text = tok.decode(ids)
            if not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        if len(text) > len(shown):
            yield text[len(shown):]

    def generate(self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = 0) -> str:
        return "".join(self.stream(prompt, max_new_tokens, temperature, top_p, seed))
