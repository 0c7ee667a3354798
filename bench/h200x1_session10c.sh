#!/usr/bin/env bash
# One H200, session 10, last call, with the final code (the router's logits as a bf16 GEMM with
# fp32 output, its backward fp32): every needs_cuda test, the 20-step gpu_smoke run against the
# CUDA golden losses, and the router GEMM probe again (its first JSON lacked date and versions).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 330 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests > "$OUT/gpu_tests_final.txt" 2>&1
tail -3 "$OUT/gpu_tests_final.txt"
timeout 150 python3 -m longmoe train --config gpu_smoke --steps 20 \
    --metrics-out "$OUT/gpu_smoke.jsonl" > "$OUT/gpu_smoke_log.txt" 2>&1
echo "train rc=$?"; grep -i "auto picked 'mixed'" "$OUT/gpu_smoke_log.txt" | head -1
python3 ci/check_golden.py "$OUT/gpu_smoke.jsonl" ci/golden/cuda_gpu_smoke.json \
    --report "$OUT/golden_check.json" 2>&1 | tail -1
timeout 60 python3 bench/router_gemm_probe.py --tokens 16384,65536 --out "$OUT/router_gemm.json" \
    2>&1 | grep '^{' | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l)
    print(r['T'], r['op'], r['variant'], r['precision'], round(r['ms'], 3), r.get('rel_err_fp64'))"
