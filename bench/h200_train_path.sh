#!/usr/bin/env bash
# `longmoe bench train-path` on one or two H200s: the Qwen3.5-35B-A3B preset cut to LAYERS layers
# in the published hybrid pattern, one sequence of 32K and 64K tokens per GPU, the optimisation
# path stage by stage (baseline -> +linear CE -> +FSDP2 -> +chunked EP with full recompute).
# NPROC=2 runs EP=2 with FSDP2 over both GPUs. Writes results/h200/train_path${TAG}.json
# (NPROC=2: results/h200x2/) and its .md.
# STAGES: a comma list of stage names ("+chunked EP" alone: the last stage); EXTRA: more
# "--set k=v" for every stage; PROFILE: a dir for step-3 op tables and traces; TYPES=full for the
# all-attention layout. Without flash-linear-attention the compiled chunked core runs.
set -uo pipefail
NPROC=${NPROC:-1}
if [ "$NPROC" = 1 ]; then DEFAULT_OUT=results/h200; else DEFAULT_OUT=results/h200x$NPROC; fi
OUT=${OUT:-$DEFAULT_OUT}
LOGS=${LOGS:-bench-out}
LAYERS=${LAYERS:-4}
# 4 layers of the published pattern: 3 Gated DeltaNet, then full attention
TYPES=${TYPES:-[linear_attention,linear_attention,linear_attention,full_attention]}
[ "$TYPES" = full ] && TYPES="[$(yes full_attention | head -n "$LAYERS" | paste -sd,)]"
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m longmoe bench train-path --config gpu_smoke --nproc "$NPROC" --tokens "${TOKENS:-32768,65536}" \
    --steps 6 --set model.num_layers="$LAYERS" --set "model.layer_types=$TYPES" \
    --set parallel.ep="$NPROC" ${EXTRA:-} ${STAGES:+--stages "$STAGES"} ${PROFILE:+--profile "$PROFILE"} \
    --set data.prompt_len=1024 --set train.nproc="$NPROC" --timeout "${RUN_TIMEOUT:-540}" \
    --out "$OUT/train_path${TAG:-}.json" 2>&1 | tail -14 | tee -a "$LOGS/train_path.log"
