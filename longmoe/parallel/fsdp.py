"""FSDP2 (per-parameter DTensor sharding via fully_shard) for the MoE transformer.

Units: each block's experts (on the expert mesh, when EP > 1), each block, the LM head, and the
root (embedding). FSDP averages gradients over each unit's mesh (its default, and the only
reduction gloo supports: a custom divide factor needs NCCL's PreMulSum); see
longmoe.train.setup.finish_grads for how the trainer turns that average into the global sum.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from longmoe.model.transformer import MoETransformer
from longmoe.ops.recompute import Recompute
from longmoe.parallel.mesh import Layout


def apply_fsdp(model: MoETransformer, layout: Layout, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: bool = True,
               cpu_offload: bool = False, pin_memory: bool = True) -> MoETransformer:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # FSDP's default casts every floating-point forward argument, dataclass fields included, to
    # param_dtype. Units whose inputs are already in param_dtype where they should be, and that
    # also take fp32 values that must arrive as given, do not cast: the experts (EP > 1; their
    # tokens come from the block in param_dtype, their combine weights are the router's fp32
    # probabilities, as at EP = 1 where the experts are no unit of their own), the head and the
    # root (token ids; the last block's output; the RL loss's per-token inputs: advantages,
    # aggregation weights, old/ref/rollout log-probs, and the rollout temperature; bf16 would
    # move a log-prob of -5 by up to 0.01).
    exact = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                 cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    kw = dict(mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    for layer in model.layers:
        block = layer.block if isinstance(layer, Recompute) else layer
        if layout.ep > 1:
            fully_shard(block.moe.experts, mesh=layout.expert_mesh, **{**kw, "mp_policy": exact})
        fully_shard(layer, mesh=layout.dp_mesh, **kw)
    # The head's weight is saved for the linear-CE backward right after forward: keep it unsharded.
    fully_shard(model.head, mesh=layout.dp_mesh, mp_policy=exact, reshard_after_forward=False,
                offload_policy=offload)
    fully_shard(model, mesh=layout.dp_mesh, **{**kw, "mp_policy": exact})
    return model
