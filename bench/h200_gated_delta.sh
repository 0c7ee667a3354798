#!/usr/bin/env bash
# The Gated DeltaNet core on one GPU: eager chunked vs compiled pieces, fp32 vs TF32 matmuls,
# beside causal SDPA of the preset's attention layer (`longmoe bench gated-delta`).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m longmoe bench gated-delta --tokens "${TOKENS:-16384,32768,65536}" \
    ${VARIANTS:+--variants "$VARIANTS"} --profile "${PROFILE:-chunked_compiled@high}" \
    --profile-dir "$OUT/gated_delta_ops" --out "$OUT/gated_delta.json" 2>&1 \
    | grep -v '^{' | tail -30 | tee -a "$OUT/log.txt"
