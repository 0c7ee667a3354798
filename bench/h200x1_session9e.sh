#!/usr/bin/env bash
# One H200, session 9, fifth call: GPU tests after the forward's combine buffer became lazy;
# per-phase memory; the cost of the layer's one host synchronisation (bench/sync_cost.py); the
# hybrid preset's last path stage at 64K with RouterLogits (against session 8's 1.375 s, 96.4 GiB).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 120 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_expert_parallel.py \
    tests/test_moe_pipeline.py > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
timeout 80 python3 bench/pipeline_memory.py --tokens 65536 --chunks 1,4,8 --wgrad auto \
    --out "$OUT/pipeline_memory_lazy.json" 2>&1 | grep '^{' | cut -c1-200
timeout 100 python3 bench/sync_cost.py --tokens 16384,65536 --chunks 1,4 \
    --out "$OUT/sync_cost.json" 2>&1 | grep '^{'
OUT=$OUT TOKENS=65536 RUN_TIMEOUT=230 TAG=_session9 STAGES="+chunked EP" \
    timeout 240 bash bench/h200_train_path.sh
