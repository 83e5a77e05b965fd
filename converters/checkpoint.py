"""Reading an HF checkpoint directory: config.json plus tensors, one tensor at a time.

Tensors come out as numpy arrays of their values: float32 and float16 as stored, bfloat16 (which
numpy lacks) widened exactly to float32; `Checkpoint.dtype` names the stored dtype. Torch is used
only to read the weights-only `.bin` format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.format.safetensors_io import SafetensorsFile


class Checkpoint:
    """config.json and a name -> file index over single or sharded safetensors (or .bin) weights."""

    def __init__(self, src: str | Path):
        self.root = Path(src)
        if not self.root.is_dir():
            raise FlashLLMError(f"{self.root}: not a directory (expected an HF checkpoint directory)")
        cfg_path = self.root / "config.json"
        if not cfg_path.is_file():
            raise FlashLLMError(f"{cfg_path}: missing (not a Hugging Face checkpoint directory)")
        try:
            self.config = json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FlashLLMError(f"{cfg_path}: unreadable ({exc})") from None
        self._open: dict[str, object] = {}
        self.where = self._index()

    def _index(self) -> dict[str, str]:
        """Tensor name -> file name, from an index file or the single weights file."""
        for single, index in (("model.safetensors", "model.safetensors.index.json"),
                              ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if (self.root / index).is_file():
                try:
                    weight_map = json.loads((self.root / index).read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as exc:
                    raise FlashLLMError(f"{self.root / index}: unreadable index ({exc})") from None
                for fname in set(weight_map.values()):
                    if "/" in fname or "\\" in fname or fname.startswith(".") or not (self.root / fname).is_file():
                        raise FlashLLMError(f"{self.root / index}: shard {fname!r} is missing or outside the checkpoint")
                return dict(weight_map)
            if (self.root / single).is_file():
                return {name: single for name in self._file(single).names()}
        raise FlashLLMError(f"{self.root}: no weights found (expected model.safetensors, a sharded "
                            f"model.safetensors.index.json, or pytorch_model.bin)")

    def _file(self, fname: str):
        if fname not in self._open:
            path = self.root / fname
            if fname.endswith(".safetensors"):
                self._open[fname] = _SafetensorsTensors(path)  # .read: bfloat16 widened to float32
            else:
                self._open[fname] = _BinFile(path)
        return self._open[fname]

    def resolve(self, name: str) -> str | None:
        """The stored name for `name`, tolerating a missing or extra leading 'model.' prefix."""
        for cand in (name, name.removeprefix("model."), "model." + name):
            if cand in self.where:
                return cand
        return None

    def has(self, name: str) -> bool:
        return self.resolve(name) is not None

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor `name`; a clear error names the tensor and file when it is missing or mis-shaped."""
        stored = self.resolve(name)
        if stored is None:
            raise FlashLLMError(f"{self.root}: tensor {name!r} is missing from the checkpoint")
        t = self._file(self.where[stored]).read(stored)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise FlashLLMError(f"{self.root / self.where[stored]}: tensor {stored!r} has shape "
                                f"{tuple(t.shape)}, expected {tuple(shape)} from config.json")
        return t

    def dtype(self, names: list[str]) -> str:
        """The dtype (name) most bytes of `names` are stored in; an error names a tensor in a dtype that
        flashllm does not convert (integer/quantized or float64 weights would be silently recast)."""
        sizes: dict[str, int] = {}
        for name in names:
            dtype, numel = self._file(self.where[name]).info(name)
            if dtype not in fmt.STORAGE_DTYPES:
                raise FlashLLMError(f"{self.root / self.where[name]}: tensor {name!r} is stored as "
                                    f"{dtype}; flashllm converts float32, float16 and bfloat16 checkpoints only")
            sizes[dtype] = sizes.get(dtype, 0) + numel * fmt.STORAGE_DTYPES[dtype]
        return max(sizes, key=sizes.get)


class _SafetensorsTensors(SafetensorsFile):
    """A safetensors shard: `read` (values, bfloat16 widened to float32) and `info`."""

    def info(self, name: str) -> tuple[str, int]:
        """(dtype name, element count) of tensor `name`, from the header."""
        return self.dtype(name), int(np.prod(self.shape(name), dtype=np.int64))


class _BinFile:
    """A PyTorch .bin state dict, loaded only with weights_only=True (no code execution)."""

    def __init__(self, path: Path):
        import torch

        try:
            self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for corrupt or unsafe files
            raise FlashLLMError(f"{path}: cannot load as a weights-only PyTorch file ({exc})") from None

    def names(self):
        return list(self.state)

    def info(self, name: str) -> tuple[str, int]:
        return str(self.state[name].dtype).removeprefix("torch."), self.state[name].numel()

    def read(self, name: str) -> np.ndarray:
        """A fresh numpy copy of the tensor's values (bfloat16 widened exactly to float32)."""
        import torch

        t = self.state[name]
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.clone().numpy()
