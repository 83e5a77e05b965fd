#!/usr/bin/env bash
# The CUDA checks, as one script for a GPU machine whose image already holds torch and transformers:
# install flashllm without its dependencies, run tests/test_cuda.py, then the embedded model through the
# CLI on the GPU and on the CPU (same prompt, greedy). Logs go to $OUT (or $TMPDIR/cuda_check).
#
#     bash bench/cuda_check.sh
set -uo pipefail
out=${OUT:-${TMPDIR:-/tmp}/cuda_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FLASHLLM_CACHE=${FLASHLLM_CACHE:-${TMPDIR:-/tmp}/flashllm-cache}
nvidia-smi -L
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { tail -5 "$out/pip.log"; exit 1; }
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" | tail -40
model=$(python3 -c "from flashllm.cli.demo import prepare; print(prepare())")
for dev in cuda cpu; do
    echo "== flashllm generate --device $dev (sparse, trained predictors, 50% budget, bfloat16)"
    budget=$([ "$dev" = cuda ] && echo "--gpu-budget 50% --dram-budget 50%" || echo "--dram-budget 50%")
    flashllm generate "$model" --prompt "def main():" --device "$dev" --mode sparse $budget --dtype bfloat16 \
        --context 256 --max-new-tokens 48 --json >"$out/generate_$dev.json" 2>"$out/generate_$dev.err"
    echo "rc=$?"; tail -3 "$out/generate_$dev.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); s=r.get('stats', {}); print(repr(r['text'][:120])); print({k: s.get(k) for k in ('tokens_per_s', 'total_ms', 'io_ms', 'mem_ms', 'compute_ms', 'predictor_ms', 'bytes_read', 'gpu_bytes', 'dram_bytes', 'neurons_dropped', 'kernels')})" "$out/generate_$dev.json"
done
