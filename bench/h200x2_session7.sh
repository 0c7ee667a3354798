#!/usr/bin/env bash
# Two H200s (EP=2), session 7, split into device calls of < 10 minutes.
# PART=1: the multi-GPU tests, then issue D item 8 / I item 6 at 64K per GPU (the path, then the
#         last stage with recompute [full,full,none,none]).
# PART=2: the MoE-layer sweep (bench/h200x2_moe_layer.sh, both chunk kinds), then the path at 32K.
# PART=3: `longmoe tune chunks` on the expert-chunk pipeline; the last stage with that cache.
# PART=4: the megatron-core baseline, the all-attention layout on two GPUs, every GPU test.
# PART=5: 2-GPU equivalence tests, the EP=2 megatron baseline, 128K with CP 2 x EP 2.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${PART:-1}" = 1 ]; then
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  timeout 120 python3 -m pytest -q -rfEs --tb=short -m needs_multi_gpu tests/ > "$OUT/tests.txt" 2>&1
  tail -6 "$OUT/tests.txt"
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=150 TAG=_64k timeout 330 bash bench/h200_train_path.sh
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=120 TAG=_64k_rc_full-full-none-none STAGES="+chunked EP" \
      EXTRA="--set parallel.recompute=[full,full,none,none]" timeout 125 bash bench/h200_train_path.sh
elif [ "${PART}" = 3 ]; then
  # The tuner on the current pipeline (expert chunks), then the last path stage with its cache.
  timeout 200 python3 -m longmoe tune chunks --ep 2 --seq-lens 16384,32768,65536 --chunks 1,2,4,8 \
      --out "$OUT/tune" 2>&1 | grep -v Warning | tail -6
  export LONGMOE_TUNING_DIR=$OUT/tune
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=120 TAG=_64k_tuned_rc_full-full-none-none STAGES="+chunked EP" \
      EXTRA="--set parallel.recompute=[full,full,none,none]" timeout 125 bash bench/h200_train_path.sh
  OUT=$OUT NPROC=2 TOKENS=32768 RUN_TIMEOUT=100 TAG=_32k_tuned_rc_full-full-none-none STAGES="+chunked EP" \
      EXTRA="--set parallel.recompute=[full,full,none,none]" timeout 105 bash bench/h200_train_path.sh
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=100 TAG=_64k_tuned_selective STAGES="+chunked EP" \
      EXTRA="--set parallel.recompute=selective" timeout 105 bash bench/h200_train_path.sh
  tar -C "$OUT" -czf "$OUT/tune.tar.gz" tune && rm -rf "$OUT/tune"
elif [ "${PART}" = 5 ]; then
  # The short form for a nearly spent device budget, most needed first: the 2-GPU equivalence
  # tests (CP 2 x EP 2 on the hybrid layout among them), one 128K sequence over both GPUs with
  # CP 2 x EP 2 (64K tokens per GPU), the EP=2 megatron baseline, the all-attention layout.
  timeout 150 python3 -m pytest -q -rfEs --tb=short -m needs_multi_gpu tests/test_equivalence.py \
      > "$OUT/tests_multi.txt" 2>&1; tail -4 "$OUT/tests_multi.txt"
  OUT=$OUT NPROC=2 TOKENS=131072 RUN_TIMEOUT=150 TAG=_128k_cp2 STAGES="+chunked EP" \
      EXTRA="--set parallel.cp=2" timeout 155 bash bench/h200_train_path.sh
  timeout 100 python3 -m longmoe bench moe-layer --nproc 2 --tokens 16384,65536 --chunks 1,2 \
      --transports process_group,symmetric_memory --baseline megatron \
      --out "$OUT/moe_layer_h200x2_megatron.json" 2>&1 | grep "^|"
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=110 TAG=_64k_full_attention TYPES=full STAGES="+chunked EP" \
      timeout 115 bash bench/h200_train_path.sh
elif [ "${PART}" = 4 ]; then
  # megatron-core's all-to-all dispatcher as the paired baseline (carry its cp312 wheel), the
  # all-attention layout's last path stage, then every GPU test.
  timeout 150 python3 -m longmoe bench moe-layer --nproc 2 --tokens 4096,16384,65536 --chunks 1,2,8 \
      --transports process_group,symmetric_memory --baseline megatron \
      --out "$OUT/moe_layer_h200x2_megatron.json" 2>&1 | grep -v Warn | tail -9
  OUT=$OUT NPROC=2 TOKENS=65536 RUN_TIMEOUT=110 TAG=_64k_full_attention TYPES=full STAGES="+chunked EP" \
      timeout 115 bash bench/h200_train_path.sh
  timeout 230 python3 -m pytest -q -rfEs --tb=short -m "needs_cuda or needs_multi_gpu" tests/ \
      > "$OUT/gpu_tests.txt" 2>&1; tail -8 "$OUT/gpu_tests.txt"
else
  SKIP_TESTS=1 OUT=$OUT timeout 330 bash bench/h200x2_moe_layer.sh
  OUT=$OUT NPROC=2 TOKENS=32768 RUN_TIMEOUT=100 TAG=_32k timeout 230 bash bench/h200_train_path.sh
fi
