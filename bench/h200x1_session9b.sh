#!/usr/bin/env bash
# One H200, session 9, second call: host time and device kernels of the two weight-gradient
# schedules (auto: inside each chunk's step; delayed: at the end), then the moe-layer sweep
# A/B/A again (delayed first this time).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for T in 16384 65536; do
    for w in auto delayed; do
        timeout 100 python3 bench/host_overhead.py --tokens $T --chunks 1,2,4 --wgrad $w \
            --profile-ops --out "$OUT/host_${w}_$T.json" 2>&1 | grep '^{'
    done
done
n=0
for w in delayed auto delayed; do
    n=$((n + 1))
    timeout 120 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,32768,65536 \
        --chunks 1,2,4,8 --transports process_group --wgrad $w \
        --out "$OUT/moe_layer_1rank_wgrad_${w}_b$n.json" 2>&1 | grep "^|" | tail -1
done
