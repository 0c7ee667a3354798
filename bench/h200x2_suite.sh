#!/usr/bin/env bash
# Everything measured on two H200s (EP=2), results under results/h200x2/ (OUT= elsewhere); each
# PART fits one 10-minute call, most needed first.
# PART=1: the multi-GPU tests (gpu_tests_multi.txt); the MoE-layer sweep (16K-64K, C = 1, 2, 4, 8,
#         both transports, megatron-core's dispatcher beside it, traces at 16K; moe_layer.json);
#         the chunk cost model refitted to it (LOGS/calibration.json: compare before replacing
#         tuning/calibration.json).
# PART=2: `longmoe tune chunks` on the pair (tune_chunks.json); the last path stage at 64K and 32K
#         reading that cache, recompute [full, full, none, none] and selective; one 128K sequence
#         over both GPUs (CP 2 x EP 2).
# PART=3: the weight-gradient schedules at EP=2: inside each chunk's step (auto, the default)
#         against delayed to the end of the layer, 32K and 64K, both transports.
set -uo pipefail
OUT=${OUT:-results/h200x2}
LOGS=${LOGS:-bench-out}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
path() { NPROC=2 OUT=$OUT STAGES="+chunked EP" bash bench/h200_train_path.sh; }
case "${PART:-1}" in
  1)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    timeout 170 python3 -m pytest -q -rfEs --tb=short -m needs_multi_gpu tests/ > "$OUT/gpu_tests_multi.txt" 2>&1
    tail -2 "$OUT/gpu_tests_multi.txt"
    timeout 280 python3 -m longmoe bench moe-layer --nproc 2 --tokens 16384,32768,65536 \
        --chunks 1,2,4,8 --transports process_group,symmetric_memory --baseline megatron \
        --trace-tokens 16384 --trace-chunks 1,4 --trace-dir "$OUT/traces" \
        --out "$OUT/moe_layer.json" 2>&1 | grep "^|" | tail -8
    python3 -m longmoe tune calibrate --from "$OUT/moe_layer.json" --hardware h200 \
        --out "$LOGS/calibration.json" 2>&1 | tail -8 ;;
  2)
    timeout 200 python3 -m longmoe tune chunks --ep 2 --seq-lens 16384,32768,65536 --chunks 1,2,4,8 \
        --out "$LOGS/tune" 2>&1 | grep -v Warning | tail -6
    cp "$LOGS"/tune/sweep_*.json "$OUT/tune_chunks.json" && cp "$LOGS"/tune/chunks_*.png "$OUT/tune_chunks.png"
    python3 bench/render_tables.py "$OUT/tune_chunks.json"
    export LONGMOE_TUNING_DIR=$LOGS/tune
    for T in 65536 32768; do
      TOKENS=$T RUN_TIMEOUT=120 TAG=_$((T / 1024))k_tuned_rc_full-full-none-none \
          EXTRA="--set parallel.recompute=[full,full,none,none]" path
    done
    TOKENS=65536 RUN_TIMEOUT=100 TAG=_64k_tuned_selective EXTRA="--set parallel.recompute=selective" \
        path
    TOKENS=131072 RUN_TIMEOUT=150 TAG=_128k_cp2 EXTRA="--set parallel.cp=2" path ;;
  3)
    for w in auto delayed; do
      timeout 170 python3 -m longmoe bench moe-layer --nproc 2 --tokens 32768,65536 \
          --chunks 1,2,4,8 --transports process_group,symmetric_memory --wgrad $w \
          --out "$OUT/moe_layer_wgrad_$w.json" 2>&1 | grep "^|" | tail -4
    done ;;
esac
