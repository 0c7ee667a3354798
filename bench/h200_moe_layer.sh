#!/usr/bin/env bash
# One MoE layer (Qwen3.5-35B-A3B shape) on one GPU, results under results/h200/ (OUT= elsewhere).
# With one rank the pipeline's all-to-alls are local copies: these runs measure what the pipeline
# itself costs beside the unpipelined layer EP=1 training runs. PART picks one part (each fits a
# 10-minute call):
# PART=1: `bench moe-layer --nproc 1` with megatron-core's all-to-all dispatcher beside it
#         (moe_layer.json); the pipeline's tax under each weight-gradient schedule, with the
#         preset's 256 experts and with one EP = 8 rank's 32 (moe_layer_tax{,_32e}.json);
#         eager against Triton row ops (moe_layer_rows_{torch,triton}.json).
# PART=2: the row ops alone over tile configs (moe_rows.json), the expert grouped GEMMs
#         (grouped_mm.json), per-phase memory, the host sync, host time per chunk count.
# PART=3: the router's GEMMs alone and inside the layer (router_gemm.json, router_in_layer_*.json),
#         the source-major expert compute (source_major_experts.json).
set -uo pipefail
. "$(dirname "$0")/_preflight.sh"
OUT=${OUT:-results/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
moe() { python3 -m longmoe bench moe-layer --nproc 1 --transports process_group "$@" 2>&1 | grep "^|" | tail -4; }
case "${PART:-1}" in
  1)
    moe --tokens 16384,32768,65536 --chunks 1,2,4 --iters 10 --baseline megatron --out "$OUT/moe_layer.json"
    # every schedule and chunk count beside the unpipelined layer, timed in the same rounds
    tax="--tokens 16384,65536 --chunks 1,2,4 --iters 30 --wgrad auto,in_chunks,delayed"
    moe $tax --out "$OUT/moe_layer_tax.json"
    moe $tax --experts 32 --out "$OUT/moe_layer_tax_32e.json"
    for r in torch triton; do
      moe --tokens 16384,32768,65536 --chunks 1,4 --rows-impl $r --out "$OUT/moe_layer_rows_$r.json"
    done ;;
  2)
    CFGS='[{}, {"BLOCK_H": 512, "num_warps": 4}, {"BLOCK_H": 2048, "num_warps": 8},
           {"BLOCK_H_ROW": 1024, "num_warps_row": 4}, {"BLOCK_M": 4, "BLOCK_F": 512},
           {"BLOCK_M": 16, "BLOCK_F": 128}, {"BLOCK_M": 8, "BLOCK_F": 128, "num_warps_swiglu": 4}]'
    python3 -m longmoe bench moe-rows --tokens 16384,65536 --configs "$CFGS" --out "$OUT/moe_rows.json" \
        2>&1 | grep "^|" | tail -12
    python3 -m longmoe bench grouped-mm --tokens 16384,65536 --experts 128 --impls torch,triton \
        --out "$OUT/grouped_mm.json" 2>&1 | grep "^|" | tail -14
    python3 bench/pipeline_memory.py --tokens 65536 --chunks 1,4,8 --wgrad in_chunks --out "$OUT/pipeline_memory.json" | tail -8
    python3 bench/sync_cost.py --tokens 16384,65536 --chunks 1,4 --out "$OUT/sync_cost.json" | tail -8
    for T in 16384 65536; do
      python3 bench/host_overhead.py --tokens $T --chunks 1,2,4,8 --profile-ops \
          --out "$OUT/host_overhead_$((T / 1024))k.json" > /dev/null
    done ;;
  3)
    python3 bench/router_gemm.py --tokens 16384,65536 --out "$OUT/router_gemm.json" | tail -3
    python3 bench/router_in_layer.py --tokens 16384 --out "$OUT/router_in_layer_16k.json" | tail -3
    python3 bench/router_in_layer.py --tokens 65536 --out "$OUT/router_in_layer_64k.json" | tail -3
    python3 bench/router_in_layer.py --tokens 65536 --chunks 1 --out "$OUT/router_in_layer_64k_pipeline.json" | tail -3
    python3 bench/source_major_experts.py --tokens 16384,32768,65536 --ep 2,4,8 \
        --out "$OUT/source_major_experts.json" | tail -8 ;;
esac
