#!/usr/bin/env bash
# One H200, session 9: the pipeline's weight gradient inside each chunk's step (wgrad auto)
# against delayed to the end of the layer, A/B/A in one call, on one rank (local all-to-alls);
# per-phase memory; GPU tests including the pipeline on CUDA with both schedules.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 110 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_moe_pipeline.py \
    tests/test_moe_rows.py tests/test_expert_parallel.py > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
timeout 100 python3 - >> "$OUT/tests.txt" 2>&1 <<'PY'
import random
from longmoe.paired.dist_cases import ep_case
for C, by, wgrad, k, skew in [(1, "experts", "auto", 2, False), (4, "experts", "auto", 2, False),
                              (4, "experts", "delayed", 2, False), (3, "tokens", "auto", 2, False),
                              (4, "experts", "auto", 1, True)]:
    seed = random.randrange(2**31)
    r = ep_case(1, seed, T=301, chunks=C, top_k=k, skew=skew, device="cuda", chunk_by=by,
                wgrad=wgrad)
    print("ep_case cuda nproc=1", C, by, wgrad, "top_k", k, "skew", skew, "seed", seed,
          "ok" if r.ok else f"FAIL {r.failures()}")
PY
grep ep_case "$OUT/tests.txt"
n=0
for w in auto delayed auto; do
    n=$((n + 1))
    timeout 130 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,32768,65536 \
        --chunks 1,2,4,8 --transports process_group --wgrad $w \
        --out "$OUT/moe_layer_1rank_wgrad_${w}_$n.json" 2>&1 | grep "^|" | tail -3
done
timeout 150 python3 bench/pipeline_memory.py --tokens 16384,65536 --chunks 1,4,8 \
    --out "$OUT/pipeline_memory.json" 2>&1 | grep '^{' | cut -c1-220
