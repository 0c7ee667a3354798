#!/usr/bin/env bash
# The RL-side pieces on two H200s, against one GPU on the same batch; results under
# results/h200x2/ (OUT= elsewhere), logs under LOGS. Each PART fits one 10-minute call.
# The model: the Qwen3.5-35B-A3B preset cut to LAYERS (default 20: 15 Gated DeltaNet + 5 gated
# attention, the preset's 3:1 order) with 32 experts (one EP = 8 rank's share), so one GPU holds
# the same packed batch for the comparison.
# PART=1: packed micro-batches, CP 2 over NCCL: one step of a log-normal GRPO batch at a 64K
#         budget on one GPU and on CP 2 (same samples, same seed): first-step loss and gradient
#         norm compared (compare_steps.py, bf16 tolerance); then `bench packing` at CP 2 for
#         useful tokens/s and the rank-max peak.
# PART=2: the policy-update API at EP 2 with FSDP2 over NCCL: `longmoe train` (every step through
#         PolicyTrainer.forward_backward / optim_step) on one GPU and at EP 2, compared the same
#         way; `bench weight-sync --nproc 2` for the hand-off time and bytes per rank.
set -uo pipefail
OUT=${OUT:-results/h200x2}
LOGS=${LOGS:-bench-out}
LAYERS=${LAYERS:-20}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TYPES=[$(for i in $(seq 1 "$LAYERS"); do [ $((i % 4)) -eq 0 ] && printf full_attention \
    || printf linear_attention; [ "$i" -lt "$LAYERS" ] && printf ,; done)]
MODEL=(--set model.num_layers="$LAYERS" --set "model.layer_types=$TYPES" --set model.num_experts=32
       --set impl.linear_ce=auto --set parallel.chunks=1)
BATCH=(--set data.packing=true --set data.seq_len=65536 --set data.max_tokens_per_micro_batch=65536
       --set data.prompt_len=1024 --set data.row_multiple=1024
       --set data.response_len=lognormal:6144:31744 --set data.batch_size=16
       --set data.num_samples=16)
one_step() {  # tag, then extra arguments: one step's metrics into LOGS/<tag>.jsonl
    local tag=$1; shift
    timeout 240 python3 -m longmoe train --config gpu_smoke --steps 1 "${MODEL[@]}" "${BATCH[@]}" \
        --metrics-out "$LOGS/$tag.jsonl" "$@" > "$LOGS/$tag.log" 2>&1
    echo "$tag: exit $? ($(tail -1 "$LOGS/$tag.log"))"
}
case "${PART:-1}" in
  1)
    one_step packed_1gpu
    one_step packed_cp2 --nproc 2 --set parallel.cp=2
    python3 bench/compare_steps.py "$LOGS/packed_1gpu.jsonl" "$LOGS/packed_cp2.jsonl" \
        --what "packed 64K budget, CP 2 against one GPU" --out "$OUT/packed_cp2_parity.json"
    timeout 300 python3 -m longmoe bench packing --nproc 2 --budget 65536 --samples 64 \
        --set parallel.cp=2 "${MODEL[@]}" --out "$OUT/packing_cp2.json" 2>&1 | grep "^|" ;;
  2)
    one_step api_1gpu
    one_step api_ep2 --nproc 2 --set parallel.ep=2
    python3 bench/compare_steps.py "$LOGS/api_1gpu.jsonl" "$LOGS/api_ep2.jsonl" \
        --what "PolicyTrainer at EP 2 x FSDP2 against one GPU" --out "$OUT/api_ep2_parity.json"
    timeout 240 python3 -m longmoe bench weight-sync --config gpu_smoke --nproc 2 \
        --set parallel.ep=2 "${MODEL[@]}" --no-export --out "$OUT/weight_sync_ep2.json" \
        2>&1 | grep "^|" ;;
esac
