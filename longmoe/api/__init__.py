"""The policy-update API an RL framework calls (docs/api.md): PolicyTrainer."""

from longmoe.api.policy import PolicyTrainer

__all__ = ["PolicyTrainer"]
