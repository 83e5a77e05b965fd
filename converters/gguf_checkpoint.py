"""Reading a GGUF file (or a split GGUF's parts) as an HF checkpoint: HF tensor names, HF layout, HF config.

ggml-org's `gguf` package reads the file (memory-mapped: a tensor is read when asked for) and names the
tensors (its HF -> GGUF name maps). What llama.cpp's converter changed is undone here: Llama's q/k rows
permuted for its rope layout, norms stored with +1 (see gguf_config), experts merged into one tensor per
layer and part. Quantized FFN weights come out as `GGUFRows` (converters/gguf_quant.py), the stored blocks, so
that the writer can map them exactly into flashllm's int8/int4 groups instead of rounding a second time.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError

from flashllm.converters.gguf_config import ARCHITECTURES, ROPE_TENSORS, hf_config
from flashllm.converters.gguf_quant import FLOAT_TYPES, ConversionCost, GGUFRows

_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def split_parts(path: Path) -> list[Path]:
    """The files of a GGUF model: `path` alone, or every part of a split `*-00001-of-0000N.gguf`."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    if m["no"] != "00001":
        raise FlashLLMError(f"{path}: part {int(m['no'])} of a split GGUF; give the first part "
                            f"({m['prefix']}-00001-of-{m['count']}.gguf)")
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, int(m["count"]) + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FlashLLMError(f"{path}: split GGUF part(s) {', '.join(missing)} missing beside it")
    return parts


class GGUFCheckpoint:
    """A GGUF model behind the interface converters/checkpoint.py's Checkpoint gives the family adapters."""

    def __init__(self, src: str | Path):
        try:
            import gguf
        except ImportError:
            raise FlashLLMError("converting a GGUF file needs the gguf package (pip install gguf)") from None
        self.path = Path(src)
        if not self.path.is_file():
            raise FlashLLMError(f"{self.path}: no such GGUF file")
        self.root = self.path.parent
        self.parts = split_parts(self.path)
        self.readers = []
        for part in self.parts:
            try:
                self.readers.append(gguf.GGUFReader(part))
            except (ValueError, OSError, KeyError, IndexError) as exc:
                raise FlashLLMError(f"{part}: not a readable GGUF file ({exc})") from None
        self.meta = {key: _value(field) for key, field in self.readers[0].fields.items()
                     if not key.startswith("GGUF.")}
        self.tensors = {t.name: t for r in self.readers for t in r.tensors}
        self.arch = self.meta.get("general.architecture")
        rope = {name: self._values(self.tensors.pop(f"{name}.weight")) for name in ROPE_TENSORS
                if f"{name}.weight" in self.tensors}  # rope scaling llama.cpp stores as tensors
        self.config = hf_config(self.meta, set(self.tensors), rope)
        _, self.permuted_qk, norms_plus_one = ARCHITECTURES[self.arch]
        self.norm_offset_stored = 1.0 if norms_plus_one else 0.0
        self.name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_arch_enum(self.arch)],
                                                 self.config["num_hidden_layers"])
        self.where = {name: self.path.name for name in self.tensors}
        self.streamed: set[str] = set()  # GGUF tensors whose rows go to the FFN/expert file (set by the converter)
        self.cost = ConversionCost()

    # -- the Checkpoint interface ------------------------------------------------------------------
    def resolve(self, name: str) -> str | None:
        """The GGUF tensor holding HF tensor `name` (one expert's weight: the layer's merged tensor)."""
        expert = _expert_name(name)
        if expert:
            layer, _, part = expert
            stored = f"blk.{layer}.ffn_{part}_exps.weight"
            return stored if stored in self.tensors else None
        module, _, suffix = name.rpartition(".")
        mapped = self.name_map.get_name(module)
        if mapped is None:
            return None
        stored = f"{mapped}.{suffix}"
        return stored if stored in self.tensors else None

    def has(self, name: str) -> bool:
        return self.resolve(name) is not None

    def get(self, name: str, shape: tuple[int, ...] | None = None):
        """HF tensor `name` as float values, or (a streamed quantized weight) as its GGUF blocks."""
        stored = self.resolve(name)
        if stored is None:
            raise FlashLLMError(f"{self.path}: tensor for {name!r} is missing from the GGUF file")
        t = self.tensors[stored]
        expert = _expert_name(name)
        if stored in self.streamed and t.tensor_type.name not in FLOAT_TYPES:
            rows = GGUFRows(t.data, t.tensor_type.name, _shape(t), self.cost, release=self._release)
            out = rows[expert[1]] if expert else rows
        else:
            values = self._values(t)
            out = values[expert[1]] if expert else self._undo(stored, values)
            if not _holds(self.cost.store_dtype, t.tensor_type.name):
                self.cost.dequantized(t.tensor_type.name, out)
        if shape is not None and tuple(out.shape) != tuple(shape):
            if int(np.prod(out.shape)) == int(np.prod(shape)) and not isinstance(out, GGUFRows):
                return out.reshape(shape)  # e.g. a [d] gate stored for an HF [1, d] one
            raise FlashLLMError(f"{self.path}: tensor {stored!r} has shape {tuple(out.shape)}, expected "
                                f"{tuple(shape)} from the GGUF metadata")
        return out

    def dtype(self, names: list[str]) -> str:
        """The float dtype most bytes of `names` are stored in; float16 when they are mostly quantized."""
        sizes: dict[str, int] = {}
        for name in names:
            t = self.tensors[name]
            kind = FLOAT_TYPES.get(t.tensor_type.name, "float16")
            sizes[kind] = sizes.get(kind, 0) + int(t.n_bytes)
        return max(sizes, key=sizes.get)

    def types(self, names) -> dict[str, int]:
        """GGUF type name -> bytes, over the stored tensors `names`."""
        out: dict[str, int] = {}
        for name in names:
            t = self.tensors[name]
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_bytes)
        return out

    def source(self) -> dict:
        meta = self.meta
        return {"path": str(self.path.resolve()), "format": "gguf", "architecture": self.arch,
                "model_type": self.config["model_type"], "name": meta.get("general.name"),
                "file_type": _file_type(meta.get("general.file_type")),
                **({"split_files": len(self.parts)} if len(self.parts) > 1 else {})}

    # -- reading ---------------------------------------------------------------------------------
    def _values(self, t) -> np.ndarray:
        """A tensor's values as float32 (numpy order: [rows, columns]), a copy: its pages of the file are let go."""
        import gguf

        kind = t.tensor_type.name
        try:
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise FlashLLMError(f"{self.path}: tensor {t.name!r} is stored as {kind}, which the gguf package "
                                f"cannot dequantize") from None
        values = np.array(values, dtype=np.float32, copy=True).reshape(_shape(t))
        self._release(t.data)
        return values

    def _release(self, data: np.ndarray) -> None:
        """Let the process's mapping of `data` (a view of one of the memory-mapped files) go: the pages stay in the
        page cache but stop counting as this process's memory, so reading the file tensor by tensor stays bounded."""
        for reader in self.readers:
            mapping = getattr(reader.data, "_mmap", None)
            base = reader.data.__array_interface__["data"][0]
            start = data.__array_interface__["data"][0] - base
            if mapping is None or not 0 <= start < reader.data.nbytes or not hasattr(mapping, "madvise"):
                continue
            page = mmap.PAGESIZE
            first = start // page * page
            mapping.madvise(mmap.MADV_DONTNEED, first, min(start + data.nbytes, reader.data.nbytes) - first)
            return

    def _undo(self, stored: str, values: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's changes to a resident tensor: q/k row permutation, +1 on norms."""
        if self.permuted_qk and re.search(r"\.attn_(q|k)\.(weight|bias)$", stored):
            cfg = self.config
            heads = cfg["num_attention_heads"] if ".attn_q." in stored else \
                cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
            half = values.shape[0] // heads // 2
            values = values.reshape(heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        return values


def _arch_enum(arch: str) -> str:
    import gguf

    for key, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return key.name
    raise FlashLLMError(f"GGUF architecture {arch!r} is unknown to the installed gguf package")


def _shape(t) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _value(field):
    """A metadata field's value: str, number, bool, or a list of them."""
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _file_type(code) -> str | None:
    import gguf

    try:
        return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_") if code is not None else None
    except ValueError:
        return str(code)


# An HF per-expert weight: ...layers.{i}.{experts module}.{e}.{part module}.weight
_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _expert_name(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, part) of an HF per-expert weight name, else None."""
    m = _EXPERT.search(name)
    if not m or m[3] not in _EXPERT_PARTS:
        return None
    return int(m[1]), int(m[2]), _EXPERT_PARTS[m[3]]


def _holds(dtype: str, qtype: str) -> bool:
    """Whether storage dtype `dtype` holds every value of GGUF type `qtype` exactly."""
    return dtype == "float32" and qtype in FLOAT_TYPES or FLOAT_TYPES.get(qtype) == dtype
