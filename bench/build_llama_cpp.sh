#!/usr/bin/env bash
# Build llama.cpp's CPU tools (llama-bench, llama-quantize, llama-simple, llama-completion) from the
# llama-cpp-python sdist on PyPI, which vendors llama.cpp: a registry-only, reproducible source.
# Usage: bench/build_llama_cpp.sh [PREFIX]   (default $LLAMA_CPP_DIR, else flashllm's cache/llama.cpp, where
# `python -m bench peers` looks; JOBS=2 by default)
# Leaves PREFIX/bin/* (the tools), PREFIX/src/llama.cpp (convert_hf_to_gguf.py, gguf-py) and
# PREFIX/VERSION (sdist version + the llama.cpp commit its CHANGELOG names).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # vendors ggml-org/llama.cpp@0c1e57098
CACHE="${FLASHLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flashllm}"
PREFIX="${1:-${LLAMA_CPP_DIR:-$CACHE/llama.cpp}}"
JOBS="${JOBS:-2}"
TOOLS=(llama-bench llama-quantize llama-simple llama-completion)

mkdir -p "$PREFIX/download"
if [ ! -d "$PREFIX/src/llama.cpp" ]; then
    pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$PREFIX/download"
    tmp="$(mktemp -d "$PREFIX/extract.XXXXXX")"
    tar xzf "$PREFIX/download/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
    mkdir -p "$PREFIX/src"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$PREFIX/src/llama.cpp"
    cp "$tmp/llama_cpp_python-$VERSION/CHANGELOG.md" "$PREFIX/src/llama-cpp-python-CHANGELOG.md"
    rm -rf "$tmp"
fi
# The sdist has no .git; its CHANGELOG names the vendored commit ("update llama.cpp to ggml-org/llama.cpp@SHA").
COMMIT="$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$PREFIX/src/llama-cpp-python-CHANGELOG.md" | cut -d@ -f2)"

# GGML_NATIVE: tuned for this CPU (the fair setting for a peer); no server/curl/tests; static so the
# binaries do not depend on the build tree's shared libraries.
cmake -S "$PREFIX/src/llama.cpp" -B "$PREFIX/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT" -DLLAMA_BUILD_NUMBER=0
cmake --build "$PREFIX/build" -j "$JOBS" --target "${TOOLS[@]}"
mkdir -p "$PREFIX/bin"
for tool in "${TOOLS[@]}"; do cp "$PREFIX/build/bin/$tool" "$PREFIX/bin/"; done
printf 'llama-cpp-python %s\nllama.cpp %s\n' "$VERSION" "$COMMIT" > "$PREFIX/VERSION"
cat "$PREFIX/VERSION"
