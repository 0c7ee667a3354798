#!/usr/bin/env bash
# verl's own GRPO trainer end to end with the longmoe engine (docs/integrations/verl.md):
# `python -m verl.trainer.main_ppo`, actor and reference policy on longmoe (model_engine=longmoe),
# vLLM (ROLLOUT=vllm, default) or SGLang (ROLLOUT=sglang) generating, on one node of GPUS GPUs.
#
# Needs: longmoe[verl] and the rollout engine installed for the node's torch, a Hugging Face
# model directory MODEL (a Qwen3-MoE / Qwen3.5-MoE checkpoint longmoe reads: model.hf_config),
# and verl's parquet data (TRAIN, VAL; verl's examples/data_preprocess/gsm8k.py writes them).
# This script has not been run: no machine it was written on has vLLM or SGLang. Its overrides
# compose with verl 0.9.1's ppo_trainer config into LongMoEActorConfig and pass the engine's
# checks (tests/test_verl_engine.py reads them from this file and composes them on CPU).
# tests/test_verl_main_ppo.py runs the same path on CPU (main_ppo, the hybrid
# ActorRolloutRefWorker on longmoe, agent-loop rollouts, reward, GRPO, update_actor, the naive
# weight sync), with a transformers stand-in in vLLM's place (tests/_verl_e2e.py) and a tiny model.
#
#   MODEL=/models/Qwen3.5-35B-A3B TRAIN=~/data/gsm8k/train.parquet VAL=~/data/gsm8k/test.parquet \
#       LONGMOE_SET="['parallel.ep=8']" bash bench/verl_e2e.sh
set -euo pipefail
: "${MODEL:?a Hugging Face model directory}" "${TRAIN:?train parquet}" "${VAL:?validation parquet}"
GPUS=${GPUS:-8}
ROLLOUT=${ROLLOUT:-vllm}
STEPS=${STEPS:-20}
LONGMOE_SET=${LONGMOE_SET:-"['parallel.ep=${GPUS}']"}
OUT=${OUT:-bench-out/verl_e2e}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The fused ppo_loss path (longmoe/integrations/verl/fused.py) needs token-mean, no KL loss and
# no entropy term. Any rollout temperature works (the LM head divides by it).
python3 -m verl.trainer.main_ppo \
    'hydra.searchpath=[pkg://longmoe.integrations.verl.configs]' \
    model_engine=longmoe \
    "actor_rollout_ref.actor.longmoe.overrides=${LONGMOE_SET}" \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=false \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=4096 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name="$ROLLOUT" \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=65536 \
    trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 \
    trainer.total_training_steps="$STEPS" trainer.test_freq=-1 trainer.save_freq=-1 \
    trainer.logger='["console"]' trainer.default_local_dir="$OUT/checkpoints" \
    2>&1 | tee "$OUT/main_ppo.log"
