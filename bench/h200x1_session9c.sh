#!/usr/bin/env bash
# One H200, session 9, third call: GPU tests (the pipeline on one GPU with both weight-gradient
# schedules), then the layer with the router's fp32 GEMMs at "highest" (what the bench ran
# before session 9) against "high" (TF32, what the trainer runs), the latter beside
# megatron-core's dispatcher.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 150 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_moe_pipeline.py \
    tests/test_moe_rows.py tests/test_expert_parallel.py tests/test_grouped_mm.py \
    > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
for p in highest high; do
    extra=""
    [ $p = high ] && extra="--baseline megatron"
    timeout 150 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,32768,65536 \
        --chunks 1,4 --transports process_group --fp32-matmul $p $extra \
        --out "$OUT/moe_layer_1rank_fp32_$p.json" 2>&1 | grep "^|" | tail -3
done
