#!/usr/bin/env bash
# One H200: (1) the attention GPU tests, (2) causal SDPA of the Qwen3.5 attention layer per SDPA
# backend, (3) the chunk pipeline on one rank (its all-to-alls are local copies: what chunking
# itself costs) beside the unpipelined layer, with traces at 16K, (4) the 64K full-recompute
# training stage per impl.attention (ATTN, default "auto cudnn").
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 200 python3 -m pytest -q -s -rfEs --tb=short tests/test_attention.py \
    tests/test_moe_pipeline.py -m needs_cuda > "$OUT/tests.txt" 2>&1
grep -E "order|passed|failed|FAIL|Error" "$OUT/tests.txt" | tail -12
timeout 240 python3 -m longmoe bench gated-delta --tokens "${ATT_TOKENS:-32768,65536}" \
    --variants sdpa,sdpa:flash,sdpa:cudnn --out "$OUT/attention.json" 2>&1 | tail -10
if [ "${SKIP_MOE:-0}" != 1 ]; then
  timeout 240 python3 -m longmoe bench moe-layer --nproc 1 --tokens "${MOE_TOKENS:-16384,65536}" \
      --chunks 1,2,4,8 --transports process_group --trace-tokens 16384 --trace-chunks ${TRACE_CHUNKS:-1,4} \
      --trace-dir "$OUT/traces" --out "$OUT/moe_layer_1rank.json" 2>&1 | grep "^|" | tail -8
  tar -C "$OUT" -cf "$OUT/moe_traces.tar" traces && rm -rf "$OUT/traces"
fi
for a in ${ATTN:-auto cudnn}; do
  OUT=$OUT TOKENS=${TRAIN_TOKENS:-65536} STAGES="+chunked EP" EXTRA="--set impl.attention=$a" \
      TAG="_attn_$a" RUN_TIMEOUT=300 bash bench/h200_train_path.sh
done
