"""The MoE block: softmax top-k router (optional aux-loss-free bias, load-balancing loss), routed
SwiGLU experts stored stacked for grouped GEMM, and a sigmoid-gated shared expert.

Legend: T tokens, H hidden, E experts (global), L local experts, F expert FFN, K top-k, M rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longmoe.config import ModelConfig
from longmoe.ops.grouped_mm import grouped_mm
from longmoe.ops.moe_rows import SwiGLU
from longmoe.ops.router_matmul import router_logits
from longmoe.parallel.expert_parallel import ExpertDispatcher, count_ids


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Aux-loss-free balancing bias: steers selection only, never the combine weights.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        # Global tokens per expert in the last forward, read by update_expert_bias().
        self.register_buffer("last_load", torch.zeros(cfg.num_experts), persistent=False)
        self.matmul = "auto"  # the logits' GEMMs (ops/router_matmul.py; impl.router_matmul)
        # A list while the model records its routes (record_routes): each forward appends its
        # [T, K] expert ids.
        self.recorded: list | None = None

    def forward(self, x_TH, replay_TK=None):
        """(expert ids [T, K], their combine weights [T, K], probabilities [T, E]). `replay_TK`
        (router replay): a token's experts where its row is >= 0 (the rollout engine's choice),
        weighted by this router's probabilities for them; -1 rows choose by top-k as usual."""
        probs_TE = torch.softmax(router_logits(x_TH, self.weight, self.matmul), dim=-1)
        scores = probs_TE + self.expert_bias if self.cfg.expert_bias_rate > 0 else probs_TE
        idx_TK = torch.topk(scores, self.cfg.top_k, dim=-1).indices
        if replay_TK is not None:
            idx_TK = torch.where(replay_TK >= 0, replay_TK.to(idx_TK.dtype), idx_TK)
        if self.recorded is not None:
            self.recorded.append(idx_TK.detach())
        w_TK = probs_TE.gather(1, idx_TK)
        if self.cfg.norm_topk_prob:
            w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        return idx_TK, w_TK, probs_TE

    @torch.no_grad()
    def update_expert_bias(self):
        if self.cfg.expert_bias_rate > 0 and self.last_load.sum() > 0:
            self.expert_bias += self.cfg.expert_bias_rate * torch.sign(
                self.last_load.mean() - self.last_load)


class GroupedExperts(nn.Module):
    """The L experts this rank owns, stacked: w_in [L, H, 2F] (gate half, then up half) and
    w_out [L, F, H], so one grouped GEMM serves them all."""

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        L = cfg.num_experts // ep_size
        self.first_expert, self.num_local = ep_rank * L, L
        self.w_in = nn.Parameter(torch.empty(L, cfg.hidden_size, 2 * cfg.moe_ffn_size))
        self.w_out = nn.Parameter(torch.empty(L, cfg.moe_ffn_size, cfg.hidden_size))
        self.impl = "auto"
        self.rows_impl = "auto"  # SwiGLU's row kernels (ops/moe_rows.py)

    def forward(self, x_MH, rows_per_expert, w_A=None, offs=None):
        """x_MH grouped by expert with `rows_per_expert` rows each (a host list, or None with
        only `offs`, each expert's end row on the device); or, for expert parallelism, the
        layer's tokens with a ChunkPipeline that dispatches them (and combine weights w_A).
        Either way the call goes through this module, so FSDP's hooks gather the weights."""
        if rows_per_expert is not None and not isinstance(rows_per_expert, list):
            return rows_per_expert.run(x_MH, w_A, self.w_in, self.w_out, self.impl)
        h_MF2 = grouped_mm(x_MH, self.w_in, rows_per_expert, offs, impl=self.impl)
        a_MF = SwiGLU.apply(h_MF2, self.rows_impl)
        return grouped_mm(a_MF, self.w_out, rows_per_expert, offs, impl=self.impl)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.shared_expert_ffn_size
        self.gate_up = nn.Linear(h, 2 * f, bias=False)
        self.down = nn.Linear(f, h, bias=False)
        self.gate = nn.Linear(h, 1, bias=False)

    def forward(self, x_TH):
        g, u = self.gate_up(x_TH).chunk(2, dim=-1)
        return torch.sigmoid(self.gate(x_TH)) * self.down(F.silu(g) * u)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg, ep_rank, ep_size)
        self.shared = SharedExpert(cfg) if cfg.shared_expert_ffn_size else None
        self.dispatcher = ExpertDispatcher(cfg.num_experts)
        self.batch_group = None  # ranks whose tokens form the global batch (for the aux loss)

    def forward(self, x_BSH, routes_BSK=None):
        """(output, balance loss). `routes_BSK`: replayed experts per token (Router.forward)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        replay = None if routes_BSK is None else routes_BSK.reshape(x_TH.shape[0], -1)
        idx_TK, w_TK, probs_TE = self.router(x_TH, replay)
        aux = self._balance_loss(idx_TK, probs_TE)
        # The shared expert runs under the routed experts' last combine (see moe_pipeline.py).
        fill = (lambda: self.shared(x_TH)) if self.shared is not None else None
        y_TH = self.dispatcher(x_TH, idx_TK, w_TK, self.experts, fill)
        return y_TH.view_as(x_BSH), aux

    def _balance_loss(self, idx_TK, probs_TE):
        """Switch-style E * sum_i f_i * P_i over the global batch, split so each rank's share is
        additive: f_i uses all-reduced counts, P_i this rank's probabilities over the global
        token count. Summing gradients across ranks then gives the global loss's gradient."""
        E, K = self.cfg.num_experts, self.cfg.top_k
        with torch.no_grad():
            stats = torch.cat([count_ids(idx_TK.clamp(0, E - 1), E).to(probs_TE.dtype),
                               torch.full((1,), float(idx_TK.shape[0]), device=probs_TE.device,
                                          dtype=probs_TE.dtype)])
            if self.batch_group is not None:
                dist.all_reduce(stats, group=self.batch_group)
            counts_E, n_tok = stats[:E], stats[E]
            self.router.last_load.copy_(counts_E)
        if self.cfg.router_aux_loss_coef == 0:
            return probs_TE.new_zeros(())
        f_E = counts_E / (n_tok * K)
        p_E = probs_TE.sum(0) / n_tok
        return self.cfg.router_aux_loss_coef * E * (f_E * p_E).sum()
