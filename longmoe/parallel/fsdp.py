"""FSDP2 (per-parameter DTensor sharding via fully_shard) for the MoE transformer.

Units: each block's experts (on the expert mesh, when EP > 1), each block, the LM head, and the
root (embedding). Gradients are *summed* across ranks (divide factor 1): the trainer divides each
rank's loss by the global token count, and the expert all-to-all already sums every rank's
contribution into the owning rank, so a sum keeps dense and expert gradients on one scale.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from longmoe.model.transformer import MoETransformer
from longmoe.ops.recompute import Recompute
from longmoe.parallel.mesh import Layout


def apply_fsdp(model: MoETransformer, layout: Layout, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: bool = True) -> MoETransformer:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for layer in model.layers:
        block = layer.block if isinstance(layer, Recompute) else layer
        if layout.ep > 1:
            fully_shard(block.moe.experts, mesh=layout.expert_mesh, **kw)
        fully_shard(layer, mesh=layout.dp_mesh, **kw)
    # The head's weight is saved for the linear-CE backward right after forward: keep it unsharded.
    fully_shard(model.head, mesh=layout.dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=layout.dp_mesh, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    return model
