"""The decoder-only MoE transformer: embedding, blocks (attention + MoE), final norm and an untied
LM head whose forward is the linear cross-entropy (logits never materialise).

Legend: B batch, S sequence, H hidden, V vocab.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from longmoe.config import ModelConfig
from longmoe.model.deltanet import GatedDeltaNet, GatedRMSNorm
from longmoe.model.layers import Attention, RMSNorm, rope_cos_sin
from longmoe.model.moe import GroupedExperts, MoE
from longmoe.model.packing import PackedRows
from longmoe.ops.linear_ce import linear_logprobs
from longmoe.ops.linear_ce_fused import linear_policy_loss

if TYPE_CHECKING:
    from longmoe.rl.objective import FusedLoss


class Block(nn.Module):
    """Token mixer (full attention, or Gated DeltaNet for a linear_attention layer) + MoE."""

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.layer_type = cfg.layer_type(index)
        self.attn = GatedDeltaNet(cfg) if self.layer_type == "linear_attention" else Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.moe = MoE(cfg, ep_rank, ep_size)

    def forward(self, x_BSH, cos, sin, packing=None, routes_BSK=None):
        """`routes_BSK`: the MoE's replayed experts per token (router replay), or None."""
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH), cos, sin, packing)
        y_BSH, aux = self.moe(self.moe_norm(x_BSH), routes_BSK)
        return x_BSH + y_BSH, aux

    @property
    def has_attention_kernel(self) -> bool:
        return isinstance(self.attn, Attention)

    def forward_around_attention(self, x_BSH, cos, sin, packing=None, routes_BSK=None, *,
                                 recompute):
        """forward with the attention kernel outside the recomputed regions (full attention
        layers only): `recompute(fn, *args)` runs what comes before the kernel (norm,
        projections, q/k norms, RoPE) and what comes after it (gate, output projection, MoE)
        as two recomputed regions, while the kernel's own saved tensors (q, k, v, its output
        and log-sum-exp) and the output gate are kept, so the backward never runs the kernel's
        forward again. Same values as forward."""
        q, k, v, gate = recompute(self._before_attention, x_BSH, cos, sin)
        o_BSND = self.attn.core(q, k, v, packing)
        return recompute(self._after_attention, x_BSH, o_BSND, gate, routes_BSK)

    def _before_attention(self, x_BSH, cos, sin):
        return self.attn.project(self.attn_norm(x_BSH), cos, sin)

    def _after_attention(self, x_BSH, o_BSND, gate_BSND, routes_BSK=None):
        x_BSH = x_BSH + self.attn.output(o_BSND, gate_BSND)
        y_BSH, aux = self.moe(self.moe_norm(x_BSH), routes_BSK)
        return x_BSH + y_BSH, aux


class LMHead(nn.Module):
    """Final norm + output projection. Its forward returns per-token log-probs (and entropy) of
    the labels through linear cross-entropy, so FSDP unshards the weight around that call."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.impl = "auto"
        self.chunk_tokens: int | None = None  # None: sized from the linear-CE byte budget

    def forward(self, x_BSH, labels_BS, with_entropy: bool = False,
                policy: FusedLoss | None = None, temperature_BS=None):
        """(logprobs, entropy or None, loss or None). With `policy` (the objective, its
        per-token inputs and the POLICY_LOSS impl) the RL loss is fused into the head: its
        gradient is computed in the forward and the returned log-probs/entropy are detached,
        for logging. `temperature_BS` (per position, > 0; None: 1 everywhere): log-probs and
        entropy of softmax(logits / temperature), as a rollout sampled them. Logits are
        linear in h, so h is divided instead (in fp32, rounded once to h's dtype): no
        [tokens, vocab] logits exist to divide."""
        h = self.norm(x_BSH)
        if temperature_BS is not None:
            h = (h / temperature_BS.unsqueeze(-1).to(torch.promote_types(h.dtype, torch.float32))
                 ).to(h.dtype)
        if policy is not None:
            loss, lp, ent = linear_policy_loss(h, self.weight, labels_BS, policy.objective,
                                               policy.inputs, impl=policy.impl,
                                               chunk_tokens=self.chunk_tokens)
            return lp, ent, loss
        lp, ent = linear_logprobs(h, self.weight, labels_BS, with_entropy=with_entropy,
                                  impl=self.impl, chunk_tokens=self.chunk_tokens)
        return lp, ent, None


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        if cfg.num_experts % ep_size:
            raise ValueError(f"ep={ep_size} does not divide num_experts={cfg.num_experts}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, ep_rank, ep_size, i) for i in range(cfg.num_layers))
        self.head = LMHead(cfg)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @contextlib.contextmanager
    def record_routes(self):
        """Within it, every forward-only pass records the experts each token was routed to;
        yields `take(rows, tokens)`, which returns the last pass's as [rows, tokens, layers,
        top_k] int64 (what routes_BSLK replays) and forgets them. Forward only: a recomputed
        block (training) would record twice."""
        routers = [m.router for m in self.moe_layers()]

        def take(rows: int, tokens: int):
            if any(len(r.recorded) != 1 for r in routers):
                raise RuntimeError("record_routes: take() expects exactly one forward since the "
                                   "last take")
            return torch.stack([r.recorded.pop().view(rows, tokens, -1) for r in routers], 2)

        for r in routers:
            r.recorded = []
        try:
            yield take
        finally:
            for r in routers:
                r.recorded = None

    def forward(self, input_ids_BS, labels_BS, positions_S=None, with_entropy: bool = False,
                policy: FusedLoss | None = None, packing: PackedRows | None = None,
                temperature_BS=None, routes_BSLK=None):
        """Returns (logprobs [B, S] fp32, entropy [B, S] or None, aux_loss scalar, policy loss or
        None); see LMHead.forward for `policy`. `packing`: the rows' samples (PackedRows, on
        this device; under context parallelism this rank's share, local_packing); its
        positions drive RoPE, so `positions_S` must then be None. Without it every row is one
        sample at positions `positions_S` (default 0..S-1). `temperature_BS`: the rollout's
        sampling temperature per position (LMHead.forward). `routes_BSLK`: router replay, per
        position and layer the experts to use (-1: the router decides), or None."""
        x_BSH, aux = self.hidden_states(input_ids_BS, positions_S, packing, routes_BSLK)
        logprobs, entropy, loss = self.head(x_BSH, labels_BS, with_entropy, policy,
                                            temperature_BS)
        return logprobs, entropy, aux, loss

    def hidden_states(self, input_ids_BS, positions_S=None, packing: PackedRows | None = None,
                      routes_BSLK=None):
        """(last block's output [B, S, H], summed balance loss). `routes_BSLK`: see forward."""
        S = input_ids_BS.shape[1]
        if packing is not None:
            if positions_S is not None:
                raise ValueError("packed rows carry their own positions: pass positions=None")
            if packing.shape != tuple(input_ids_BS.shape):
                raise ValueError(f"packing {packing.shape} does not match input ids "
                                 f"{tuple(input_ids_BS.shape)}")
            positions_S = packing.positions
        elif positions_S is None:
            positions_S = torch.arange(S, device=input_ids_BS.device)
        x_BSH = self.embed(input_ids_BS)
        cos, sin = rope_cos_sin(positions_S, self.cfg.rotary_dim, self.cfg.rope_theta, x_BSH.dtype)
        aux = x_BSH.new_zeros((), dtype=torch.float32)
        if routes_BSLK is not None and tuple(routes_BSLK.shape[:3]) != (
                *input_ids_BS.shape, len(self.layers)):
            raise ValueError(f"routes {tuple(routes_BSLK.shape)} must be [rows, tokens, layers, "
                             f"top_k] for input ids {tuple(input_ids_BS.shape)} and "
                             f"{len(self.layers)} layers")
        for i, layer in enumerate(self.layers):
            if routes_BSLK is None:
                x_BSH, layer_aux = layer(x_BSH, cos, sin, packing)
            else:
                x_BSH, layer_aux = layer(x_BSH, cos, sin, packing, routes_BSLK[:, :, i])
            aux = aux + layer_aux
        return x_BSH, aux

    @torch.no_grad()
    def logits(self, input_ids_BS, positions_S=None, packing: PackedRows | None = None):
        """Full [B, S, V] logits: for parity checks and small evaluations only (training never
        materialises them)."""
        x_BSH, _ = self.hidden_states(input_ids_BS, positions_S, packing)
        return self.head.norm(x_BSH) @ self.head.weight.T

    def init_weights(self, seed: int = 0):
        init_params(self, self.cfg, seed)


@torch.no_grad()
def init_params(root: nn.Module, cfg: ModelConfig, seed: int = 0):
    """Deterministic init independent of layout: each parameter draws from a generator seeded by
    (seed, its name); expert stacks are drawn at full [E, ...] size and sliced, so a rank holding
    experts [a, b) gets exactly the rows a one-rank model holds there. Recompute wrappers
    ("block.") do not change a parameter's identity."""
    for name, p in root.named_parameters():
        owner = root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root
        if isinstance(owner, (RMSNorm, GatedRMSNorm)):
            owner.reset_parameters()
            continue
        key = name.replace("block.", "")
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        if isinstance(owner, GatedDeltaNet) and name.rsplit(".", 1)[1] in ("A_log", "dt_bias"):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log())
            else:
                p.fill_(1.0)
            continue
        if isinstance(owner, GroupedExperts):
            full = (cfg.num_experts,) + tuple(p.shape[1:])
            w = torch.empty(full, device=p.device, dtype=p.dtype).normal_(0, cfg.init_std, generator=gen)
            p.copy_(w[owner.first_expert:owner.first_expert + owner.num_local])
        else:
            p.normal_(0, cfg.init_std, generator=gen)
    for m in root.modules():
        if isinstance(m, MoE):
            m.router.expert_bias.zero_()
