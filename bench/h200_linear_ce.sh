#!/usr/bin/env bash
# The linear-CE benchmark sweep on one GPU, as run on the H200 (device tool): tests on the GPU,
# the bench over T in {8K, 32K, 64K} with a chunk-size sweep for ours, and a kernel breakdown.
# Needs liger-kernel and cut-cross-entropy on PYTHONPATH (carried as wheels) for the peers.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q -x tests/test_linear_ce.py tests/test_linear_ce_fused.py 2>&1 | tail -4 | tee "$OUT/tests.log"
python3 -m longmoe bench linear-ce --tokens 8192,32768,65536 --chunks 0,1024,2048,4096,8192 \
    --out "$OUT/linear_ce.json" > "$OUT/bench.log" 2>&1
tail -40 "$OUT/bench.log"
python3 - "$OUT" <<'PY'
import json, sys
from longmoe.bench.linear_ce import profile_breakdown
rows = [profile_breakdown(32768, 2048, 248320, c, w) for w in ("ours", "ours_rl") for c in (2048, 8192)]
json.dump(rows, open(f"{sys.argv[1]}/profile_32k.json", "w"), indent=1)
for r in rows:
    print(r["impl"], r["chunk_tokens"], f"{r['device_ms_total']:.1f} ms")
    for k in r["top"][:6]:
        print(f"   {k['ms']:8.2f} ms  x{k['calls']:<4} {k['kernel'][:90]}")
PY
