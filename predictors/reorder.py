"""Rewrite a model directory with each layer's FFN neurons in a new order.

Permuting an FFN's neurons (up/gate rows, down columns, up/gate biases, together) leaves the model's
function unchanged, so the new order is written everywhere a neuron index means something: the bundles
in ffn.bin, the up/gate biases in resident.safetensors, the predictors' output rows and biases and the
activation frequencies (every per-neuron tensor: neurons along the first axis) in predictors.safetensors.
The runtime then needs no id mapping. The composed permutation (position j of layer i holds the
converter's neuron perm[i][j]) is kept in neuron_order.safetensors and described under the manifest's
"neuron_order" key, for provenance.

Every file is first written beside its target under a temporary name. The manifest is then replaced by
one marked "rewrite_pending" (which `read_manifest` refuses), the files are renamed into place, and the
final manifest (new sizes and checksums) goes last: an interrupted rewrite leaves a directory that says so
instead of one whose predictors silently disagree with its weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_META, PREDICTOR_FORMAT, PREDICTOR_VERSION
from flashllm.modes.sparse.activation_sparsity import SPARSITY_FILE
from flashllm.format.safetensors_io import SafetensorsFile, write_safetensors

ORDER_FILE = "neuron_order.safetensors"
PREDICTOR_INPUT_TENSORS = ("A",)  # per-layer predictor tensors NOT indexed by neuron


def _tmp(path: Path) -> Path:
    return path.parent / f".{path.name}.reorder-{os.getpid()}"


def current_order(manifest: fmt.Manifest) -> list[np.ndarray]:
    """The converter's neuron id at each position, per layer (identity unless the model was reordered)."""
    n, L = manifest.spec.d_ffn, manifest.spec.n_layers
    if not manifest.has("neuron_order"):
        return [np.arange(n, dtype=np.int64) for _ in range(L)]
    st = SafetensorsFile(manifest.path("neuron_order"))
    return [st.read(f"layers.{i}.perm").astype(np.int64) for i in range(L)]


def check_permutations(perms: list[np.ndarray], n_layers: int, d_ffn: int) -> None:
    if len(perms) != n_layers:
        raise FlashLLMError(f"neuron order: {len(perms)} layers given, the model has {n_layers}")
    for i, p in enumerate(perms):
        if p.shape != (d_ffn,) or not np.array_equal(np.sort(p), np.arange(d_ffn)):
            raise FlashLLMError(f"neuron order of layer {i}: not a permutation of 0..{d_ffn - 1}")


def _write_ffn(manifest: fmt.Manifest, perms: list[np.ndarray], dest: Path, progress) -> list[str]:
    """ffn.bin with layer i's neurons in order perms[i]; returns each layer's sha256 (padding included)."""
    import hashlib

    lay = manifest.layout
    offsets = list(lay.layer_offsets) + [lay.file_size]
    sums = []
    with open(manifest.path("ffn"), "rb") as src, open(dest, "wb") as out:
        for i, perm in enumerate(perms):
            block = np.frombuffer(src.read(offsets[i + 1] - offsets[i]), dtype=np.uint8).copy()
            for base, stride, _, _ in lay.segments(i):
                start = base - offsets[i]
                region = block[start:start + lay.d_ffn * stride].reshape(lay.d_ffn, stride)
                region[:] = region[perm]
            out.write(memoryview(block))
            sums.append(hashlib.sha256(block).hexdigest())
            progress(1)
    return sums


def _write_resident(manifest: fmt.Manifest, perms: list[np.ndarray], dest: Path) -> None:
    """A copy of resident.safetensors with each layer's per-neuron biases permuted in place."""
    src = manifest.path("resident")
    st = SafetensorsFile(src)
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as f:
        for i, perm in enumerate(perms):
            for part in ("up", "gate"):
                name = f"layers.{i}.{part}_bias"
                if name in st.entries:
                    raw = st.read_bytes(name).reshape(manifest.spec.d_ffn, -1)
                    f.seek(st.data_start + st.entries[name]["data_offsets"][0])
                    f.write(np.ascontiguousarray(raw[perm]).tobytes())


def _write_predictors(root: Path, perms: list[np.ndarray], d_ffn: int, dest: Path) -> None:
    """predictors.safetensors with every per-neuron tensor (first axis d_ffn) permuted."""
    st = SafetensorsFile(root / PREDICTOR_FILE)
    tensors = {}
    for name in st.names():
        t = st.read(name)
        layer, _, what = name.removeprefix("layers.").partition(".")
        if what not in PREDICTOR_INPUT_TENSORS and layer.isdigit() and t.ndim >= 1 and t.shape[0] == d_ffn:
            t = t[perms[int(layer)]]
        tensors[name] = np.ascontiguousarray(t)
    write_safetensors(str(dest), [(n, t.dtype, t.shape) for n, t in tensors.items()], tensors.__getitem__,
                      metadata=st.metadata)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def apply_order(model_dir: str | Path, perms: list[np.ndarray], info: dict, progress: bool | None = None) -> dict:
    """Put layer i's neuron perms[i][j] (in the directory's current order) at position j everywhere;
    record `info` (method, settings, measured effect) in the manifest. Returns the new manifest's data."""
    from flashllm.progress import progress_bar

    manifest = fmt.read_manifest(model_dir, verify=False)
    spec, root = manifest.spec, manifest.root
    if spec.is_moe:
        raise FlashLLMError(f"{root}: a mixture-of-experts model streams whole experts; neuron order does not apply")
    perms = [np.asarray(p, dtype=np.int64) for p in perms]
    check_permutations(perms, spec.n_layers, spec.d_ffn)
    has_predictors = (root / PREDICTOR_FILE).is_file() and (root / PREDICTOR_META).is_file()
    if has_predictors:
        _predictor_meta(root)  # refuse unreadable metadata before writing anything
    need = manifest.data["files"]["ffn"]["size"] + manifest.data["files"]["resident"]["size"]
    free = shutil.disk_usage(root).free
    if need > free:
        raise FlashLLMError(f"{root}: reordering writes new copies of ffn.bin and resident.safetensors "
                            f"({need / 2**30:.2f} GiB) but only {free / 2**30:.2f} GiB are free there")
    composed = [old[p] for old, p in zip(current_order(manifest), perms)]
    targets = {"ffn": manifest.path("ffn"), "resident": manifest.path("resident"), "order": root / ORDER_FILE}
    if has_predictors:
        targets["predictors"] = root / PREDICTOR_FILE
    tmps = {k: _tmp(p) for k, p in targets.items()}
    try:
        with progress_bar(progress, total=spec.n_layers, desc="reorder ffn.bin", unit="layer", leave=False) as bar:
            layer_sha = _write_ffn(manifest, perms, tmps["ffn"], bar.update)
        _write_resident(manifest, perms, tmps["resident"])
        write_safetensors(str(tmps["order"]), [(f"layers.{i}.perm", np.dtype(np.int32), (spec.d_ffn,))
                                               for i in range(spec.n_layers)],
                          lambda name: composed[int(name.split(".")[1])].astype(np.int32),
                          metadata={"format": "flashllm-neuron-order/1"})
        if has_predictors:
            _write_predictors(root, perms, spec.d_ffn, tmps["predictors"])
        data = json.loads(json.dumps(manifest.data))
        for key in ("ffn", "resident"):
            data["files"][key]["sha256"] = fmt.sha256_file(tmps[key])
        data["files"]["neuron_order"] = {"path": ORDER_FILE, "size": tmps["order"].stat().st_size,
                                         "sha256": fmt.sha256_file(tmps["order"])}
        data["ffn"]["layer_sha256"] = layer_sha
        data["neuron_order"] = {**info, "file": ORDER_FILE, "tensor": "layers.{i}.perm",
                                "meaning": "position j of layer i holds the converter's neuron perm[j]; ffn.bin, "
                                           "the FFN biases and the predictors are all stored in this order"}
        pending = {**manifest.data, "rewrite_pending": "predictors order (neuron reordering) was interrupted"}
        _write_json(root / fmt.MANIFEST, pending)
        for key, path in targets.items():
            os.replace(tmps[key], path)
        if has_predictors:
            _update_predictor_meta(root, manifest.data, data)
        _update_sparsity_meta(root, manifest.data, data)
        _write_json(root / fmt.MANIFEST, data)
    finally:
        for p in tmps.values():
            p.unlink(missing_ok=True)
    return data


def _predictor_meta(root: Path) -> dict:
    path = root / PREDICTOR_META
    try:
        meta = json.loads(path.read_text())
        ok = meta.get("format") == PREDICTOR_FORMAT and meta.get("format_version") == PREDICTOR_VERSION
    except (OSError, ValueError, AttributeError) as exc:
        raise FlashLLMError(f"{path}: unreadable predictor metadata ({exc})") from None
    if not ok:
        raise FlashLLMError(f"{path}: not flashllm predictors metadata (format/version)")
    return meta


def _update_sparsity_meta(root: Path, old: dict, new: dict) -> None:
    """sparsity.json (per-layer thresholds, independent of neuron order): the new ffn.bin's checksum."""
    path = root / SPARSITY_FILE
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    shas = (data.get("model") or {}).get("sha256")
    if isinstance(shas, dict) and shas.get("ffn") == old["files"]["ffn"]["sha256"]:
        shas["ffn"] = new["files"]["ffn"]["sha256"]
        _write_json(path, data)


def _update_predictor_meta(root: Path, old: dict, new: dict) -> None:
    """predictors.json: the rewritten predictor file's checksum, and the weights' checksums where the
    predictors matched the old weights (predictors trained for other weights stay marked as such)."""
    meta = _predictor_meta(root)
    meta["sha256"] = fmt.sha256_file(root / PREDICTOR_FILE)
    shas = (meta.get("model") or {}).get("sha256")
    if isinstance(shas, dict):
        for key in [k for k in shas if k in old["files"]]:
            if shas[key] == old["files"][key]["sha256"]:
                shas[key] = new["files"][key]["sha256"]
    meta["neuron_order"] = {"method": new["neuron_order"].get("method"),
                            "note": "per-neuron tensors rewritten in the model's neuron order"}
    _write_json(root / PREDICTOR_META, meta)
