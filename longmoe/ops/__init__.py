"""Primitives with registries; each has a plain-PyTorch reference that runs on CPU."""

from longmoe.ops.grouped_mm import GROUPED_MM, grouped_mm
from longmoe.ops.linear_ce import LINEAR_CE, linear_cross_entropy, linear_logprobs
from longmoe.ops.linear_ce_fused import POLICY_LOSS, linear_policy_loss
from longmoe.ops.linear_ce_vocab_parallel import vocab_parallel_logprobs
from longmoe.ops.recompute import RECOMPUTE, apply_recompute
from longmoe.ops.registry import ImplUnavailable, Registry

__all__ = ["linear_cross_entropy", "linear_logprobs", "linear_policy_loss", "POLICY_LOSS",
           "vocab_parallel_logprobs", "grouped_mm", "apply_recompute",
           "LINEAR_CE", "GROUPED_MM", "RECOMPUTE", "Registry", "ImplUnavailable"]
