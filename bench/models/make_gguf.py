"""Write a Llama-shaped GGUF file with random Q4_0 weights (as llama.cpp's Q4_0 files hold them), streamed.

Each 2-D weight is Q4_0 blocks (a float16 scale d and 32 four-bit codes, w = (c - 8) d) with random codes
and scales around 0.02 / 4, norms F32 ones; tensor names and metadata as llama.cpp's converter writes them
(no vocabulary: drive the converted model with token ids). One tensor is in memory at a time.

    python -m bench.models.make_gguf --shape llama-7b --out model-Q4_0.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.models.make_model import spec_for

BLOCK, BLOCK_BYTES = 32, 18  # Q4_0


def tensors(spec):
    """(GGUF name, numpy shape [rows, columns] or [n], Q4_0 or F32) in llama.cpp's order."""
    d, f, kv = spec.d_model, spec.d_ffn, spec.n_kv_heads * spec.head_dim
    yield "token_embd.weight", (spec.vocab_size, d), "Q4_0"
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), "F32"
        for name, shape in (("attn_q", (d, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, d)),
                            ("ffn_gate", (f, d)), ("ffn_up", (f, d)), ("ffn_down", (d, f))):
            yield f"{b}{name}.weight", shape, "Q4_0"
        yield b + "ffn_norm.weight", (d,), "F32"
    yield "output_norm.weight", (d,), "F32"
    yield "output.weight", (spec.vocab_size, d), "Q4_0"


def random_blocks(shape, rng) -> np.ndarray:
    """Q4_0 blocks of a [rows, columns] weight: uint8 [rows, columns / 32 * 18]."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // BLOCK, BLOCK_BYTES), dtype=np.uint8)
    scales = rng.uniform(0.004, 0.006, size=(rows, cols // BLOCK)).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(rows, cols // BLOCK, 2)
    return blocks.reshape(rows, -1)


def write_gguf(shape: str, out: Path, seed: int = 0) -> Path:
    """The GGUF file of `shape` (bench/models/make_model.py's SHAPES, Llama-style dense ones)."""
    import gguf

    spec = spec_for(shape)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random {shape}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_vocab_size(spec.vocab_size)
    w.add_context_length(spec.max_positions)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.d_ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.head_dim)
    listed = list(tensors(spec))
    for name, shp, kind in listed:
        if kind == "F32":
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * shp[0])
        else:
            nbytes = shp[0] * shp[1] // BLOCK * BLOCK_BYTES
            w.add_tensor_info(name, (shp[0], shp[1] // BLOCK * BLOCK_BYTES), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shp, kind in listed:
        w.write_tensor_data(np.ones(shp, np.float32) if kind == "F32" else random_blocks(shp, rng))
    w.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-7b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_gguf(args.shape, args.out, args.seed)


if __name__ == "__main__":
    main()
