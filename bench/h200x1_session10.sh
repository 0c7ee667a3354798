#!/usr/bin/env bash
# One H200, session 10, first call: GPU tests of the router's GEMMs and the MoE layer; the
# router's GEMMs alone (fp32 at "highest"/"high", bf16 with fp32 output, the split backward);
# the layer with impl.router_matmul fp32 against mixed, A/B/A in one call.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 150 python3 -m pytest -q -rfEs --tb=short -m needs_cuda tests/test_router_matmul.py \
    tests/test_moe_pipeline.py tests/test_expert_parallel.py tests/test_model.py \
    > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
timeout 60 python3 bench/router_gemm_probe.py --tokens 16384,65536 --out "$OUT/router_gemm.json" \
    2>&1 | grep '^{' | python3 -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l)
    print(r['T'], r['op'], r['variant'], r['precision'], round(r['ms'], 3), r.get('rel_err_fp64'))"
n=0
for m in fp32 mixed fp32; do
    n=$((n + 1))
    timeout 110 python3 -m longmoe bench moe-layer --nproc 1 --tokens 16384,65536 \
        --chunks 1,4 --transports process_group --router-matmul $m \
        --out "$OUT/moe_layer_1rank_router_${m}_$n.json" > /dev/null 2>&1
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit('/', 1)[-1], [(r['T'], r['kind'], r.get('chunks'), round(r['ms'], 2),
      round(r['peak_bytes'] / 2**30, 2)) for r in d['rows'] if r['kind'] in ('direct', 'layer')])
" "$OUT/moe_layer_1rank_router_${m}_$n.json"
done
