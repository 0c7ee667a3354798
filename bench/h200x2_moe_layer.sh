#!/usr/bin/env bash
# The MoE-layer benchmark on two GPUs of one host (EP=2), as run on 2xH200 (device tool):
# the GPU tests of the pipeline, then one Qwen3.5-35B-A3B-shaped MoE layer at 4K..64K local
# tokens, chunks 1 (baseline) to 16, both all-to-all transports, with profiler traces at 16K.
# STAGE=variants instead measures comm-stream priority 0 vs -1 and CUDA_DEVICE_MAX_CONNECTIONS=1.
set -uo pipefail
OUT=${OUT:-bench-out}
STAGE=${STAGE:-main}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$STAGE" = main ]; then
  timeout 240 python3 -m pytest -q -x tests/test_moe_pipeline.py tests/test_expert_parallel.py \
      tests/test_grouped_mm.py -k "gpu or cuda" 2>&1 | tail -6 | tee "$OUT/log.txt"
  timeout 300 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 4096,8192,16384,32768,65536 --chunks 1,2,4,8,16 \
      --transports process_group,symmetric_memory --trace-tokens 16384 --trace-chunks 1,8 \
      --trace-dir "$OUT" --out "$OUT/moe_layer_h200x2.json" 2>&1 | grep -v "^USDT\|profiler_st" \
      | tail -30 | tee -a "$OUT/log.txt"
else
  timeout 200 python3 -m longmoe bench moe-layer --nproc 2 --tokens 32768,65536 --chunks 1,4,8,16 \
      --transports process_group,symmetric_memory --priorities 0,-1 \
      --out "$OUT/moe_layer_h200x2_priority.json" 2>&1 | tail -12 | tee "$OUT/log.txt"
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 32768,65536 --chunks 1,4,8,16 --transports process_group,symmetric_memory \
      --out "$OUT/moe_layer_h200x2_maxconn1.json" 2>&1 | tail -8 | tee -a "$OUT/log.txt"
fi
