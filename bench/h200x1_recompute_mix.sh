#!/usr/bin/env bash
# One H200: the hybrid preset's last path stage at 64K with per-layer recompute lists (which
# layers re-run their forward), and one profiled run of the default (full everywhere).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
for rc in ${MIXES:-"[full,full,full,none]" "[full,full,none,none]" "[none,full,full,none]"}; do
  tag=$(echo "$rc" | tr -d '[]' | tr ',' '-')
  OUT=$OUT TOKENS=${TOKENS:-65536} STAGES="+chunked EP" RUN_TIMEOUT=200 TAG="_rc_$tag" \
      EXTRA="--set parallel.recompute=$rc" bash bench/h200_train_path.sh
done
if [ -n "${PROFILE_DIR:-}" ]; then
  OUT=$OUT TOKENS=65536 STAGES="+chunked EP" RUN_TIMEOUT=200 TAG=_profiled PROFILE="$PROFILE_DIR" \
      bash bench/h200_train_path.sh
  tar -C "$PROFILE_DIR" -czf "$OUT/profile.tar.gz" . && rm -rf "$PROFILE_DIR"
fi
