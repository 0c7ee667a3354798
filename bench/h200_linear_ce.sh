#!/usr/bin/env bash
# Linear cross-entropy on one GPU: its tests, `longmoe bench linear-ce` over T in {8K, 32K, 64K}
# (each layout of ours at its default chunk, CHUNKS= to sweep) against torch naive, liger-kernel
# and cut-cross-entropy, the layouts' precision against the split one, then a per-kernel
# breakdown and a Chrome trace at 32K.
# Writes results/h200/linear_ce.{json,md}, linear_ce_profile_32k.json, traces/linear_ce*_32k.json.gz
# (OUT= to write elsewhere); logs go to LOGS (default bench-out/).
# The peers are optional imports: install liger-kernel and cut-cross-entropy to time them.
set -uo pipefail
. "$(dirname "$0")/_preflight.sh"
OUT=${OUT:-results/h200}
LOGS=${LOGS:-bench-out}
CHUNKS=${CHUNKS:-0}
mkdir -p "$OUT/traces" "$LOGS"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pytest -q tests/test_linear_ce.py tests/test_linear_ce_fused.py 2>&1 | tail -4 | tee "$LOGS/linear_ce_tests.log"
python3 -m longmoe bench linear-ce --tokens 8192,32768,65536 --chunks "$CHUNKS" \
    --out "$OUT/linear_ce.json" > "$LOGS/linear_ce.log" 2>&1
tail -45 "$LOGS/linear_ce.log"
python3 - "$OUT" <<'PY'
import gzip, json, os, shutil, sys
from longmoe.bench.linear_ce import profile_breakdown
out = sys.argv[1]
names = {"ours": "linear_ce_32k", "ours_rl": "linear_ce_policy_loss_32k"}
rows = [profile_breakdown(32768, 2048, 248320, None, w, trace=f"{out}/traces/{n}.json")
        for w, n in names.items()]
json.dump(rows, open(f"{out}/linear_ce_profile_32k.json", "w"), indent=1)
for n in names.values():
    with open(f"{out}/traces/{n}.json", "rb") as f, gzip.open(f"{out}/traces/{n}.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(f"{out}/traces/{n}.json")
for r in rows:
    print(r["impl"], r["chunk_tokens"], f"{r['device_ms_total']:.1f} ms")
    for k in r["top"][:7]:
        print(f"   {k['ms']:8.2f} ms  x{k['calls']:<4} {k['kernel'][:90]}")
PY
