#!/usr/bin/env bash
# The paper's Table 3 (naive / hybrid / all per token) on a GPU at a smaller shape than 7B: a random-weight
# model from bench/models/make_model.py, sparsity replayed from an activation trace of the embedded model, the GPU
# budget and the host DRAM budget both at BUDGET (default 0.6: opt-1.3b's resident part is 39% of it, so at
# 0.5 the caches drop neurons). Results in $OUT (or $TMPDIR/gpu_table3); the model is deleted afterwards.
#
#     SHAPE=opt-1.3b DEVICE=cuda BUDGET=0.6 bash bench/gpu_table3.sh
set -euo pipefail
out=${OUT:-${TMPDIR:-/tmp}/gpu_table3}; work=${WORK:-${TMPDIR:-/tmp}/gpu_table3_work}
shape=${SHAPE:-opt-1.3b}; device=${DEVICE:-cuda}; tokens=${TOKENS:-16}; budget=${BUDGET:-0.6}
mkdir -p "$out" "$work"
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
python3 -m bench --no-record models make --shape "$shape" --dtype float16 --seed 0 --out "$work/model" --quiet
python3 -m bench --no-record models corpus --split heldout --out "$work/heldout.txt" --max-bytes 400000
python3 -m bench --no-record models trace record flashllm/data/tiny-opt --data "$work/heldout.txt" --out "$work/trace.npz" \
    --tokens $((tokens * 4)) --predictor auto
gpu=$([ "$device" = cpu ] && echo "" || echo "--gpu-budget $budget")
python3 -m bench --no-record paper tables "$work/model" --device "$device" $gpu --dram-budget "$budget" --trace "$work/trace.npz" \
    --only naive,hybrid,all --tokens "$tokens" --warmup 4 --naive-tokens 2 --hybrid-tokens 2 --fig7-windows 4 \
    --fig8-tokens 0 --json-out "$out/table3_$device.json" --markdown "$out/table3_$device.md" \
    --command "SHAPE=$shape DEVICE=$device BUDGET=$budget TOKENS=$tokens bash bench/gpu_table3.sh"
