#!/usr/bin/env bash
# The Qwen3.5-35B-A3B preset at 40 layers (30 Gated DeltaNet + 10 gated attention) with 32 experts
# (one EP = 8 rank's share), one 32K-token sequence on one GPU, every one-GPU primitive on (full
# recompute, FSDP2, linear CE), one `longmoe train` per arm:
#   bench/h200_train_40l.sh NAME "--set k=v ..." [NAME "--set k=v ..." ...]
# Writes OUT/train_40l_32e.json (+ .md): per arm the median of the steps after the first, peak
# memory, first-step loss. PROFILE=NAME profiles that arm's third step: OUT/ops_rank0.txt,
# OUT/trace_rank0.json.gz and OUT/step_kernels.json (+ .md, bench/trace_kernels.py).
# STEPS (default 4), LAYERS (default 40), TOKENS (default 32768); logs and metrics in LOGS.
set -uo pipefail
. "$(dirname "$0")/_preflight.sh"
OUT=${OUT:-bench-out}
LOGS=${LOGS:-$OUT/logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LAYERS=${LAYERS:-40}
TYPES=[$(for i in $(seq 1 "$LAYERS"); do [ $((i % 4)) -eq 0 ] && printf full_attention || printf linear_attention; [ "$i" -lt "$LAYERS" ] && printf ,; done)]
BASE=(--config gpu_smoke --steps "${STEPS:-4}" --set model.num_layers="$LAYERS" --set "model.layer_types=$TYPES"
      --set model.num_experts=32 --set data.seq_len="${TOKENS:-32768}" --set data.batch_size=1
      --set data.prompt_len=1024 --set parallel.chunks=1 --set impl.linear_ce=auto)
ARM_ARGS=()
while [ $# -ge 2 ]; do
    name=$1 sets=$2; shift 2
    prof=(); [ "${PROFILE:-}" = "$name" ] && prof=(--profile "$OUT")
    echo "== arm $name: $sets"
    # shellcheck disable=SC2086  # the arm's sets split on spaces
    timeout "${ARM_LIMIT:-240}" python3 -m longmoe train "${BASE[@]}" $sets "${prof[@]}" \
        --metrics-out "$LOGS/$name.jsonl" > "$LOGS/$name.log" 2>&1
    echo "   exit $?"; tail -n 4 "$LOGS/$name.log"
    [ -s "$LOGS/$name.jsonl" ] && ARM_ARGS+=(--arm "$name=$LOGS/$name.jsonl" --sets "$name=$sets")
done
if [ ${#ARM_ARGS[@]} -gt 0 ]; then
    python3 bench/train_summary.py --what "Qwen3.5-35B-A3B preset at $LAYERS layers with 32 experts (one EP = 8 rank's share), one ${TOKENS:-32768}-token sequence, FSDP2, linear CE, bf16; arms differ in their --set" \
        --command "longmoe train ${BASE[*]}" "${ARM_ARGS[@]}" --out "$OUT/train_40l_32e.json"
fi
if [ -n "${PROFILE:-}" ] && [ -s "$OUT/trace_rank0.json.gz" ]; then
    python3 bench/trace_kernels.py "$OUT/trace_rank0.json.gz" --what "step 3 of arm $PROFILE" \
        --out "$OUT/step_kernels.json" > /dev/null
fi
