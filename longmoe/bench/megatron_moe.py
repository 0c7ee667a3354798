"""The Megatron baseline of `bench moe-layer --baseline megatron`: megatron-core's all-to-all token
dispatcher (`MoEAlltoAllTokenDispatcher`) in place of longmoe's chunked pipeline, inside the same
MoE layer. Same router, balance loss, shared expert, expert weights and grouped GEMM; only the
path from routed tokens to expert rows and back is megatron's:

    permute by routing map -> all-to-all-v (host-known splits) -> sort rows by local expert
    -> grouped GEMMs (probabilities applied before the down projection, as megatron's experts do)
    -> unsort -> all-to-all-v -> unpermute

megatron-core is imported here only (it is optional). The dispatcher keeps a torch.cuda side
stream for its device-to-host copies and allocates on the current torch.cuda device, so this runs
on GPUs; the paired CPU test stands in for the stream, the device and the host copy
(tests/test_megatron_baseline.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longmoe.ops.grouped_mm import grouped_mm
from longmoe.ops.moe_rows import swiglu


def megatron_config(num_experts: int, top_k: int, hidden: int, ffn: int, ep: int, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=16, ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn, num_moe_experts=num_experts, moe_router_topk=top_k,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
        moe_permute_fusion=False, moe_router_pre_softmax=True, add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16, gated_linear_unit=True, activation_func=F.silu)


_GROUPS: dict = {}


def process_groups(ep_group):
    """megatron's ProcessGroupCollection for EP over `ep_group` with expert TP of 1, built once
    per EP group (every rank creates every one-rank group: new_group is collective)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    if ranks not in _GROUPS:
        singles = {r: dist.new_group([r]) for r in ranks}
        pgs = ProcessGroupCollection()
        pgs.ep, pgs.tp_ep, pgs.expt_tp = ep_group, ep_group, singles[dist.get_rank()]
        _GROUPS[ranks] = pgs
    return _GROUPS[ranks]


class MegatronDispatch:
    """Drop-in for `ExpertDispatcher` (same call) that routes through megatron-core."""

    def __init__(self, num_experts: int, ep_group, experts, top_k: int, hidden: int, ffn: int,
                 dtype):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        ep = dist.get_world_size(ep_group)
        L = num_experts // ep
        first = experts.first_expert
        self.num_experts, self.chunks = num_experts, 1
        self.impl = MoEAlltoAllTokenDispatcher(
            L, list(range(first, first + L)),
            megatron_config(num_experts, top_k, hidden, ffn, ep, dtype), process_groups(ep_group))

    def __call__(self, x_TH, idx_TK, w_TK, experts, fill=None):
        T, E = idx_TK.shape[0], self.num_experts
        routing_map = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device)
        routing_map.scatter_(1, idx_TK, True)
        probs_TE = torch.zeros(T, E, dtype=w_TK.dtype, device=x_TH.device).scatter(1, idx_TK, w_TK)
        d = self.impl
        rows, p = d.dispatch_preprocess(x_TH, routing_map, probs_TE)
        rows, p = d.token_dispatch(rows, p)
        rows, per_expert, p = d.dispatch_postprocess(rows, p)
        counts = [int(n) for n in per_expert.tolist()]
        h = grouped_mm(rows, experts.w_in, counts, impl=experts.impl)
        a = swiglu(h) * p.unsqueeze(-1).to(h.dtype)
        out = grouped_mm(a, experts.w_out, counts, impl=experts.impl)
        out = d.combine_preprocess(out)
        out = d.token_combine(out)
        y = d.combine_postprocess(out).view_as(x_TH)
        return y + fill() if fill is not None else y
