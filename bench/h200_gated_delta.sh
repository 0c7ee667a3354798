#!/usr/bin/env bash
# The Gated DeltaNet core on one GPU (`longmoe bench gated-delta`): the cores (VARIANTS, e.g.
# chunked@high,chunked_compiled@high,chunked_compiled) beside causal SDPA of the preset's attention
# layer, with a per-op profile of PROFILE (empty: none). Writes results/h200/gated_delta${TAG}.json
# and .md (OUT= elsewhere). The SDPA backends alone:
#   VARIANTS=sdpa,sdpa:flash,sdpa:cudnn TOKENS=32768,65536 PROFILE= TAG=_sdpa_backends bash bench/h200_gated_delta.sh
# The Triton core against fla's forward (fla_direct) and the compiled core (about 150 s on a fresh
# machine: the first calls compile every kernel):
#   VARIANTS=chunked_compiled@high,chunked_triton,fla_direct TOKENS=32768,65536 \
#     PROFILE= TAG=_triton bash bench/h200_gated_delta.sh
# TILES=1: then the Triton core kernel by kernel per tile config (`bench gated-delta-tiles`,
# CONFIGS: a JSON list of overrides of the table entry) into gated_delta_tiles.json.
set -uo pipefail
OUT=${OUT:-results/h200}
LOGS=${LOGS:-bench-out}
PROFILE=${PROFILE-chunked_compiled@high}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
python3 -m longmoe bench gated-delta --tokens "${TOKENS:-16384,32768,65536}" \
    ${VARIANTS:+--variants "$VARIANTS"} ${PROFILE:+--profile "$PROFILE" --profile-dir "$LOGS/gated_delta_ops"} \
    --out "$OUT/gated_delta${TAG:-}.json" 2>&1 | grep -v '^{' | tail -30 | tee -a "$LOGS/gated_delta.log"
if [[ ${TILES:-0} == 1 ]]; then
  python3 -m longmoe bench gated-delta-tiles --tokens "${TOKENS:-32768,65536}" \
      ${CONFIGS:+--configs "$CONFIGS"} --out "$OUT/gated_delta_tiles.json" 2>&1 | grep "^|" \
      | tee -a "$LOGS/gated_delta.log"
fi
