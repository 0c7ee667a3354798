#!/usr/bin/env bash
# Two H200s (EP=2), the first run there since session 7: the session-8 row kernels and host fixes,
# the session-9 weight-gradient schedule and memory cuts, the session-10 router GEMM.
# Each PART fits one device call of < 10 minutes; most needed first.
# PART=1: the multi-GPU tests; the MoE-layer sweep (16K-64K, C = 1, 2, 4, 8, both transports,
#         megatron-core's dispatcher beside it, traces at 16K); the cost model refitted to it.
# PART=2: `longmoe tune chunks` on the pair; the hybrid preset's last path stage at 64K and 32K
#         with that cache; one 128K sequence over both GPUs (CP 2 x EP 2).
# PART=3: the weight-gradient schedules at EP=2 (session 9): inside each chunk's step (auto, the
#         default) against delayed to the end of the layer, A/B/A, 32K and 64K, both transports.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${PART:-1}" = 1 ]; then
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  timeout 170 python3 -m pytest -q -rfEs --tb=short -m needs_multi_gpu tests/ > "$OUT/tests_multi.txt" 2>&1
  tail -4 "$OUT/tests_multi.txt"
  timeout 280 python3 -m longmoe bench moe-layer --nproc 2 --tokens 16384,32768,65536 \
      --chunks 1,2,4,8 --transports process_group,symmetric_memory --baseline megatron \
      --trace-tokens 16384 --trace-chunks 1,4 --trace-dir "$OUT/traces" \
      --out "$OUT/moe_layer_h200x2.json" 2>&1 | grep "^|" | tail -8
  tar -C "$OUT" -czf "$OUT/moe_layer_traces.tar.gz" traces && rm -rf "$OUT/traces"
  python3 -m longmoe tune calibrate --from "$OUT/moe_layer_h200x2.json" --hardware h200 \
      --out "$OUT/calibration.json" 2>&1 | tail -8
elif [ "${PART}" = 3 ]; then
  n=0
  for w in delayed auto delayed; do
    n=$((n + 1))
    timeout 170 python3 -m longmoe bench moe-layer --nproc 2 --tokens 32768,65536 \
        --chunks 1,2,4,8 --transports process_group,symmetric_memory --wgrad $w \
        --out "$OUT/moe_layer_h200x2_wgrad_${w}_$n.json" 2>&1 | grep "^|" | tail -4
  done
else
  timeout 200 python3 -m longmoe tune chunks --ep 2 --seq-lens 16384,32768,65536 --chunks 1,2,4,8 \
      --out "$OUT/tune" 2>&1 | grep -v Warning | tail -6
  export LONGMOE_TUNING_DIR=$OUT/tune
  OUT=$OUT NPROC=2 TOKENS=65536,32768 RUN_TIMEOUT=200 TAG=_tuned STAGES="+chunked EP" \
      timeout 210 bash bench/h200_train_path.sh
  OUT=$OUT NPROC=2 TOKENS=131072 RUN_TIMEOUT=150 TAG=_128k_cp2 STAGES="+chunked EP" \
      EXTRA="--set parallel.cp=2" timeout 155 bash bench/h200_train_path.sh
  tar -C "$OUT" -czf "$OUT/tune.tar.gz" tune && rm -rf "$OUT/tune"
fi
