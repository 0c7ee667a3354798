#!/usr/bin/env bash
# One H200, session 9, last call: per-phase memory with the router keeping its bf16 input
# (RouterLogits), then the router's fp32 GEMMs at "highest" against "high" (TF32, the trainer's
# default) A/B/A in one call.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 120 python3 bench/pipeline_memory.py --tokens 65536 --chunks 1,4,8 --wgrad auto \
    --out "$OUT/pipeline_memory_router.json" 2>&1 | grep '^{' | cut -c1-200
n=0
for p in highest high highest; do
    n=$((n + 1))
    timeout 120 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,65536 \
        --chunks 1,4 --transports process_group --fp32-matmul $p \
        --out "$OUT/moe_layer_1rank_fp32_${p}_$n.json" 2>&1 | grep "^|" | tail -2
done
