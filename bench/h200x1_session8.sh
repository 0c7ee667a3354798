#!/usr/bin/env bash
# One H200, session 8: the MoE row kernels (ops/kernels/moe_rows.py).
# PART=1: their GPU tests; the ops alone, eager vs Triton over tile configs; the MoE layer on one
#         rank with the eager row ops and with the kernels, A/B/A in one call.
# PART=2: the hybrid preset's last training stage at 64K with each, A/B/A.
set -uo pipefail
n=0
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ "${PART:-1}" = 1 ]; then
  [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -rfEs --tb=short tests/test_moe_rows.py tests/test_moe_pipeline.py \
      tests/test_grouped_mm.py -m needs_cuda > "$OUT/tests.txt" 2>&1
  tail -3 "$OUT/tests.txt"
  CFGS='[{}, {"BLOCK_H": 512, "num_warps": 4}, {"BLOCK_H": 2048, "num_warps": 8},
         {"BLOCK_H_ROW": 1024, "num_warps_row": 4}, {"BLOCK_M": 4, "BLOCK_F": 512},
         {"BLOCK_M": 16, "BLOCK_F": 128}, {"BLOCK_M": 8, "BLOCK_F": 128, "num_warps_swiglu": 4}]'
  [ -n "${SKIP_OPS:-}" ] || timeout 120 python3 -m longmoe bench moe-rows --tokens 16384,65536 --configs "$CFGS" \
      --out "$OUT/moe_rows_ops.json" 2>&1 | grep "^|" | grep -v "| triton | BLOCK" | tail -12
  for r in torch triton torch; do
    n=$((n + 1))  # not inside the pipeline below: that runs in a subshell
    timeout 150 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,32768,65536 --chunks 1,4 \
        --transports process_group --rows-impl $r --out "$OUT/moe_layer_1rank_rows_${r}_$n.json" \
        2>&1 | grep "^|" | tail -3
  done
else
  for r in torch auto torch; do
    n=$((n + 1))
    OUT=$OUT TOKENS=65536 STAGES="+chunked EP" RUN_TIMEOUT=150 TAG=_64k_rows_${r}_$n \
        EXTRA="--set impl.moe_rows=$r" timeout 160 bash bench/h200_train_path.sh
  done
fi
