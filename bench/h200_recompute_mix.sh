#!/usr/bin/env bash
# One H200: the last path stage at 64K with per-layer recompute lists (which layers re-run their
# forward in backward), the measurement behind `longmoe recipe --keep-last`. Writes
# results/h200/train_path_rc_<mix>.json; the all-full reference is MIXES="[full,full,full,full]".
set -uo pipefail
for rc in ${MIXES:-"[full,full,full,none]" "[full,full,none,none]" "[none,full,full,none]"}; do
  tag=$(echo "$rc" | tr -d '[]' | tr ',' '-')
  TOKENS=${TOKENS:-65536} STAGES="+chunked EP" RUN_TIMEOUT=200 TAG="_rc_$tag" \
      EXTRA="--set parallel.recompute=$rc" bash bench/h200_train_path.sh
done
