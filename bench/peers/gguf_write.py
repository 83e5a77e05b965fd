"""A Q4_0 GGUF of bench/models/make_model.py's random MoE weights, written directly (no HF checkpoint), for bench/peers/run.py.

An MoE model of Qwen3-30B-A3B's shape is 61 GB as an HF float16 checkpoint, more disk than this machine
has beside everything else, so llama.cpp's converter (bench/peers/gguf_convert.py) cannot be used on it. This
writes, through gguf-py's GGUFWriter (vendored in the llama.cpp that bench/build_llama_cpp.sh builds), the
tensors and metadata keys llama.cpp's converter writes for a Qwen3-MoE checkpoint, tensor by tensor:

- resident tensors (embeddings, attention, norms, router, lm_head): make_model's RandomWeights for --seed,
  the values flashllm's model of that shape and seed holds; the 2-D ones quantized with gguf-py's Q4_0
  quantizer (as `llama-quantize Q4_0` does, except that it keeps output.weight in Q6_K, which gguf-py
  cannot write), the norms and the router in F32 (as llama.cpp keeps them);
- experts: Q4_0 blocks drawn directly as codes (uniform random 4-bit codes, every block with the typical
  scale of N(0, 0.02²) blocks), as make_model draws flashllm's int4 experts: quantizing 30B random
  floats would take this machine most of an hour, and the bytes llama.cpp reads and computes per expert
  are the same. The experts' values therefore differ from flashllm's (both random).

The vocabulary is llama.cpp's bundled Llama SentencePiece one (models/ggml-vocab-llama-spm.gguf), cut or
padded with unused tokens to the model's vocab size: llama-bench decodes random token ids and never
tokenizes.

    python -m bench peers gguf-moe --shape qwen3-30b-a3b --layers 20 --seed 0 OUT.gguf [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

from flashllm.format import manifest as fmt

from bench.harness import llama_cpp_dir
from bench.models import make_model as mm

DEFAULT_LLAMA_CPP = llama_cpp_dir()
ARCH = {"qwen3_moe": "qwen3moe"}  # flashllm family -> llama.cpp architecture this writes
# flashllm's canonical resident names -> GGUF names (per layer: "blk.{i}.")
GLOBAL_NAMES = {"embed.weight": "token_embd.weight", "final_norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
               "q.weight": "attn_q.weight", "k.weight": "attn_k.weight", "v.weight": "attn_v.weight",
               "o.weight": "attn_output.weight", "q_norm.weight": "attn_q_norm.weight",
               "k_norm.weight": "attn_k_norm.weight", "router.weight": "ffn_gate_inp.weight"}
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # values per block; float16 scale + 16 bytes of 4-bit codes


def gguf_module(llama_cpp: Path):
    src = llama_cpp / "src" / "llama.cpp" / "gguf-py"
    if not (src / "gguf").is_dir():
        raise SystemExit(f"gguf_write: error: {src}: no gguf-py: build llama.cpp there with bench/build_llama_cpp.sh, or point --llama-cpp (or $LLAMA_CPP_DIR) at its prefix")
    sys.path.insert(0, str(src))
    import gguf

    return gguf


def gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    if rest not in LAYER_NAMES:
        raise SystemExit(f"gguf_write: error: no GGUF name for tensor {name!r}")
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def typical_q4_0_scale(gguf, weights, cols: int) -> np.float16:
    """The mean |scale| of Q4_0 blocks of N(0, 0.02²) values (64 sample rows)."""
    sample = weights.get("quant.sample", (64, cols))
    blocks = gguf.quants.quantize(sample, gguf.GGMLQuantizationType.Q4_0).reshape(-1, Q4_0_BYTES)
    return np.abs(blocks[:, :2].copy().view(np.float16).astype(np.float32)).mean().astype(np.float16)


def random_q4_0(rng: np.random.Generator, shape: tuple[int, ...], scale: np.float16) -> np.ndarray:
    """Q4_0 bytes of a tensor `shape` (last dim a multiple of 32): uniform codes, every block scaled `scale`."""
    *lead, cols = shape
    out = np.empty((*lead, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    out[..., :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    out[..., 2:] = rng.integers(0, 256, out[..., 2:].shape, dtype=np.uint8)
    return out.reshape(*lead, cols // Q4_0_BLOCK * Q4_0_BYTES)


def add_metadata(gguf, w, spec, name: str, llama_cpp: Path) -> None:
    arch = ARCH[spec.family]
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.max_positions)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.d_ffn)
    w.add_expert_feed_forward_length(spec.d_ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_expert_count(spec.n_experts)
    w.add_expert_used_count(spec.top_k)
    assert w.arch == arch
    vocab = gguf.GGUFReader(llama_cpp / "src" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf", "r")
    field = vocab.get_field

    def values(key):
        f = field(key)
        return [f.parts[i].tolist()[0] for i in f.data]

    tokens = [bytes(field(gguf.Keys.Tokenizer.LIST).parts[i]) for i in field(gguf.Keys.Tokenizer.LIST).data]
    scores, types = values(gguf.Keys.Tokenizer.SCORES), values(gguf.Keys.Tokenizer.TOKEN_TYPE)
    pad = range(len(tokens), spec.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list((tokens + [f"[PAD{i}]".encode() for i in pad])[:spec.vocab_size])
    w.add_token_scores((scores + [0.0] * len(pad))[:spec.vocab_size])
    w.add_token_types((types + [int(gguf.TokenType.UNUSED)] * len(pad))[:spec.vocab_size])
    for key, add in ((gguf.Keys.Tokenizer.BOS_ID, w.add_bos_token_id), (gguf.Keys.Tokenizer.EOS_ID, w.add_eos_token_id),
                     (gguf.Keys.Tokenizer.UNK_ID, w.add_unk_token_id)):
        if field(key) is not None:
            add(field(key).parts[-1].tolist()[0])


def plan_tensors(gguf, spec, weights, seed: int):
    """(GGUF name, numpy shape, GGML type, produce) in file order: per layer its resident tensors, then experts."""
    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    shapes = fmt.resident_shapes(spec)
    plan = []

    def resident(name, shape):
        kind = f32 if len(shape) == 1 or name.endswith("router.weight") else q4
        if kind == f32:
            return gguf_name(name), shape, kind, lambda: weights.get(name, shape).astype(np.float32)
        return gguf_name(name), shape, kind, lambda: gguf.quants.quantize(weights.stored(name, shape).astype(np.float32), q4)

    scale = {cols: typical_q4_0_scale(gguf, weights, cols) for cols in {spec.d_model, spec.d_ffn}}
    for name, shape in shapes.items():
        if not name.startswith("layers."):
            plan.append(resident(name, shape))
    for i in range(spec.n_layers):
        plan += [resident(n, s) for n, s in shapes.items() if n.startswith(f"layers.{i}.")]
        for part, shape in (("gate", (spec.n_experts, spec.d_ffn, spec.d_model)),
                            ("up", (spec.n_experts, spec.d_ffn, spec.d_model)),
                            ("down", (spec.n_experts, spec.d_model, spec.d_ffn))):
            rng = np.random.default_rng(mm._seed(seed, f"gguf.layers.{i}.experts.{part}"))
            plan.append((f"blk.{i}.ffn_{part}_exps.weight", shape, q4,
                         lambda rng=rng, shape=shape: random_q4_0(rng, shape, scale[shape[-1]])))
    return plan


def write(spec, out: Path, seed: int = 0, llama_cpp: Path = DEFAULT_LLAMA_CPP, name: str = "", progress=None) -> Path:
    """Write OUT (a temporary name, then rename)."""
    from tqdm import tqdm

    if spec.family not in ARCH:
        raise SystemExit(f"gguf_write: error: family {spec.family!r}: only {', '.join(ARCH)} is written directly "
                         "(use bench/peers/gguf_convert.py on an HF checkpoint)")
    if spec.d_model % Q4_0_BLOCK or spec.d_ffn % Q4_0_BLOCK:
        raise SystemExit(f"gguf_write: error: d_model {spec.d_model} and d_ffn {spec.d_ffn} must be multiples of 32 "
                         "(Q4_0 blocks)")
    gguf = gguf_module(llama_cpp)
    weights = mm.RandomWeights(spec, "float16", seed)
    tensors = plan_tensors(gguf, spec, weights, seed)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    w = gguf.GGUFWriter(tmp, ARCH[spec.family])
    try:
        add_metadata(gguf, w, spec, name or out.stem, llama_cpp)
        for tname, shape, kind, _ in tensors:
            if kind == gguf.GGMLQuantizationType.F32:
                w.add_tensor_info(tname, shape, np.dtype(np.float32), int(np.prod(shape)) * 4, raw_dtype=kind)
            else:  # quantized: gguf-py takes the shape of the bytes
                byte_shape = (*shape[:-1], shape[-1] // Q4_0_BLOCK * Q4_0_BYTES)
                w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(int(np.prod(s)) for _, s, _, _ in tensors)
        with tqdm(total=total, unit="param", unit_scale=True, desc=f"write {out.name}", file=sys.stderr,
                  disable=None if progress is None else not progress) as bar:
            for _, shape, _, produce in tensors:
                w.write_tensor_data(produce())
                bar.update(int(np.prod(shape)))
        w.close()
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--shape", required=True, help="bench/models/make_model.py shape (an MoE one, e.g. qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers (default: all)")
    p.add_argument("--seed", type=int, default=0, help="make_model's seed (default: %(default)s)")
    p.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP,
                   help="bench/build_llama_cpp.sh's prefix (default: $LLAMA_CPP_DIR, else %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.shape not in mm.SHAPES:
        raise SystemExit(f"gguf_write: error: --shape {args.shape}: choose from {', '.join(sorted(mm.SHAPES))}")
    spec = mm.spec_for(args.shape)
    if args.layers:
        spec = dataclasses.replace(spec, n_layers=args.layers)
    out = write(spec, Path(args.out), args.seed, args.llama_cpp,
                f"{args.shape}{f' ({args.layers} layers)' if args.layers else ''} seed {args.seed}",
                False if args.quiet else None)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB (Q4_0)")
    return out


if __name__ == "__main__":
    main()
