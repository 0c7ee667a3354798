#!/usr/bin/env bash
# One Qwen3.5-35B-A3B-shaped MoE layer on two GPUs of one host (EP=2): every GPU test, then the
# layer at 4K..64K local tokens, chunks 1 (no chunks) to 8 by expert range (the default), both
# all-to-all transports, critical-rank traces at 16K; then token-range chunks on NCCL.
# STAGE=variants measures comm-stream priority 0 vs -1 and CUDA_DEVICE_MAX_CONNECTIONS=1 instead.
# Writes results/h200x2/moe_layer{,_chunk_by_tokens,_priority,_maxconn1}.{json,md} and traces/
# (OUT= elsewhere); logs go to LOGS (default bench-out/).
set -uo pipefail
OUT=${OUT:-results/h200x2}
LOGS=${LOGS:-bench-out}
STAGE=${STAGE:-main}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
quiet() { grep -v "^USDT\|profiler_st\|Warning\|_warn_once\|warnings.warn\|return func"; }
if [ "$STAGE" = main ]; then
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  [ "${SKIP_TESTS:-0}" = 1 ] || timeout 200 python3 -m pytest -q -rfEs --tb=short \
      -m "needs_cuda or needs_multi_gpu" tests/ > "$LOGS/gpu_tests.txt" 2>&1
  tail -3 "$LOGS/gpu_tests.txt" 2>/dev/null
  timeout 300 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 4096,8192,16384,32768,65536 --chunks 1,2,4,8 \
      --transports process_group,symmetric_memory --trace-tokens 16384 --trace-chunks 1,4 \
      --trace-dir "$OUT/traces" --out "$OUT/moe_layer.json" 2>&1 | quiet | tail -30
  timeout 200 python3 -m longmoe bench moe-layer --nproc 2 --chunk-by tokens \
      --tokens 4096,16384,65536 --chunks 1,2,4,8 --transports process_group \
      --out "$OUT/moe_layer_chunk_by_tokens.json" 2>&1 | grep "^| process"
else
  timeout 200 python3 -m longmoe bench moe-layer --nproc 2 --tokens 32768,65536 --chunks 1,2,4,8 \
      --transports process_group,symmetric_memory --priorities 0,-1 \
      --out "$OUT/moe_layer_priority.json" 2>&1 | quiet | tail -12
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 32768,65536 --chunks 1,2,4,8 --transports process_group,symmetric_memory \
      --out "$OUT/moe_layer_maxconn1.json" 2>&1 | quiet | tail -8
fi
