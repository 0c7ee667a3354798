#!/usr/bin/env bash
# One H200, session 10, second call: the trainer with the router's mixed GEMMs (the new default):
# the 20-step gpu_smoke run against the CUDA golden losses, then the hybrid preset's last path
# stage at 64K (against session 9's 1.387 s, 96.1 GiB with TF32 router GEMMs).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 200 python3 -m longmoe train --config gpu_smoke --steps 20 \
    --metrics-out "$OUT/gpu_smoke.jsonl" > "$OUT/gpu_smoke_log.txt" 2>&1
echo "train rc=$?"; grep -i "router_matmul\|auto picked" "$OUT/gpu_smoke_log.txt" | head -3
python3 ci/check_golden.py "$OUT/gpu_smoke.jsonl" ci/golden/cuda_gpu_smoke.json \
    --report "$OUT/golden_check.json" 2>&1 | tail -3
OUT=$OUT TOKENS=65536 RUN_TIMEOUT=230 TAG=_session10 STAGES="+chunked EP" \
    timeout 240 bash bench/h200_train_path.sh
