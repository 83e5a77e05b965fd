"""An HF checkpoint to GGUF with llama.cpp's own converter (convert_hf_to_gguf.py), for bench/peers.py.

The converter, its `gguf` package (gguf-py, vendored beside it: the PyPI release of the same
version number, 0.19.0, lacks what this converter uses) and llama-quantize all come from the
llama.cpp that bench/build_llama_cpp.sh builds from the llama-cpp-python sdist. Checkpoints written by
bench/make_model.py --hf have no tokenizer (they are driven with token ids): for those the GGUF
gets llama.cpp's bundled Llama SentencePiece vocabulary (models/ggml-vocab-llama-spm.gguf, cut to
the model's vocab size), which llama-bench needs only to exist (it decodes random token ids).
Nothing else changes: weights, shapes and hyperparameters are the converter's own.

    python bench/gguf_convert.py HF_DIR OUT.gguf [--type f16|q4_0] [--llama-cpp /work/big/llama.cpp-build]

--type q4_0 converts to F16 first (OUT.f16.gguf, removed afterwards) and quantizes with
llama-quantize (GGUF Q4_0: blocks of 32 weights, one float16 scale each, 4.5 bits per weight).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "/work/big/llama.cpp-build"))
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def _convert_in_process(src: Path, out: Path, llama_src: Path) -> None:
    """Run convert_hf_to_gguf.main() with the builtin vocabulary when the checkpoint has no tokenizer."""
    sys.path.insert(0, str(llama_src))  # _set_vocab_builtin finds models/ through sys.path[0]
    import convert_hf_to_gguf as conv

    if not any((src / name).is_file() for name in TOKENIZER_FILES):
        find = conv.get_model_class

        def get_model_class(name, mmproj=False):
            cls = find(name, mmproj)
            cls.set_vocab = lambda self: self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])
            return cls

        conv.get_model_class = get_model_class
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outfile", str(out), "--outtype", "f16"]
    conv.main()


def convert(src: Path, out: Path, gguf_type: str = "f16", llama_cpp: Path = DEFAULT_LLAMA_CPP) -> Path:
    """Write OUT (atomically: a temporary name, then rename)."""
    llama_src = llama_cpp / "src" / "llama.cpp"
    if not (llama_src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{llama_src}: no convert_hf_to_gguf.py (run bench/build_llama_cpp.sh first)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    f16 = tmp if gguf_type == "f16" else out.with_name(f".{out.stem}.f16-{os.getpid()}.gguf")
    try:
        subprocess.run([sys.executable, __file__, "--in-process", str(src), str(f16)], check=True)
        if gguf_type != "f16":
            subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f16), str(tmp), gguf_type.upper()],
                           check=True)
        tmp.rename(out)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"gguf_convert: error: {Path(exc.cmd[1]).name} failed (exit status {exc.returncode})")
    finally:
        for p in {tmp, f16}:
            p.unlink(missing_ok=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory")
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--type", default="f16", choices=["f16", "q4_0", "q8_0"], help="(default: %(default)s)")
    p.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP,
                   help="bench/build_llama_cpp.sh's prefix (default: %(default)s, or $LLAMA_CPP_DIR)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_process:
        return _convert_in_process(Path(args.src), Path(args.out), args.llama_cpp / "src" / "llama.cpp")
    out = convert(Path(args.src), Path(args.out), args.type, args.llama_cpp)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB ({args.type})")


if __name__ == "__main__":
    main()
