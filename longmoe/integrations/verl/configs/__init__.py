"""Hydra config groups for verl's trainer: `hydra.searchpath=[pkg://longmoe.integrations.verl.configs]
model_engine=longmoe` selects actor/longmoe_actor.yaml and ref/longmoe_ref.yaml (the critic stays
verl's FSDP one)."""
