#!/usr/bin/env bash
# The MoE-layer benchmark on two GPUs of one host (EP=2), as run on 2xH200 (device tool):
# every GPU-marked test, then one Qwen3.5-35B-A3B-shaped MoE layer at 4K..64K local
# tokens, chunks 1 (baseline) to 8 by expert range (the default), both all-to-all transports,
# with profiler traces at 16K; then token-range chunks on NCCL for comparison.
# STAGE=variants instead measures comm-stream priority 0 vs -1 and CUDA_DEVICE_MAX_CONNECTIONS=1.
set -uo pipefail
OUT=${OUT:-bench-out}
STAGE=${STAGE:-main}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$STAGE" = main ]; then
  nvidia-smi topo -m > "$OUT/log.txt" 2>&1
  [ "${SKIP_TESTS:-0}" = 1 ] || timeout 200 python3 -m pytest -q -rfEs --tb=short -m "needs_cuda or needs_multi_gpu" tests/ \
      > "$OUT/tests.txt" 2>&1; tail -12 "$OUT/tests.txt" | tee -a "$OUT/log.txt"
  timeout 300 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 4096,8192,16384,32768,65536 --chunks 1,2,4,8 \
      --transports process_group,symmetric_memory --trace-tokens 16384 --trace-chunks 1,4 \
      --trace-dir "$OUT/traces" --out "$OUT/moe_layer_h200x2.json" 2>&1 \
      | grep -v "^USDT\|profiler_st\|Warning\|_warn_once\|warnings.warn\|return func" \
      | tail -30 | tee -a "$OUT/log.txt"
  # The same sweep with token-range chunks (the default chunks by expert range), NCCL only.
  timeout 200 python3 -m longmoe bench moe-layer --nproc 2 --chunk-by tokens \
      --tokens 4096,16384,65536 --chunks 1,2,4,8 --transports process_group \
      --out "$OUT/moe_layer_h200x2_tokens.json" 2>&1 | grep "^| process" | tee -a "$OUT/log.txt"
  # One archive of the critical rank's traces (the device tool returns at most 8 files).
  tar -C "$OUT" -cf "$OUT/moe_layer_traces.tar" traces && rm -rf "$OUT/traces"
else
  timeout 200 python3 -m longmoe bench moe-layer --nproc 2 --tokens 32768,65536 --chunks 1,4,8,16 \
      --transports process_group,symmetric_memory --priorities 0,-1 \
      --out "$OUT/moe_layer_h200x2_priority.json" 2>&1 | tail -12 | tee -a "$OUT/log.txt"
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 python3 -m longmoe bench moe-layer --nproc 2 \
      --tokens 32768,65536 --chunks 1,4,8,16 --transports process_group,symmetric_memory \
      --out "$OUT/moe_layer_h200x2_maxconn1.json" 2>&1 | tail -8 | tee -a "$OUT/log.txt"
fi
