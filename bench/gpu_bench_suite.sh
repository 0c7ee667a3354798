#!/usr/bin/env bash
# Every single-GPU longmoe benchmark at the sizes the docs report, peers timed in the same run:
#   linear CE (ours, liger-kernel, cut-cross-entropy, naive torch) at 32K and 64K tokens, V = 248,320;
#   one MoE layer (unpipelined and chunked, megatron-core's all-to-all dispatcher beside it);
#   the Gated DeltaNet core (ours compiled, fla, causal SDPA) at 32K and 64K;
#   training: the Qwen3.5-35B-A3B preset at 40 layers with 32 experts (one EP = 8 rank's share),
#   32K tokens, and the 4-layer hybrid cut along the optimisation path at 32K and 64K.
# Peers come from wheels in .whl/ (liger-kernel, cut-cross-entropy, megatron-core, fla-core);
# without them their rows say so. PARTS (a space list; default: all of linear_ce moe_layer
# gated_delta train_40l train_path) picks what runs; all of it takes about 20 minutes, so split it
# over calls of at most 10.
# Writes OUT/*.json and the tables the benches write beside them.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# longmoe itself, over the image's torch (no build isolation: nothing is fetched)
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
lm() { python3 -m longmoe "$@"; }
# step SECONDS ARGS...: `longmoe ARGS` within a time limit, its output's tail
step() { local t=$1; shift; echo "== longmoe $* (limit ${t}s)"; timeout "$t" python3 -m longmoe "$@" 2>&1 | tail -${TAIL:-12}; }
lm doctor --json > "$OUT/doctor.json"
PARTS=${PARTS:-linear_ce moe_layer gated_delta train_40l train_path}
has() { [[ " $PARTS " == *" $1 "* ]]; }
has linear_ce && step 200 bench linear-ce --tokens 32768,65536 --out "$OUT/linear_ce.json"
has moe_layer && step 150 bench moe-layer --nproc 1 --tokens 16384,32768,65536 --chunks 1,4 \
    --baseline megatron --out "$OUT/moe_layer.json"
has gated_delta && step 240 bench gated-delta --tokens 32768,65536 \
    --variants chunked_compiled@high,fla,sdpa --out "$OUT/gated_delta.json"
if has train_40l; then
    HYB40=[$(for i in $(seq 1 40); do [ $((i % 4)) -eq 0 ] && printf full_attention || printf linear_attention; [ "$i" -lt 40 ] && printf ,; done)]
    step 220 train --config gpu_smoke --steps 6 --set model.num_layers=40 --set "model.layer_types=$HYB40" \
        --set model.num_experts=32 --set data.seq_len=32768 --set data.batch_size=1 \
        --set data.prompt_len=1024 --set parallel.chunks=1 --set impl.linear_ce=auto \
        --metrics-out "$OUT/train_qwen35_40l_32e_32k.jsonl"
fi
# The 4-layer hybrid cut: the baseline stage and the last one (every primitive on) at 32K and 64K.
has train_path && step "${PATH_LIMIT:-300}" bench train-path --config gpu_smoke --nproc 1 --tokens 32768,65536 \
    --steps 6 --stages "${STAGES:-baseline,+chunked EP}" --set model.num_layers=4 \
    --set "model.layer_types=[linear_attention,linear_attention,linear_attention,full_attention]" \
    --set data.prompt_len=1024 --timeout 120 --out "$OUT/train_path.json"
ls -la "$OUT"
