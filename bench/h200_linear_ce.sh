#!/usr/bin/env bash
# The linear-CE benchmark on one GPU, as run on the H200 (device tool): GPU tests, the bench over
# T in {8K, 32K, 64K} (ours at its default chunk plus a chunk sweep) against torch naive,
# liger-kernel and cut-cross-entropy, a per-kernel breakdown and a Chrome trace at 32K.
# Needs liger-kernel and cut-cross-entropy on PYTHONPATH (carried as wheels) for the peers.
set -uo pipefail
OUT=${OUT:-bench-out}
CHUNKS=${CHUNKS:-0,1024,2048,4096,8192}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q tests/test_linear_ce.py tests/test_linear_ce_fused.py 2>&1 | tail -4 | tee "$OUT/tests.log"
python3 -m longmoe bench linear-ce --tokens 8192,32768,65536 --chunks "$CHUNKS" \
    --out "$OUT/linear_ce.json" > "$OUT/bench.log" 2>&1
tail -45 "$OUT/bench.log"
python3 - "$OUT" <<'PY'
import gzip, json, shutil, sys
from longmoe.bench.linear_ce import profile_breakdown
out = sys.argv[1]
rows = [profile_breakdown(32768, 2048, 248320, None, w, trace=f"{out}/trace_{w}_32k.json")
        for w in ("ours", "ours_rl")]
json.dump(rows, open(f"{out}/profile_32k.json", "w"), indent=1)
for w in ("ours", "ours_rl"):
    with open(f"{out}/trace_{w}_32k.json", "rb") as f, gzip.open(f"{out}/trace_{w}_32k.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
for r in rows:
    print(r["impl"], r["chunk_tokens"], f"{r['device_ms_total']:.1f} ms")
    for k in r["top"][:7]:
        print(f"   {k['ms']:8.2f} ms  x{k['calls']:<4} {k['kernel'][:90]}")
PY
rm -f "$OUT"/trace_*_32k.json
