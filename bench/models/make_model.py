"""Write a model of real size with random weights directly in flashllm's format (no checkpoint needed).

Benchmarks of I/O and memory behaviour need the real byte sizes of a 7B model, not its knowledge:
this writes e.g. an OPT-6.7B-shaped float16 model (13.4 GB) tensor by tensor, with bounded memory
(one resident tensor or one FFN layer at a time), showing progress, into a temporary directory that
is renamed into place when complete. Every tensor is drawn from its own generator seeded by
(--seed, tensor name), so a `--no-bundle` copy and the `--hf` checkpoint hold identical weights.

Weights: linear layers and embeddings N(0, 0.02²) (the HF init), norm weights 1, biases 0.
Random weights have no real activation sparsity (about half of the ReLU neurons fire): pair the
model with an activation trace (bench/models/activation_trace.py) for sparse-mode measurements.

    python -m bench models make --shape opt-6.7b --out /data/opt-6.7b [--dtype float16] [--hf] [--no-bundle]

`--hf` also writes an HF checkpoint (config.json + one safetensors shard per layer + index) of the
same weights into OUT/hf (or --hf-out), so the converter and other runtimes can be benchmarked on
them. No tokenizer is written: drive these models with token ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.format.quant import QuantScheme
from flashllm.format.spec import ArchSpec
from flashllm.format.safetensors_io import storage_bytes, write_safetensors

STD = 0.02
OPT = dict(family="opt", norm="layernorm", norm_eps=1e-5, positional="learned", activation="relu", qkv_bias=True,
           o_bias=True, ffn_bias=True, tied_embeddings=True, bos_token_id=2, eos_token_id=2)
LLAMA = dict(family="llama", norm="rmsnorm", norm_eps=1e-6, positional="rotary", rope_theta=10000.0,
             gated_ffn=True, activation="relu", tied_embeddings=False, bos_token_id=1, eos_token_id=2)


def _shape(base: dict, vocab: int, d: int, layers: int, heads: int, ffn: int, positions: int, kv: int | None = None):
    return dict(base, vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv or heads,
                head_dim=d // heads, d_ffn=ffn, max_positions=positions)


# The real models' dimensions. llama-7b uses ReLU (a "ReLU-fied" Llama as in the paper's sparse
# Llama runs; pass --activation silu for the original, which has no activation sparsity).
SHAPES = {
    "opt-6.7b": _shape(OPT, 50272, 4096, 32, 32, 16384, 2048),
    "opt-1.3b": _shape(OPT, 50272, 2048, 24, 32, 8192, 2048),
    "llama-7b": _shape(LLAMA, 32000, 4096, 32, 32, 11008, 4096),
    # 2 of llama-7b's 32 layers (the same shapes; the same weights as its layers 0-1, by the seed rule):
    # compute benchmarks beside other jobs when the whole 7B does not fit in free memory
    "llama-7b-2l": _shape(LLAMA, 32000, 4096, 2, 32, 11008, 4096),
    "tiny": _shape(OPT, 128, 64, 8, 4, 512, 128),  # smoke tests (naive fits a 50% budget)
    "tiny-llama": _shape(LLAMA, 128, 64, 2, 4, 96, 128, kv=2),
}
# Mixture of experts (d_ffn: neurons per expert). qwen3-30b-a3b-4l has Qwen3-30B-A3B's layer (128
# experts of 768, top-8, GQA 32/4 heads of 128, qk-norm) but 4 of its 48 layers and a 32000-token
# vocabulary: 5.0 GB in float16, small enough to write and read in a session on this machine.
QWEN3_MOE = dict(LLAMA, family="qwen3_moe", activation="silu", qk_norm=True, norm_topk_prob=True)
SHAPES.update({
    "qwen3-30b-a3b": dict(_shape(QWEN3_MOE, 151936, 2048, 48, 32, 768, 4096, kv=4), head_dim=128,
                          n_experts=128, top_k=8),
    "qwen3-30b-a3b-4l": dict(_shape(QWEN3_MOE, 32000, 2048, 4, 32, 768, 4096, kv=4), head_dim=128,
                             n_experts=128, top_k=8),
    "mixtral-8x7b": dict(_shape(LLAMA, 32000, 4096, 32, 32, 14336, 4096, kv=8), family="mixtral",
                         activation="silu", n_experts=8, top_k=2, norm_topk_prob=True),
    "tiny-moe": dict(_shape(QWEN3_MOE, 128, 64, 2, 4, 32, 128, kv=2), n_experts=8, top_k=2),
})


def spec_for(shape: str, activation: str | None = None) -> ArchSpec:
    fields = dict(SHAPES[shape])
    if activation:
        fields["activation"] = activation
    return ArchSpec(**fields)


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


class RandomWeights:
    """Every tensor of the model by canonical name, reproducible from (seed, name) alone."""

    def __init__(self, spec: ArchSpec, dtype: str, seed: int):
        self.spec, self.dtype, self.seed = spec, dtype, seed

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """float32 values (rounded to the storage dtype `dtype` when written)."""
        last = name.rsplit(".", 1)[-1]
        is_norm = "norm" in name
        if is_norm and last == "weight":
            return np.ones(shape, dtype=np.float32)
        if last == "bias" or name.endswith("_bias"):
            return np.zeros(shape, dtype=np.float32)
        g = torch.Generator().manual_seed(_seed(self.seed, name))
        out = torch.empty(shape, dtype=torch.float32)
        out.normal_(0.0, STD, generator=g)
        return out.numpy()

    def stored(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """`get` rounded to the storage dtype, as values (bfloat16 widened back exactly to float32)."""
        raw = storage_bytes(self.get(name, shape), self.dtype)
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if self.dtype == "bfloat16" else \
            raw.view(self.dtype)

    def expert_rows(self, layer: int):
        """Per expert of the layer: gate, up and down^T, each [d_ffn, d_model] (one expert at a time)."""
        s, parts = self.spec, ("gate", "up", "down")
        return ({p: self.get(f"layers.{layer}.experts.{e}.{p}", (s.d_ffn, s.d_model)) for p in parts}
                for e in range(s.n_experts))

    def quantized_expert_bundles(self, layout, layer: int):
        """Stored bundles of quantized experts drawn directly as codes: uniform random codes, and per group
        the float16 scale and minimum that N(0, 0.02²) rows get (their mean over 64 sample rows).
        Quantizing 30B random floats would take this machine most of an hour; the bytes read and
        computed per expert are the same."""
        q, template = layout.quant, np.zeros(layout.bundle_bytes, dtype=np.uint8)
        codes = []  # per part: its rows' code bytes, as views of the template
        for part in layout.parts:
            rows, n = layout.part_shape(part)
            pieces = q.part_layout(n)
            sample = q.quantize(self.stored("quant.sample", (64, n)).astype(np.float32))
            stored = template[layout.part_range(part)].reshape(rows, layout.row_bytes(part))
            for k, (o, size) in pieces.items():
                if k != "codes":
                    typical = sample[:, o:o + size].copy().view(np.float16).astype(np.float32).mean()
                    stored[:, o:o + size] = np.full(size // 2, typical, dtype=np.float16).view(np.uint8)
            o, size = pieces["codes"]
            codes.append(stored[:, o:o + size])
        for e in range(layout.n_experts):
            rng = np.random.default_rng(_seed(self.seed, f"layers.{layer}.experts.{e}"))
            for view in codes:
                view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            bundle = np.zeros(layout.stride, dtype=np.uint8)
            bundle[:layout.bundle_bytes] = template
            yield bundle

    def ffn_rows(self, layer: int) -> dict[str, np.ndarray]:
        """Per bundle part, [d_ffn, d_model] rows (for `down`: the columns of the down projection)."""
        s = self.spec
        return {part: self.get(f"layers.{layer}.ffn_{part}", (s.d_ffn, s.d_model)) for part in s.bundle_parts}


class _Dropper:
    """Flush what was written to `path` so far and drop it from the page cache (keeps RSS of the
    machine's page cache bounded while many GB are written)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, *_):
        if not self.path.exists() or not hasattr(os, "posix_fadvise"):
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _layout(spec: ArchSpec, itemsize: int, bundled: bool, quantize: str = "none"):
    quant = None if quantize == "none" else QuantScheme.named(quantize)
    return fmt.ExpertLayout.plan(spec, itemsize, quant) if spec.is_moe else \
        fmt.FFNLayout.plan(spec, itemsize, bundled, quant)


def model_bytes(spec: ArchSpec, itemsize: int, bundled: bool = True, quantize: str = "none") -> int:
    resident = sum(int(np.prod(s)) for s in fmt.resident_shapes(spec).values()) * itemsize
    return resident + _layout(spec, itemsize, bundled, quantize).file_size


def write_model(spec: ArchSpec, out: Path, dtype_name: str = "float16", seed: int = 0, bundled: bool = True,
                force: bool = False, progress: bool | None = None, shape_name: str = "",
                quantize: str = "none", link_resident: Path | None = None, expert_layout: str = "portable") -> Path:
    """Write the flashllm model directory `out` (atomically: temp dir + rename); `quantize` int8/int4
    stores the FFN bundles (or an MoE model's experts: codes drawn directly, see quantized_expert_bundles)
    group-wise quantized, as `flashllm convert --quantize` does. `link_resident`: a model directory of
    the same spec, dtype and seed whose resident file (the same bytes: quantization is of the FFN only)
    is hard-linked instead of written again (a 7B shape's 4.8 GB). `expert_layout` as `flashllm convert`'s."""
    from tqdm import tqdm

    from flashllm.converters.families.moe import expert_bundles, expert_packing, packed_bundles, write_experts
    from flashllm.converters.writer import _replace, check_replaceable, make_temporary, write_ffn, write_manifest

    out = Path(out)
    check_replaceable(out, force)
    itemsize = fmt.STORAGE_DTYPES[dtype_name]
    layout = _layout(spec, itemsize, bundled, quantize)
    if expert_layout != "portable":
        layout = dataclasses.replace(layout, packing=expert_packing(expert_layout, spec, layout.quant))
    ffn_file = fmt.EXPERTS_FILE if spec.is_moe else fmt.FFN_FILE
    weights = RandomWeights(spec, dtype_name, seed)
    shapes = fmt.resident_shapes(spec)
    if link_resident is not None:
        _check_same_resident(Path(link_resident), spec, dtype_name, seed)
    tmp = make_temporary(out)
    try:
        total = model_bytes(spec, itemsize, bundled, quantize)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {out.name}", file=sys.stderr,
                  disable=None if progress is None else not progress) as bar:
            drop = _Dropper(tmp / fmt.RESIDENT_FILE)

            def produce(name):
                t = weights.get(name, shapes[name])
                bar.update(t.size * itemsize)
                if t.size * itemsize >= 64 << 20:
                    drop()
                return t

            if link_resident is not None:
                os.link(Path(link_resident) / fmt.RESIDENT_FILE, tmp / fmt.RESIDENT_FILE)
                bar.update(sum(int(np.prod(s)) for s in shapes.values()) * itemsize)
            else:
                write_safetensors(tmp / fmt.RESIDENT_FILE, [(n, dtype_name, s) for n, s in shapes.items()], produce,
                                  metadata={"format": fmt.FORMAT_NAME})
            drop()
            drop_ffn = _Dropper(tmp / ffn_file)

            def on_layer(_):
                bar.update(layout.layer_offsets[1] if len(layout.layer_offsets) > 1 else layout.layer_bytes)
                drop_ffn()

            if spec.is_moe:
                def bundles(i):
                    if layout.packing:
                        return packed_bundles(layout, weights.quantized_expert_bundles(
                            dataclasses.replace(layout, packing=None), i))
                    if layout.quant:
                        return weights.quantized_expert_bundles(layout, i)
                    return expert_bundles(layout, weights.expert_rows(i), dtype_name)

                ffn_sha, layer_sha = write_experts(tmp / ffn_file, layout, bundles, on_layer)
            else:
                ffn_sha, layer_sha = write_ffn(tmp / ffn_file, layout, weights.ffn_rows, dtype_name, on_layer)
            drop_ffn()
        source = {"path": f"bench/models/make_model.py --shape {shape_name} --seed {seed}"
                          + (f" --quantize {quantize}" if quantize != "none" else "")
                          + (f" --expert-layout {expert_layout}" if expert_layout != "portable" else ""),
                  "model_type": spec.family, "random_weights": True, "seed": seed}
        write_manifest(tmp, spec, dtype_name, layout, ffn_sha, layer_sha, [], source=source, ffn_file=ffn_file)
        drop()  # write_manifest read the resident file back for its checksum
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_same_resident(src: Path, spec: ArchSpec, dtype_name: str, seed: int) -> None:
    """--link-resident: SRC must be a make_model model of this spec, dtype and seed."""
    manifest = fmt.read_manifest(src, verify=False)
    source = manifest.data.get("source", {})
    if not (source.get("random_weights") and source.get("seed") == seed and manifest.dtype == dtype_name
            and manifest.spec == spec):
        raise FlashLLMError(f"--link-resident {src}: not a bench/models/make_model.py model of this shape, dtype "
                            f"{dtype_name} and seed {seed}")


# -- the same weights as an HF checkpoint ------------------------------------------------------
def hf_config(spec: ArchSpec, dtype_name: str) -> dict:
    if spec.family == "opt":
        return {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": spec.vocab_size,
                "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
                "num_attention_heads": spec.n_heads, "ffn_dim": spec.d_ffn,
                "max_position_embeddings": spec.max_positions, "word_embed_proj_dim": spec.d_model,
                "do_layer_norm_before": True, "enable_bias": True, "layer_norm_elementwise_affine": True,
                "activation_function": spec.activation, "tie_word_embeddings": spec.tied_embeddings,
                "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id, "pad_token_id": 1,
                "dropout": 0.0, "attention_dropout": 0.0, "torch_dtype": dtype_name}
    if spec.family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
                "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
                "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.n_kv_heads,
                "intermediate_size": spec.d_ffn, "max_position_embeddings": spec.max_positions,
                "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "hidden_act": spec.activation,
                "tie_word_embeddings": spec.tied_embeddings, "attention_bias": False, "mlp_bias": False,
                "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id, "torch_dtype": dtype_name}
    raise SystemExit(f"--hf: no HF config for family {spec.family!r}")


def hf_tensors(spec: ArchSpec, weights: RandomWeights) -> list[list[tuple[str, tuple, callable]]]:
    """Shards of (HF name, shape, produce): globals first, then one shard per layer."""
    from flashllm.converters.families.dense import FAMILIES

    fam = next(f for f in FAMILIES if spec.family in f.model_types)
    shapes = fmt.resident_shapes(spec)
    shards: list[list] = [[]]
    for name, shape in shapes.items():
        if name.startswith("layers."):
            continue
        module, param = name.rsplit(".", 1)
        hf = f"{fam.globals[module]}.{param}"
        if name == "pos_embed.weight":  # OPT keeps 2 unused rows before position 0
            full = (shape[0] + 2, shape[1])
            shards[0].append((hf, full, lambda n=name, s=shape: np.concatenate(
                (weights.get("pos_embed.offset_rows", (2, s[1])), weights.get(n, s)))))
        else:
            shards[0].append((hf, shape, lambda n=name, s=shape: weights.get(n, s)))
    for i in range(spec.n_layers):
        prefix, shard = fam.layer_prefix.format(i=i), []
        for name, shape in shapes.items():
            if not name.startswith(f"layers.{i}."):
                continue
            module, param = name.split(".")[2], name.rsplit(".", 1)[-1]
            if module.endswith("_bias"):
                hf = f"{prefix}{fam.ffn[module[:-5]]}.bias"
            else:
                hf = f"{prefix}{fam.layer[module]}.{param}"
            shard.append((hf, shape, lambda n=name, s=shape: weights.get(n, s)))
        for part in spec.bundle_parts:
            rows = (spec.d_ffn, spec.d_model)
            if part == "down":
                shard.append((f"{prefix}{fam.ffn[part]}.weight", (spec.d_model, spec.d_ffn),
                              lambda n=f"layers.{i}.ffn_{part}": weights.get(n, rows).T))
            else:
                shard.append((f"{prefix}{fam.ffn[part]}.weight", rows,
                              lambda n=f"layers.{i}.ffn_{part}": weights.get(n, rows)))
        shards.append(shard)
    return shards


def write_hf(spec: ArchSpec, out: Path, dtype_name: str = "float16", seed: int = 0, force: bool = False,
             progress: bool | None = None) -> Path:
    """An HF checkpoint directory with the same weights as `write_model` (atomically)."""
    from tqdm import tqdm

    from flashllm.converters.writer import _replace

    out = Path(out)
    if out.exists() and not force:
        raise SystemExit(f"{out}: already exists (pass --force to replace it)")
    itemsize = fmt.STORAGE_DTYPES[dtype_name]
    weights = RandomWeights(spec, dtype_name, seed)
    shards = hf_tensors(spec, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map, total = {}, 0
        for shard in shards:
            for _, shape, _ in shard:
                total += int(np.prod(shape)) * itemsize
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {out.name}", file=sys.stderr,
                  disable=None if progress is None else not progress) as bar:
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                produce_of = {n: p for n, _, p in shard}

                def produce(name, produce_of=produce_of):
                    t = produce_of[name]()
                    bar.update(t.size * itemsize)
                    return t

                write_safetensors(tmp / fname, [(n, dtype_name, s) for n, s, _ in shard], produce,
                                  metadata={"format": "pt"})
                _Dropper(tmp / fname)()
                weight_map.update({n: fname for n, _, _ in shard})
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(hf_config(spec, dtype_name), indent=1))
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="model directory to write (flashllm format)")
    p.add_argument("--dtype", default="float16", choices=sorted(fmt.STORAGE_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bundle", action="store_true",
                   help="unbundled FFN layout (up rows and down columns in separate regions: the paper's "
                        "baseline without row-column bundling)")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="FFN bundles (MoE shapes: experts) group-wise quantized as `flashllm convert --quantize` "
                   "stores them (asymmetric, groups of 64; default: %(default)s)")
    p.add_argument("--expert-layout", default="portable", choices=["portable", "torch-cpu"],
                   help="MoE int4 experts as `flashllm convert --expert-layout` stores them (default: %(default)s)")
    p.add_argument("--link-resident", default=None, metavar="DIR",
                   help="hard-link DIR's resident file (a model of the same shape, dtype and seed, e.g. the float16 "
                   "one beside a --quantize one) instead of writing it again")
    p.add_argument("--activation", default=None, help="override the shape's activation (e.g. silu)")
    p.add_argument("--layers", type=int, default=None,
                   help="cut the shape to its first N layers (same per-layer shape and weights; default: all)")
    p.add_argument("--hf", action="store_true", help="also write an HF checkpoint of the same weights")
    p.add_argument("--hf-out", default=None, help="where to write it (default OUT/hf)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is a flashllm model directory or empty")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> Path:
    args = setup_arg_parser().parse_args(argv)
    spec = spec_for(args.shape, args.activation)
    if args.layers is not None:
        if not 0 < args.layers <= spec.n_layers:
            raise SystemExit(f"make_model: error: --layers {args.layers}: expected 1 to {spec.n_layers} "
                             "(the shape's layers)")
        spec = dataclasses.replace(spec, n_layers=args.layers)
    t0 = time.perf_counter()
    try:
        out = write_model(spec, Path(args.out), args.dtype, args.seed, not args.no_bundle, args.force,
                          False if args.quiet else None, args.shape, args.quantize, args.link_resident, args.expert_layout)
    except FlashLLMError as exc:
        raise SystemExit(f"make_model: error: {exc}") from None
    size = sum(e["size"] for e in fmt.read_manifest(out, verify=False).data["files"].values())
    print(f"{out}: {args.shape} {args.dtype} {'unbundled' if args.no_bundle else 'bundled'}"
          f"{'' if args.quantize == 'none' else ', FFN ' + args.quantize}, "
          f"{size / 1e9:.2f} GB, seed {args.seed}, {time.perf_counter() - t0:.0f} s")
    if args.hf:
        hf = write_hf(spec, Path(args.hf_out) if args.hf_out else out / "hf", args.dtype, args.seed, args.force,
                      False if args.quiet else None)
        print(f"{hf}: HF checkpoint of the same weights")
    return out


if __name__ == "__main__":
    main()
