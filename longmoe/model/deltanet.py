"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 / Qwen3-Next hybrid layers.

x -> in_proj_qkv -> depthwise causal conv (kernel 4) -> SiLU -> q, k, v heads
x -> in_proj_a, in_proj_b -> per value head decay g = -exp(A_log) * softplus(a + dt_bias) and
     write strength beta = sigmoid(b)
(q, k, v, g, beta) -> gated delta rule (longmoe.ops.gated_delta) -> o
o -> RMSNorm per head (plain weight) times SiLU(in_proj_z x) -> out_proj

Parameter names and shapes follow the Hugging Face checkpoints (`linear_attn.*`), so loading
needs no reshaping. Legend: B batch, S sequence, H hidden, Hk/Hv key/value heads, dk/dv dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longmoe.config import ModelConfig
from longmoe.ops.gated_delta import gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim (weight initialised to one), then times SiLU(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kd, vd = self.Hk * self.dk, self.Hv * self.dv
        self.conv_dim = 2 * kd + vd
        self.kernel = cfg.linear_conv_kernel
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, vd, bias=False)
        self.in_proj_b = nn.Linear(h, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(vd, h, bias=False)
        self.impl = "auto"
        self.cp = None  # context parallel: not supported for linear attention yet

    def reset_parameters(self, gen: torch.Generator):
        """The non-matrix parameters: A = exp(A_log) uniform in [1, 16], dt_bias = 1."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.Hv, device=self.A_log.device).uniform_(
                1.0, 16.0, generator=gen).log())
            self.dt_bias.fill_(1.0)

    def forward(self, x_BSH, cos=None, sin=None):
        B, S, _ = x_BSH.shape
        qkv = self.in_proj_qkv(x_BSH).transpose(1, 2)                     # [B, conv_dim, S]
        qkv = F.conv1d(F.pad(qkv, (self.kernel - 1, 0)), self.conv1d.weight,
                       groups=self.conv_dim)
        qkv = F.silu(qkv).transpose(1, 2)
        kd = self.Hk * self.dk
        q, k, v = qkv.split([kd, kd, self.Hv * self.dv], dim=-1)
        q = q.reshape(B, S, self.Hk, self.dk)
        k = k.reshape(B, S, self.Hk, self.dk)
        v = v.reshape(B, S, self.Hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x_BSH))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BSH).float() + self.dt_bias)
        o, _ = gated_delta_rule(q, k, v, g, beta, impl=self.impl)
        z = self.in_proj_z(x_BSH).reshape(B, S, self.Hv, self.dv)
        o = self.norm(o.to(x_BSH.dtype), z)
        return self.out_proj(o.reshape(B, S, -1))
