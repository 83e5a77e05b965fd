"""HF checkpoint -> flashllm model directory, streamed tensor by tensor and written atomically."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.progress import progress_bar
from flashllm.format.quant import DEFAULT_GROUP, DEFAULT_SCHEME, QuantScheme
from flashllm.format.spec import ArchSpec
from flashllm.format.safetensors_io import storage_bytes, write_safetensors

from flashllm.converters.checkpoint import Checkpoint
from flashllm.converters.gguf_checkpoint import GGUFCheckpoint, is_gguf
from flashllm.converters.gguf_plan import gguf_plan
from flashllm.converters.gguf_quant import GGUFRows
from flashllm.converters.gguf_tokenizer import write_gguf_tokenizer
from flashllm.converters.families import family_for
from flashllm.converters.families.moe import expert_bundles, expert_packing, write_experts


def convert(src: str | Path, out: str | Path, dtype: str | None = None, quantize: str | None = None,
            force: bool = False, progress: bool | None = None, bundled: bool = True,
            group_size: int | None = None, quant_scheme: str | None = None,
            expert_layout: str = "portable", origin: dict | None = None) -> Path:
    """Convert the HF checkpoint in `src` into a flashllm model directory at `out`; returns `out`.

    `quantize` int8/int4 stores the FFN bundles group-wise quantized (groups of `group_size`
    along d_model, `quant_scheme` asymmetric or symmetric; see flashllm/format/quant.py); resident
    tensors stay in `dtype`. `force` replaces `out` only if it is a flashllm model directory or
    empty. Everything is written into a temporary directory (inside an existing `out`, else beside it) and
    moved into place at the end; on any error it is removed and `out` is untouched. `bundled=False` stores up rows and
    down columns in separate regions (the paper's baseline without row-column bundling; for benchmarks).
    `expert_layout` `torch-cpu` stores an MoE model's int4 experts in torch's CPU int4 kernel layout of
    this machine (families.moe.expert_packing), so torch reads them into its cache slots with no repack.
    `src` may also be a GGUF file (converters/gguf_checkpoint.py): its Q4_0/Q4_1/Q8_0 FFN weights are kept as
    they are (int4/int8 groups of 32) unless `quantize`, `group_size` or `quant_scheme` ask for another scheme.
    `origin` goes into the manifest's source beside the path (e.g. the Hub repo and revision, converters/hub.py)."""
    gguf = is_gguf(src)
    quant = None if quantize in (None, "none") else QuantScheme.named(quantize, group_size or DEFAULT_GROUP,
                                                                 quant_scheme or DEFAULT_SCHEME)
    out = Path(out)
    check_output(Path(src), out, force)
    if dtype is not None and dtype not in fmt.STORAGE_DTYPES:
        raise FlashLLMError(f"--dtype {dtype}: expected one of {sorted(fmt.STORAGE_DTYPES)}")
    tmp = make_temporary(out)
    try:
        ckpt = GGUFCheckpoint(src) if gguf else Checkpoint(src)
        family, spec = family_for(ckpt.config)
        sources = family.sources(ckpt, spec)
        stored = ckpt.dtype(sources)  # also refuses tensors stored in dtypes we cannot convert
        dtype_name = dtype or stored
        if gguf:
            family, quant = gguf_plan(ckpt, family, spec, dtype_name, quantize, group_size, quant_scheme)
        if quant:
            quant.check(spec.d_model)
        if spec.is_moe and not bundled:
            raise FlashLLMError("bundled=False: an MoE model's experts are always stored as expert bundles")
        packing = expert_packing(expert_layout, spec, quant) if expert_layout != "portable" else None
        layout = fmt.ExpertLayout.plan(spec, fmt.STORAGE_DTYPES[dtype_name], quant, packing) if spec.is_moe else \
            fmt.FFNLayout.plan(spec, fmt.STORAGE_DTYPES[dtype_name], bundled, quant)
        ffn_file = fmt.EXPERTS_FILE if spec.is_moe else fmt.FFN_FILE
        shapes = fmt.resident_shapes(spec)
        _check_space(tmp, sum(np.prod(s, dtype=np.int64) for s in shapes.values()) * fmt.STORAGE_DTYPES[dtype_name]
                     + layout.file_size + (0 if gguf else sum((ckpt.root / f).stat().st_size for f in
                                                               fmt.TOKENIZER_FILES if (ckpt.root / f).is_file())))
        name = ckpt.path.name if gguf else ckpt.root.name
        with progress_bar(progress, total=spec.n_layers + 1, desc=f"convert {name}", unit="layer") as bar:
            write_safetensors(tmp / fmt.RESIDENT_FILE, [(n, dtype_name, s) for n, s in shapes.items()],
                              lambda n: family.tensor(ckpt, spec, n, shapes[n]), metadata={"format": fmt.FORMAT_NAME})
            bar.update(1)
            if spec.is_moe:
                ffn_sha, layer_sha = write_experts(
                    tmp / ffn_file, layout,
                    lambda i: expert_bundles(layout, family.expert_rows(ckpt, spec, i), dtype_name), bar.update)
            else:
                ffn_sha, layer_sha = write_ffn(tmp / ffn_file, layout,
                                               lambda i: family.ffn_rows(ckpt, spec, i), dtype_name, bar.update)
        if gguf:
            tokenizer = write_gguf_tokenizer(ckpt.meta, tmp)
            source = {**ckpt.source(), "conversion": ckpt.cost.to_dict()}
        else:
            tokenizer = [f for f in fmt.TOKENIZER_FILES if (ckpt.root / f).is_file()]
            for f in tokenizer:
                shutil.copyfile(ckpt.root / f, tmp / f)
            source = {"path": str(ckpt.root.resolve()), "model_type": ckpt.config.get("model_type")}
        write_manifest(tmp, spec, dtype_name, layout, ffn_sha, layer_sha, tokenizer, ffn_file=ffn_file,
                       source={**source, **(origin or {})})
        _replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FlashLLMError(f"{tmp.parent}: no space left on the device while converting (the partial "
                                f"output was removed; free some space and convert again)") from None
        raise FlashLLMError(f"{exc.filename or out}: {exc.strerror or exc} (the partial output was removed)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_output(src: Path, out: Path, force: bool) -> None:
    """Refuse an `out` that would lose data: the checkpoint itself (or around or inside it), or an
    existing path that is not a flashllm model directory or an empty directory."""
    src_r, out_r = src.resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        where = "is" if out_r == src_r else "is inside" if src_r in out_r.parents else "contains"
        raise FlashLLMError(f"{out}: the output {where} the checkpoint {src}; choose another output directory")
    check_replaceable(out, force)


# Entries of an existing output directory that converting into it keeps and ignores: a file system's own
# lost+found at a mount point, and the temporary directories of a conversion into it (`make_temporary`).
PARTIAL, OLD = ".flashllm-partial-", ".flashllm-old-"


def _entries(out: Path) -> list[str]:
    """What `out` holds besides lost+found and conversion leftovers."""
    return sorted(name for name in os.listdir(out)
                  if name != "lost+found" and not name.startswith((PARTIAL, OLD)))


def check_replaceable(out: Path, force: bool) -> None:
    """`out` may be written: it does not exist, or `force` and it is empty or a flashllm model directory that holds
    only what flashllm wrote (`format.foreign_files`)."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not out.is_symlink() and not _entries(out):  # e.g. a freshly mounted disk
        if not force:
            raise FlashLLMError(f"{out}: already exists (empty: pass --force to convert into it)")
        return
    if not force and out.is_dir() and (out / fmt.MANIFEST).is_file():
        raise FlashLLMError(f"{out}: already exists (pass --force to replace this flashllm model directory)")
    if not force:
        raise FlashLLMError(f"{out}: already exists and is not a flashllm model directory; convert into a new "
                            f"directory, e.g. {out / 'model'}")
    if out.is_symlink() or not out.is_dir():
        raise FlashLLMError(f"{out}: exists and is not a directory; --force replaces only a flashllm model "
                            f"directory or an empty one (nothing was changed)")
    if not (out / fmt.MANIFEST).is_file():
        raise FlashLLMError(f"{out}: not a flashllm model directory (no {fmt.MANIFEST}) and not empty; --force "
                            f"replaces only those (nothing was changed); convert into a new subdirectory of it "
                            f"instead, e.g. {out / 'model'}")
    foreign = [name for name in fmt.foreign_files(out) if name in _entries(out)]
    if foreign:
        names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FlashLLMError(f"{out}: holds what flashllm did not write ({names}); --force replaces a model directory "
                            f"only with flashllm's own files in it: move those out first (nothing was changed)")


def make_temporary(out: Path) -> Path:
    """The temporary directory the model is written into (this is where an unwritable location shows, before any
    work): inside `out` when it is an existing directory, so that the model is written on `out`'s own file system
    and `out` itself is never renamed (a mount point cannot be), else beside `out`."""
    inside = out.is_dir() and not out.is_symlink()
    tmp = out / f"{PARTIAL}{os.getpid()}" if inside else out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        if inside:  # leftovers of an interrupted conversion into `out` (check_replaceable ignored them)
            for name in os.listdir(out):
                if name.startswith((PARTIAL, OLD)):
                    shutil.rmtree(out / name, ignore_errors=True)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise FlashLLMError(f"{tmp.parent}: cannot write the output there ({exc.strerror})") from None
    return tmp


def _check_space(tmp: Path, need: int) -> None:
    free = shutil.disk_usage(tmp).free
    if free < need:
        raise FlashLLMError(f"{tmp.parent}: the converted model needs {need / 2**30:.2f} GiB but only "
                            f"{free / 2**30:.2f} GiB are free there")


def write_ffn(path: Path, layout: fmt.FFNLayout, rows_of_layer, dtype: str,
              on_layer=None) -> tuple[str, list[str]]:
    """Write every layer's neurons; `rows_of_layer(i)` gives part -> [d_ffn, d] rows (values, stored as `dtype`).

    Returns the sha256 of the whole file and of each layer's byte range (padding included).
    """
    file_sha, layer_sha = hashlib.sha256(), []
    offsets = list(layout.layer_offsets) + [layout.file_size]
    with open(path, "wb") as f:
        for i in range(len(layout.layer_offsets)):
            parts = rows_of_layer(i)
            bundles = np.zeros((layout.d_ffn, layout.stride), dtype=np.uint8)  # the in-memory row layout
            for part in layout.parts:
                bundles[:, layout.part_range(part)] = _part_bytes(parts[part], layout, dtype)
            block = np.zeros(offsets[i + 1] - offsets[i], dtype=np.uint8)
            for base, stride, nbytes, col in layout.segments(i):
                start = base - offsets[i]
                region = block[start:start + layout.d_ffn * stride].reshape(layout.d_ffn, stride)
                region[:, :nbytes] = bundles[:, col:col + nbytes]
            data = memoryview(block)
            f.write(data)
            file_sha.update(data)
            layer_sha.append(hashlib.sha256(data).hexdigest())
            if on_layer:
                on_layer(1)
    return file_sha.hexdigest(), layer_sha


def _part_bytes(rows: np.ndarray, layout: fmt.FFNLayout, dtype: str) -> np.ndarray:
    """[d_ffn, d] weights -> [d_ffn, part_bytes] uint8 as stored: quantized, or cast to `dtype`."""
    if isinstance(rows, GGUFRows):  # stored GGUF blocks: mapped exactly where they are flashllm groups
        return rows.encode(layout.quant, dtype)
    if layout.quant:
        return layout.quant.quantize(np.asarray(rows, dtype=np.float32))
    return storage_bytes(rows, dtype)


def write_manifest(root: Path, spec: ArchSpec, dtype_name: str, layout: fmt.FFNLayout, ffn_sha: str,
                   layer_sha: list[str], tokenizer_files: list[str], source: dict, ffn_file: str = fmt.FFN_FILE) -> None:
    """Write flashllm.json describing the files already in `root` (their sizes and checksums).
    `ffn_file` is the streamed file: FFN bundles, or expert bundles for an MoE model."""
    files = {"resident": fmt.RESIDENT_FILE, "ffn": ffn_file, **{f: f for f in tokenizer_files}}
    manifest = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "spec": spec.to_dict(),
        "dtype": dtype_name,
        "quantization": layout.quant.name if getattr(layout, "quant", None) else "none",
        "files": {key: {"path": rel, "size": (root / rel).stat().st_size,
                        "sha256": ffn_sha if key == "ffn" else fmt.sha256_file(root / rel)}
                  for key, rel in files.items()},
        "ffn": {**layout.to_dict(), "layer_sha256": layer_sha},
        "source": source,
    }
    tmp = root / (fmt.MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / fmt.MANIFEST)


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished model into place; what `out` held is removed only after that succeeds. A temporary
    directory inside `out` (`make_temporary`) has its files moved up into `out`: the old manifest goes aside
    first and the new one comes last, so `out` never holds a manifest over a mix of files."""
    if tmp.parent == out:
        old = out / f"{OLD}{os.getpid()}"
        old.mkdir()
        for name in sorted(_entries(out), key=lambda n: n != fmt.MANIFEST):
            os.replace(out / name, old / name)
        for name in sorted(os.listdir(tmp), key=lambda n: n == fmt.MANIFEST):
            os.replace(tmp / name, out / name)
        tmp.rmdir()
        shutil.rmtree(old, ignore_errors=True)
    elif out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
