#!/usr/bin/env bash
# One H200, session 8, after the host-time fixes: GPU tests, the host-overhead probe, the MoE
# layer on one rank beside megatron-core's dispatcher (same call), the hybrid preset's last
# training stage at 32K and 64K.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 100 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_moe_pipeline.py \
    tests/test_moe_rows.py tests/test_expert_parallel.py tests/test_grouped_mm.py > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
timeout 100 python3 bench/host_overhead.py --tokens 16384 --chunks 1,2,4,8 \
    --out "$OUT/host_overhead_final_16384.json" 2>&1 | grep '^{'
timeout 200 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,32768,65536 --chunks 1,4 \
    --transports process_group --baseline megatron --out "$OUT/moe_layer_1rank_megatron.json" \
    2>&1 | grep "^|" | tail -3
OUT=$OUT TOKENS=65536,32768 STAGES="+chunked EP" RUN_TIMEOUT=240 TAG=_session8 \
    timeout 330 bash bench/h200_train_path.sh
