#!/usr/bin/env bash
# Issue D item 8 on the GPUs at hand (1 or 2 H200s): the Qwen3.5-35B-A3B preset scaled in layers,
# 32K and 64K tokens per GPU, the seeds' optimisation path stage by stage. NPROC=2 uses EP=2.
# Carry fla wheels (.whl/) for the Gated DeltaNet fast path; without them the chunked core runs.
set -uo pipefail
OUT=${OUT:-bench-out}
NPROC=${NPROC:-1}
LAYERS=${LAYERS:-4}
# The published hybrid pattern for 4 layers (3 Gated DeltaNet, then full attention);
# PROFILE: a dir for step-3 op tables and traces. EXTRA: more "--set k=v" for every stage; STAGES: a comma list of stage names.
# TYPES=full for the all-attention numbers of earlier sessions.
TYPES=${TYPES:-[linear_attention,linear_attention,linear_attention,full_attention]}
[ "$TYPES" = full ] && TYPES="[$(yes full_attention | head -n "$LAYERS" | paste -sd,)]"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m longmoe bench train-path --config gpu_smoke --nproc "$NPROC" --tokens "${TOKENS:-32768,65536}" \
    --steps 6 --set model.num_layers="$LAYERS" --set "model.layer_types=$TYPES" \
    --set parallel.ep="$NPROC" ${EXTRA:-} ${STAGES:+--stages "$STAGES"} ${PROFILE:+--profile "$PROFILE"} \
    --set data.prompt_len=1024 --set train.nproc="$NPROC" --timeout "${RUN_TIMEOUT:-540}" \
    --out "$OUT/train_path_h200x${NPROC}${TAG:-}.json" 2>&1 | tail -14 | tee -a "$OUT/log.txt"
