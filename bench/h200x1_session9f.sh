#!/usr/bin/env bash
# One H200, session 9, last call: the router's top-k as a Triton kernel. GPU tests of the row
# kernels (top-k included), the row ops with four top-k tiles, and the layer A/B/A with only
# the top-k switched.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 60 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_moe_rows.py \
    > "$OUT/tests.txt" 2>&1
tail -1 "$OUT/tests.txt"
timeout 80 python3 bench/router_topk_ab.py --tokens 16384,65536 --out "$OUT/router_topk_ab.json" \
    2>&1 | grep '^{'
timeout 70 python3 -m longmoe bench moe-rows --tokens 16384,65536 --iters 10 --configs \
    '[{"BLOCK_T_TOPK": 16, "num_warps_topk": 4}, {"BLOCK_T_TOPK": 8, "num_warps_topk": 4}, {"BLOCK_T_TOPK": 32, "num_warps_topk": 8}, {"BLOCK_T_TOPK": 4, "num_warps_topk": 2}]' \
    --out "$OUT/moe_rows_topk.json" 2>&1 | grep "router_topk"
