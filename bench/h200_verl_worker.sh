#!/usr/bin/env bash
# verl's worker path (TrainingWorker over LongMoEEngine) against PolicyTrainer called directly, on
# the Qwen3.5-35B-A3B preset at 40 layers (30 Gated DeltaNet + 10 gated attention) with 32 experts
# (one EP = 8 rank's share), one GPU, full recompute, FSDP2, linear CE, bf16:
#   bench/h200_verl_worker.sh            -> OUT/verl_worker.json (+ .md)
# Cases and arms (one process, interleaved): bench/verl_worker.py. SAMPLES (default 16): the GRPO
# batch's samples; STEPS (default 3): timed rounds after the untimed first; PROFILE=1: op tables of
# one log-prob pass per arm (OUT/CASE_ARM_logprob_ops.txt); OFFLOAD=1: one engine.to offload and
# reload round trip after the cases (memory freed, seconds, state unchanged). Needs verl and what
# it imports (the verl extra) on top of the GPU image.
set -uo pipefail
. "$(dirname "$0")/_preflight.sh"
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TYPES=[$(for i in $(seq 1 40); do [ $((i % 4)) -eq 0 ] && printf full_attention || printf linear_attention; [ "$i" -lt 40 ] && printf ,; done)]
python3 bench/verl_worker.py --config gpu_smoke --samples "${SAMPLES:-16}" --steps "${STEPS:-3}" \
    --cases "${CASES:-packed32k,grpo}" \
    --set model.num_layers=40 --set "model.layer_types=$TYPES" --set model.num_experts=32 \
    --set data.seq_len=32768 --set data.prompt_len=1024 --set data.row_multiple=1024 \
    --set parallel.chunks=1 --set impl.linear_ce=auto --out "$OUT/verl_worker.json" \
    ${PROFILE:+--profile "$OUT"} ${OFFLOAD:+--offload}
