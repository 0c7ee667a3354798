"""Build the model for a layout: deterministic init, implementation choices, expert-parallel
dispatchers, recompute wrappers, FSDP2. Plus the pieces of a step that depend on the layout:
gradient sync without FSDP and a global gradient norm across differently-sharded parameters.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from longmoe.model.moe import GroupedExperts
from longmoe.model.transformer import MoETransformer
from longmoe.ops.recompute import apply_recompute
from longmoe.parallel.context_parallel import ContextParallel
from longmoe.backends import active_backend
from longmoe.model.deltanet import GatedDeltaNet, GatedRMSNorm
from longmoe.model.layers import Attention, RMSNorm
from longmoe.ops.attention import Attention as SDPA
from longmoe.tuning import resolve_chunks, resolve_transport
from longmoe.parallel.expert_parallel import ExpertDispatcher
from longmoe.parallel.fsdp import apply_fsdp
from longmoe.parallel.mesh import Layout
from longmoe.train.config import RunConfig


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_model(run: RunConfig, layout: Layout, device: torch.device) -> MoETransformer:
    cfg, par = run.model, run.parallel
    with torch.device(device):
        model = MoETransformer(cfg, layout.ep_rank, layout.ep)
    model.init_weights(run.train.seed)
    model.head.impl = run.impl.linear_ce
    model.head.chunk_tokens = run.impl.ce_chunk_tokens or None
    if layout.cp > 1:
        cp = ContextParallel(layout.cp_group, run.data.seq_len)
        for block in model.layers:
            block.attn.cp = cp
    backend = active_backend()
    local_tokens = run_local_tokens(run, layout.data_world, layout.cp)
    a2a, model.transport_source = resolve_transport(par.a2a_transport, backend, device, layout.ep,
                                                    cfg.hidden_size, cfg.top_k, par.param_dtype,
                                                    local_tokens, par.chunk_by)
    transport, streams = backend.a2a(a2a, device), backend.streams()
    chunks, model.chunks_source = resolve_chunks(par.chunks, backend, layout.ep, cfg.hidden_size,
                                                 cfg.top_k, par.param_dtype, local_tokens,
                                                 par.chunk_by)
    if par.chunk_by == "experts" and chunks > cfg.num_experts // layout.ep:  # "auto" may ask more
        chunks = cfg.num_experts // layout.ep
        model.chunks_source += f"; at most the {chunks} local experts (chunk_by=experts)"
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.impl = run.impl.gated_delta
        if isinstance(m, Attention):
            m.sdpa = SDPA(run.impl.attention)
        if isinstance(m, (RMSNorm, GatedRMSNorm)):
            m.impl = run.impl.norm
    for moe in model.moe_layers():
        moe.experts.impl = run.impl.grouped_mm
        moe.router.matmul = run.impl.router_matmul
        moe.dispatcher = ExpertDispatcher(cfg.num_experts, layout.ep_group, chunks,
                                          transport=transport, streams=streams,
                                          chunk_by=par.chunk_by)
        moe.dispatcher.rows_impl = moe.experts.rows_impl = run.impl.moe_rows
        moe.batch_group = layout.batch_group
    model.layers = nn.ModuleList(apply_recompute(b, layer_policy(par.recompute, i),
                                                 run.impl.recompute, par.keep_attention)
                                 for i, b in enumerate(model.layers))
    if par.fsdp and layout.dp_mesh is not None:
        apply_fsdp(model, layout, torch_dtype(par.param_dtype), torch_dtype(par.reduce_dtype),
                   par.reshard_after_forward, par.cpu_offload,
                   pin_memory=device.type != "cpu")  # pinning needs an accelerator runtime
    if run.train.init_hf:
        from longmoe.model.hf import load_hf
        load_hf(model, run.train.init_hf)
    return model


def run_local_tokens(run: RunConfig, data_world: int, cp: int) -> int:
    """Tokens a rank holds in one forward: its micro-batch row share (the token budget over
    cp), or without a budget its padded rows."""
    if run.data.budget is not None:
        return run.data.budget // cp
    return run.data.per_rank(data_world) * run.data.seq_len // cp


def set_cp_row_length(model: nn.Module, layout: Layout, row_len: int):
    """Point every context-parallel layer at rows of `row_len` tokens (micro-batch rows vary
    in length; each length's zigzag bookkeeping is built once)."""
    cache = model.__dict__.setdefault("_cp_by_len", {})
    cp = cache.get(row_len)
    for m in model.modules():
        cur = getattr(m, "cp", None)
        if isinstance(cur, ContextParallel) and cur.seq_len != row_len:
            if cp is None:
                cp = cache[row_len] = ContextParallel(layout.cp_group, row_len)
            m.cp = cp


def layer_policy(recompute, i: int) -> str:
    return recompute if isinstance(recompute, str) else recompute[i]


def _expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
            for p in m.parameters()}


def loss_scale(layout: Layout) -> float:
    """Each rank's loss is its token sum over the *global* token count, so the global gradient is
    the sum of the ranks' gradients. Gradient reduction averages (FSDP's default; gloo has no
    scaled sum), so the trainer multiplies its loss by the world size."""
    return float(layout.world)


def finish_grads(model: nn.Module, layout: Layout, fsdp: bool):
    """After backward: average replicated gradients when FSDP is off (as FSDP does), then undo
    the extra factor experts carry. An expert's gradient already sums the ep ranks of its
    all-to-all group, and the average runs over the world/ep ranks holding the same expert, so
    after the world-size loss scale it is ep times too large."""
    if layout.world == 1:
        return
    experts = _expert_param_ids(model)
    for p in model.parameters():
        if p.grad is None:
            continue
        is_expert = id(p) in experts
        if not fsdp:
            group = layout.expert_mesh.get_group() if is_expert else layout.batch_group
            n = dist.get_world_size(group)
            if n > 1:
                dist.all_reduce(p.grad, group=group)  # gloo has no AVG
                p.grad.div_(n)
        if is_expert and layout.ep > 1:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.div_(layout.ep)


def clip_grad_norm(model: nn.Module, max_norm: float, layout: Layout, grad_of=None,
                   loss: torch.Tensor | None = None) -> tuple[float, bool]:
    """(global L2 norm over every gradient element exactly once, whatever its sharding; whether
    the step is finite). DTensor shards are disjoint across the world; replicated plain tensors
    are counted 1/copies. grad_of(p) gives the gradient to use for parameter p (fp32 master
    gradients); default p.grad.

    The step is finite when the norm and every rank's `loss` are: the loss flag rides in the
    norm's all-reduce, so every rank reaches the same verdict from the one host read the norm
    already costs. A non-finite step's gradients are left unscaled (the step applies none)."""
    experts = _expert_param_ids(model)
    grads, groups = [], {}  # (device, copies) -> local gradients, one fused norm call each
    for p in model.parameters():
        grad = p.grad if grad_of is None else grad_of(p)
        if grad is None:
            continue
        g = grad.to_local() if isinstance(grad, DTensor) else grad
        grads.append(g)
        copies = 1
        if not isinstance(grad, DTensor):
            copies = layout.world // layout.ep if id(p) in experts else layout.world
        groups.setdefault((g.device, copies), []).append(g.detach())
    sq = None
    for (_, copies), gs in groups.items():
        norms = torch._foreach_norm(gs, 2, dtype=torch.float32)
        s = torch.stack(norms).pow(2).sum() / copies
        sq = s if sq is None else sq + s.to(sq.device)
    # On the compute device, where the collective backend works (offloaded grads are on the host)
    dev = loss.device if loss is not None else (sq.device if sq is not None else "cpu")
    sq = torch.zeros((), device=dev) if sq is None else sq.to(dev)
    bad = (~torch.isfinite(loss.detach().float()) if loss is not None
           else torch.zeros((), dtype=torch.bool, device=dev))
    both = torch.stack([sq, bad.float()])
    if layout.world > 1:
        dist.all_reduce(both, group=layout.batch_group)
    total, bad_losses = both.tolist()
    norm = math.sqrt(total) if total >= 0 else float("nan")
    finite = math.isfinite(norm) and bad_losses == 0
    if finite and max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm, finite


@torch.no_grad()
def all_finite(tensors, layout: Layout, device) -> bool:
    """Whether every element of every rank's tensors (DTensors: their local shards) is finite:
    one flag, all-reduced on `device` (the compute device)."""
    bad = torch.zeros((), device=device)
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        bad = torch.maximum(bad, (~torch.isfinite(t)).any().float().to(device))
    if layout.world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=layout.batch_group)
    return float(bad) == 0
