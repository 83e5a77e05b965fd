"""The model directory: manifest, FFN bundle layout, resident tensor names. See docs/format.md."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.format.experts import EXPERTS_FILE, ExpertLayout, expert_resident_shapes  # noqa: F401 (EXPERTS_FILE re-exported)
from flashllm.format.quant import QuantScheme
from flashllm.format.spec import ArchSpec

FORMAT_NAME = "flashllm-model"
FORMAT_VERSION = 1
MANIFEST = "flashllm.json"
# What other flashllm commands write beside a converted model (planner.PLAN_FILE, predictor.PREDICTOR_META and
# PREDICTOR_FILE, sparsity.SPARSITY_FILE): `convert --force` replaces them with the model, and nothing else it
# did not write (`foreign_files`).
COMPANION_FILES = ("plan.json", "predictors.json", "predictors.safetensors", "sparsity.json")
RESIDENT_FILE = "resident.safetensors"
FFN_FILE = "ffn.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
LAYER_ALIGN = 4096
STORAGE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # storage dtype name -> bytes per value
VERIFY_AUTO_LIMIT = 256 << 20  # load() checksums files up to this size; `inspect --verify` checks all


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class FFNLayout:
    """Where neuron i of layer l lives in the FFN file.

    Bundled (the default): one read per neuron at layer_offsets[l] + i * stride. Unbundled (for the
    paper's "without bundling" baseline): each part in its own region of the layer, one read per part.
    In memory a neuron is always one row of `stride` bytes holding its parts back to back.
    With `quant`, each part is d_model group-quantized values (codes, scales, mins; see flashllm/format/quant.py).
    `only(parts)` is the layout of reading some parts of each neuron (the gate rows resident): its
    memory rows hold just those parts; `file_parts`/`file_stride` keep the file's own.
    """

    parts: tuple[str, ...]  # e.g. ("up", "down") or ("gate", "up", "down"); each d_model values
    d_model: int
    d_ffn: int
    itemsize: int  # bytes per stored value when not quantized
    stride: int  # bytes from one bundle to the next (>= bundle_bytes), in the file and in memory
    layer_offsets: tuple[int, ...]
    bundled: bool = True
    quant: QuantScheme | None = None
    file_parts: tuple[str, ...] | None = None  # the file's parts, when this layout reads only some of them
    file_stride: int | None = None  # the file's bundle stride, when it differs from the memory row's

    def only(self, parts: tuple[str, ...]) -> "FFNLayout":
        """Reading only `parts` of every neuron (one read per neuron still: they must be adjacent in the
        bundle); memory rows hold just those parts, back to back."""
        file_parts = self.file_parts or self.parts
        keep = tuple(p for p in file_parts if p in parts)
        first = file_parts.index(keep[0]) if keep else 0
        if not keep or file_parts[first:first + len(keep)] != keep:
            raise FlashLLMError(f"FFN parts {parts}: not adjacent parts of the bundle {file_parts}")
        return replace(self, parts=keep, stride=len(keep) * self.part_bytes, file_parts=file_parts,
                       file_stride=self.file_stride or self.stride)

    @property
    def bundle_bytes(self) -> int:
        return len(self.parts) * self.part_bytes

    @property
    def part_bytes(self) -> int:
        return self.quant.part_bytes(self.d_model) if self.quant else self.d_model * self.itemsize

    @property
    def part_region(self) -> int:
        """Unbundled: bytes from one part's region to the next inside a layer."""
        return _round_up(self.d_ffn * self.part_bytes, LAYER_ALIGN)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer in the file."""
        file_parts = self.file_parts or self.parts
        return self.d_ffn * (self.file_stride or self.stride) if self.bundled else len(file_parts) * self.part_region

    def segments(self, layer: int) -> list[tuple[int, int, int, int]]:
        """(file base, file stride, bytes per neuron, byte offset in the memory row) per read of a neuron."""
        base, pb, file_parts = self.layer_offsets[layer], self.part_bytes, self.file_parts or self.parts
        if self.bundled:
            return [(base + file_parts.index(self.parts[0]) * pb, self.file_stride or self.stride, self.stride, 0)]
        return [(base + file_parts.index(p) * self.part_region, pb, pb, k * pb) for k, p in enumerate(self.parts)]

    @property
    def file_size(self) -> int:
        return self.layer_offsets[-1] + self.layer_bytes if self.layer_offsets else 0

    def part_slice(self, part: str) -> slice:
        """Element range of one part inside a bundle row (unquantized layouts)."""
        k = self.parts.index(part)
        return slice(k * self.d_model, (k + 1) * self.d_model)

    def part_range(self, part: str) -> slice:
        """Byte range of one part inside a bundle row."""
        k = self.parts.index(part)
        return slice(k * self.part_bytes, (k + 1) * self.part_bytes)

    def dequantize(self, block: np.ndarray) -> np.ndarray:
        """Quantized bundle rows (uint8 [n, >= bundle_bytes]) -> float32 [n, len(parts) * d_model]
        (so `part_slice` indexes the result as it indexes unquantized rows)."""
        return np.concatenate([self.quant.dequantize(block[:, self.part_range(p)], self.d_model)
                               for p in self.parts], axis=1)

    @classmethod
    def plan(cls, spec: ArchSpec, itemsize: int, bundled: bool = True, quant: QuantScheme | None = None) -> "FFNLayout":
        """Bundle stride aligned to 4096 or 512 bytes where that wastes at most 1/16; layers at 4096."""
        probe = cls(spec.bundle_parts, spec.d_model, spec.d_ffn, itemsize, 0, (0,), bundled, quant)
        bundle = stride = probe.bundle_bytes
        for align in (LAYER_ALIGN, 512):
            if _round_up(bundle, align) - bundle <= bundle // 16:
                stride = _round_up(bundle, align)
                break
        probe = cls(spec.bundle_parts, spec.d_model, spec.d_ffn, itemsize, stride, (0,), bundled, quant)
        layer = _round_up(probe.layer_bytes, LAYER_ALIGN)
        return cls(spec.bundle_parts, spec.d_model, spec.d_ffn, itemsize, stride,
                   tuple(i * layer for i in range(spec.n_layers)), bundled, quant)

    def to_dict(self) -> dict:
        out = {"parts": list(self.parts), "bundle_bytes": self.bundle_bytes, "bundle_stride": self.stride,
               "layer_offsets": list(self.layer_offsets), "layer_bytes": self.layer_bytes,
               "layer_alignment": LAYER_ALIGN, "bundled": self.bundled}
        if self.quant:
            lay = self.quant.part_layout(self.d_model)
            out.update(quantization=self.quant.to_dict(), part_bytes=self.part_bytes,
                       part_offsets={p: self.part_range(p).start for p in self.parts},
                       part_layout={k: list(v) for k, v in lay.items()})
        return out


def resident_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Every resident tensor (canonical name -> shape) a model with this spec has."""
    d, hd, shapes = spec.d_model, spec.head_dim, {}

    def norm(name, dim=d):
        shapes[f"{name}.weight"] = (dim,)
        if spec.norm == "layernorm":
            shapes[f"{name}.bias"] = (dim,)

    shapes["embed.weight"] = (spec.vocab_size, d)
    if spec.positional == "learned":
        shapes["pos_embed.weight"] = (spec.max_positions, d)
    for i in range(spec.n_layers):
        p = f"layers.{i}."
        norm(p + "attn_norm")
        if spec.ffn_norm:
            norm(p + "ffn_norm")
        if spec.post_norms:
            norm(p + "post_attn_norm")
            norm(p + "post_ffn_norm")
        for name, rows in (("q", spec.n_heads * hd), ("k", spec.n_kv_heads * hd), ("v", spec.n_kv_heads * hd)):
            shapes[p + name + ".weight"] = (rows, d)
            if spec.qkv_bias:
                shapes[p + name + ".bias"] = (rows,)
        shapes[p + "o.weight"] = (d, spec.n_heads * hd)
        if spec.o_bias:
            shapes[p + "o.bias"] = (d,)
        if spec.qk_norm:
            norm(p + "q_norm", spec.n_heads * hd if spec.qk_norm_full else hd)
            norm(p + "k_norm", spec.n_kv_heads * hd if spec.qk_norm_full else hd)
        if spec.is_moe:
            shapes.update(expert_resident_shapes(spec, i))
        if spec.ffn_bias:
            shapes[p + "up_bias"] = (spec.d_ffn,)
            if spec.gated_ffn:
                shapes[p + "gate_bias"] = (spec.d_ffn,)
            shapes[p + "down_bias"] = (d,)
    norm("final_norm")
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    if spec.lm_head_bias:
        shapes["lm_head.bias"] = (spec.vocab_size,)
    return shapes


def sha256_file(path: str | Path, start: int = 0, length: int | None = None) -> str:
    """Hex sha256 of a file or of a byte range of it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length if length is not None else os.path.getsize(path) - start
        while left > 0:
            chunk = f.read(min(left, 8 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A validated `flashllm.json` and the directory it describes."""

    root: Path
    data: dict
    spec: ArchSpec
    layout: FFNLayout | ExpertLayout  # the streamed file: FFN neuron bundles, or expert bundles (MoE)

    @property
    def dtype(self) -> str:
        """The storage dtype's name (a key of STORAGE_DTYPES); backends map it to their own dtype."""
        return self.data["dtype"]

    def path(self, key: str) -> Path:
        return self.root / self.data["files"][key]["path"]

    def has(self, key: str) -> bool:
        return key in self.data["files"]

    def verify_checksums(self, limit: int | None = None) -> None:
        """Compare sha256 of every listed file (up to `limit` bytes in size) with the manifest."""
        for key, entry in self.data["files"].items():
            if limit is not None and entry["size"] > limit:
                continue
            if sha256_file(self.path(key)) != entry["sha256"]:
                raise FlashLLMError(f"{self.path(key)}: checksum mismatch (file is corrupt; convert again)")


def read_manifest(model_dir: str | Path, verify: bool | None = None) -> Manifest:
    """Read and validate a model directory; `verify` None checksums only files up to 256 MiB."""
    root = Path(model_dir)
    mpath = root / MANIFEST
    if not mpath.is_file():
        if not root.exists():
            raise FlashLLMError(f"{root}: no such model directory")
        if not root.is_dir():
            raise FlashLLMError(f"{root}: a file, not a model directory (give the directory `flashllm convert` wrote)")
        if (root / "config.json").is_file():  # a Hugging Face checkpoint given where a converted model goes
            raise FlashLLMError(f"{root}: a Hugging Face checkpoint, not a flashllm model directory; run "
                                f"`flashllm convert {root} OUT_DIR` and use OUT_DIR")
        raise FlashLLMError(f"{root}: not a flashllm model directory (no {MANIFEST}); run `flashllm convert "
                            f"HF_DIR {root}` first")
    try:
        data = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FlashLLMError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise FlashLLMError(f"{mpath}: not a flashllm manifest")
    if data.get("rewrite_pending"):
        raise FlashLLMError(f"{mpath}: an interrupted rewrite left this directory inconsistent "
                            f"({data['rewrite_pending']}); convert the model again")
    if data.get("format_version") != FORMAT_VERSION:
        raise FlashLLMError(f"{mpath}: format version {data.get('format_version')} is not supported "
                            f"(this flashllm reads version {FORMAT_VERSION})")
    try:
        spec = ArchSpec.from_dict(data["spec"])
        if data["dtype"] not in STORAGE_DTYPES:
            raise FlashLLMError(f"{mpath}: unknown storage dtype {data['dtype']!r}")
        files, ffn = data["files"], data["ffn"]
        qname = data.get("quantization", "none")
        quant = None if qname == "none" else \
            QuantScheme.from_dict(qname, ffn.get("quantization"), spec.d_model, str(mpath))
        for key in ("resident", "ffn"):
            if key not in files:
                raise FlashLLMError(f"{mpath}: manifest lists no {key!r} file")
        itemsize = STORAGE_DTYPES[data["dtype"]]
        try:
            layout = ExpertLayout.plan(spec, itemsize, quant, ffn.get("expert_packing")) if spec.is_moe else \
                FFNLayout.plan(spec, itemsize, ffn.get("bundled", True), quant)
        except FlashLLMError as exc:
            raise FlashLLMError(f"{mpath}: {exc}") from None
        if spec.is_moe and quant and "part_shapes" not in ffn:
            raise FlashLLMError(f"{mpath}: quantized experts in an older layout (down projections grouped "
                                "along d_model); convert the model again")
        if layout.to_dict() != {k: ffn.get(k) for k in layout.to_dict()}:
            raise FlashLLMError(f"{mpath}: FFN layout in the manifest does not match the architecture spec")
        manifest = Manifest(root, data, spec, layout)
        for key, entry in files.items():
            _check_file(root, mpath, key, entry)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FlashLLMError(f"{mpath}: malformed manifest ({type(exc).__name__}: {exc})") from None
    if files["ffn"]["size"] != layout.file_size:
        raise FlashLLMError(f"{manifest.path('ffn')}: manifest size {files['ffn']['size']} does not match "
                            f"the FFN layout ({layout.file_size} bytes)")
    if verify or verify is None:
        manifest.verify_checksums(None if verify else VERIFY_AUTO_LIMIT)
    return manifest


def _check_file(root: Path, mpath: Path, key: str, entry: dict) -> None:
    """A listed file must stay inside the directory and have the listed size."""
    rel = entry["path"]
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise FlashLLMError(f"{mpath}: file {key!r} has an invalid path {rel!r}")
    full = (root / rel).resolve()
    if root.resolve() not in full.parents:
        raise FlashLLMError(f"{mpath}: file {key!r} points outside the model directory ({rel!r})")
    if not full.is_file():
        raise FlashLLMError(f"{root / rel}: missing (listed in the manifest as {key!r})")
    size = full.stat().st_size
    if size != entry["size"]:
        raise FlashLLMError(f"{root / rel}: size {size} bytes, manifest says {entry['size']} "
                            f"({'truncated' if size < entry['size'] else 'corrupt'}; convert again)")


def foreign_files(model_dir: Path) -> list[str]:
    """The entries of a model directory that flashllm did not write: neither its manifest, a file the manifest
    lists (the model's own, as converted or reordered) nor a companion (`COMPANION_FILES`)."""
    try:
        files = json.loads((Path(model_dir) / MANIFEST).read_text()).get("files", {})
        listed = {f.get("path") for f in files.values() if isinstance(f, dict)} if isinstance(files, dict) else set()
    except (OSError, ValueError, AttributeError):  # an unreadable manifest vouches for nothing
        listed = set()
    ours = {MANIFEST, *COMPANION_FILES, *listed}
    return sorted(name for name in os.listdir(model_dir) if name not in ours)
