"""An HF checkpoint to GGUF with llama.cpp's own converter (convert_hf_to_gguf.py), for bench/peers/run.py.

The converter, its `gguf` package (gguf-py, vendored beside it: the PyPI release of the same
version number, 0.19.0, lacks what this converter uses) and llama-quantize all come from the
llama.cpp that bench/build_llama_cpp.sh builds from the llama-cpp-python sdist. Checkpoints written by
bench/models/make_model.py --hf have no tokenizer (they are driven with token ids): for those the GGUF
gets llama.cpp's bundled Llama SentencePiece vocabulary (models/ggml-vocab-llama-spm.gguf, cut to
the model's vocab size), which llama-bench needs only to exist (it decodes random token ids).
Nothing else changes: weights, shapes and hyperparameters are the converter's own.

    python -m bench peers gguf HF_DIR OUT.gguf [--type f16|q4_0] [--llama-cpp DIR]
    python -m bench peers gguf --shape llama-7b --seed 0 OUT.gguf [--type f16|q4_0]

--shape converts bench/models/make_model.py's random weights of that shape and seed without writing the HF
checkpoint first (it would take another 13.5 GB of disk for a 7B shape): the converter runs on a
directory holding only make_model's config.json, and instead of reading safetensors shards it is given
each HF tensor as a lazy tensor that make_model's RandomWeights draws when the converter writes it
(rounded to float16 as `make_model.py --hf` stores it). Everything else is the converter's own; the
tensors equal those converted from the `--hf` checkpoint (tests/test_peers.py).

--type q4_0 converts to F16 first (OUT.f16.gguf, removed afterwards) and quantizes with
llama-quantize (GGUF Q4_0: blocks of 32 weights, one float16 scale each, 4.5 bits per weight).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import ROOT, llama_cpp_dir, module_argv
from bench.models import make_model as mm

DEFAULT_LLAMA_CPP = llama_cpp_dir()
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def _random_tensors(shape: str, seed: int):
    """make_model's HF tensors of `shape`/`seed`: {HF name: (shape, produce float16 numpy)}, and its config."""
    spec = mm.spec_for(shape)
    weights = mm.RandomWeights(spec, "float16", seed)
    from flashllm.format.safetensors_io import storage_bytes

    tensors = {name: (dims, lambda p=produce: storage_bytes(p(), "float16").view("float16"))
               for shard in mm.hf_tensors(spec, weights) for name, dims, produce in shard}
    return tensors, mm.hf_config(spec, "float16")


def _convert_in_process(src: Path, out: Path, llama_src: Path, shape: str | None = None, seed: int = 0) -> None:
    """Run convert_hf_to_gguf.main() with the builtin vocabulary when the checkpoint has no tokenizer
    (and, with `shape`, on make_model's random tensors drawn as the converter writes them)."""
    virtual = _random_tensors(shape, seed)[0] if shape else None
    sys.path.insert(0, str(llama_src))  # _set_vocab_builtin finds models/ through sys.path[0]
    import convert_hf_to_gguf as conv

    if virtual:
        import torch
        from conversion.base import LazyTorchTensor

    if not any((src / name).is_file() for name in TOKENIZER_FILES):
        find = conv.get_model_class

        def get_model_class(name, mmproj=False):
            cls = find(name, mmproj)
            cls.set_vocab = lambda self: self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])
            if virtual:
                def index_tensors(self, remote_hf_model_id=None):
                    def lazy(dims, produce):
                        meta = LazyTorchTensor.meta_with_dtype_and_shape(torch.float16, tuple(dims))
                        return lambda: LazyTorchTensor(meta=meta, args=(), func=lambda: torch.from_numpy(produce()))

                    items = (self.filter_tensors((n, lazy(*virtual[n]))) for n in virtual)
                    return dict(item for item in items if item)

                cls.index_tensors = index_tensors
            return cls

        conv.get_model_class = get_model_class
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outfile", str(out), "--outtype", "f16"] + \
        (["--model-name", f"make_model {shape} seed {seed}"] if shape else [])
    conv.main()


def convert(src: Path | None, out: Path, gguf_type: str = "f16", llama_cpp: Path = DEFAULT_LLAMA_CPP,
            shape: str | None = None, seed: int = 0) -> Path:
    """Write OUT (atomically: a temporary name, then rename) from the checkpoint `src`, or from make_model's
    random weights of `shape` and `seed` (src None)."""
    llama_src = llama_cpp / "src" / "llama.cpp"
    if not (llama_src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{llama_src}: no convert_hf_to_gguf.py: build llama.cpp there with bench/build_llama_cpp.sh, or point --llama-cpp (or $LLAMA_CPP_DIR) at its prefix")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    f16 = tmp if gguf_type == "f16" else out.with_name(f".{out.stem}.f16-{os.getpid()}.gguf")
    config_dir = None
    try:
        if shape:
            config_dir = Path(tempfile.mkdtemp(prefix="gguf-convert-"))
            (config_dir / "config.json").write_text(json.dumps(_random_tensors(shape, seed)[1]))
            src = config_dir
        subprocess.run(module_argv("bench.peers.gguf_convert", "--in-process", src, f16,
                                   *(["--shape", shape, "--seed", seed] if shape else [])), check=True, cwd=ROOT)
        if gguf_type != "f16":
            subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f16), str(tmp), gguf_type.upper()],
                           check=True)
        tmp.rename(out)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"gguf_convert: error: {Path(exc.cmd[1]).name} failed (exit status {exc.returncode})")
    finally:
        for p in {tmp, f16}:
            p.unlink(missing_ok=True)
        if config_dir:
            shutil.rmtree(config_dir)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", help="HF checkpoint directory (or --shape)")
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--shape", default=None, help="instead of SRC: bench/models/make_model.py's random weights of this shape")
    p.add_argument("--seed", type=int, default=0, help="with --shape: make_model's seed (default: %(default)s)")
    p.add_argument("--type", default="f16", choices=["f16", "q4_0", "q8_0"], help="(default: %(default)s)")
    p.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP,
                   help="bench/build_llama_cpp.sh's prefix (default: $LLAMA_CPP_DIR, else %(default)s)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_process:
        return _convert_in_process(Path(args.src), Path(args.out), args.llama_cpp / "src" / "llama.cpp", args.shape,
                                   args.seed)
    if (args.src is None) == (args.shape is None):
        raise SystemExit("gguf_convert: error: give either an HF checkpoint directory or --shape")
    if args.shape and args.shape not in mm.SHAPES:
        raise SystemExit(f"gguf_convert: error: --shape {args.shape}: choose from {', '.join(sorted(mm.SHAPES))}")
    out = convert(Path(args.src) if args.src else None, Path(args.out), args.type, args.llama_cpp, args.shape,
                  args.seed)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB ({args.type})")


if __name__ == "__main__":
    main()
