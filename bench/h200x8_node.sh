#!/usr/bin/env bash
# One node of 4 or 8 GPUs (NPROC): the MoE-layer sweep at EP=NPROC, the chunk tuner, and the
# single-node training layout at 16K and 32K tokens per GPU with CP = 1, 2 and 4. STAGE=moe|tune|train
# picks one part (each fits a 10-minute call). Writes under results/h200x$NPROC/ (OUT= elsewhere).
set -uo pipefail
NPROC=${NPROC:-8}
OUT=${OUT:-results/h200x$NPROC}
LOGS=${LOGS:-bench-out}
STAGE=${STAGE:-moe}
LAYERS=${LAYERS:-4}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "$STAGE" in
  moe)
    timeout 540 python3 -m longmoe bench moe-layer --nproc "$NPROC" \
        --tokens 4096,8192,16384,32768,65536 --chunks 1,2,4,8,16 \
        --transports process_group,symmetric_memory --trace-tokens 16384 --trace-chunks 1,8 \
        --trace-dir "$OUT/traces" --out "$OUT/moe_layer.json" 2>&1 | tail -14 ;;
  tune)
    timeout 540 python3 -m longmoe tune chunks --ep "$NPROC" --seq-lens 8192,16384,32768,65536 \
        --out "$LOGS/tune" 2>&1 | tail -12
    cp "$LOGS"/tune/sweep_*.json "$OUT/tune_chunks.json" && python3 bench/render_tables.py "$OUT/tune_chunks.json" ;;
  train)
    for CP in 1 2 4; do
      for T in 16384 32768; do
        S=$((T * CP))  # sequence length: CP ranks share one sequence, T tokens each
        timeout 170 python3 -m longmoe train --config gpu_smoke --nproc "$NPROC" --steps 5 \
            --set model.num_layers="$LAYERS" \
            --set "model.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]" \
            --set parallel.ep="$NPROC" --set parallel.cp="$CP" --set parallel.chunks=auto \
            --set data.seq_len="$S" --set data.batch_size=$((NPROC / CP)) --set data.prompt_len=1024 \
            --set train.nproc="$NPROC" \
            --metrics-out "$OUT/train_cp${CP}_t${T}.jsonl" 2>&1 | tail -3 | tee -a "$LOGS/train.log"
      done
    done ;;
esac
