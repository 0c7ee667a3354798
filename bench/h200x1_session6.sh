#!/usr/bin/env bash
# One H200, one call: GPU tests of the pieces changed this session, the MoE layer on one rank
# (pipeline with local all-to-alls beside the unpipelined layer, traces at 16K), and the
# hybrid preset's full-recompute training stage at 32K and 64K.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 240 python3 -m pytest -q -rfEs --tb=short tests/test_norm.py tests/test_attention.py \
    tests/test_moe_pipeline.py tests/test_expert_parallel.py -m "needs_cuda" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 200 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,65536 --chunks 1,2,4,8 \
    --transports process_group --trace-tokens 16384 --trace-chunks 1,4 --trace-dir "$OUT/traces" \
    --out "$OUT/moe_layer_1rank.json" 2>&1 | grep "^|" | tail -3
tar -C "$OUT" -cf "$OUT/moe_traces.tar" traces && rm -rf "$OUT/traces"
OUT=$OUT TOKENS=${TRAIN_TOKENS:-32768,65536} STAGES="+chunked EP" RUN_TIMEOUT=280 TAG=_session6 \
    ${PROFILE:+PROFILE=$PROFILE} bash bench/h200_train_path.sh
