"""Dense building blocks: RMSNorm, rotary embedding (partial rotary), grouped-query attention.

Legend: B batch, S sequence, H hidden, N query heads, K kv heads, D head dim, R rotary dims.
"""

from __future__ import annotations

import torch
from torch import nn

from longmoe.config import ModelConfig
from longmoe.ops.attention import Attention as SDPA
# the norms' eager references live with their registry (re-exported here, where they were)
from longmoe.ops.norm import apply_rope, norm_ops, norm_rope, rms_norm  # noqa: F401


class RMSNorm(nn.Module):
    """rms_norm through the "norm" registry (ops/norm.py, `impl` = impl.norm): on GPUs our Triton
    kernels, one each way (eagerly its fp32 casts, powers and products took ~0.1 s of a 1.5 s
    step at 64K tokens on an H200), or torch.compile's (impl.norm=compiled); on CPU eagerly."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.impl = "auto"

    def forward(self, x):
        return norm_ops(self.impl, x, self.weight).rms_norm(x, self.weight, self.eps,
                                                            self.unit_offset)

    def with_rope(self, x_BSND, cos, sin):
        """The norm, then RoPE (apply_rope) as one piece, so the rotation's slices and
        concatenations fuse into the norm's kernel instead of copying q and k. x may be a
        strided view (q beside the output gate): the Triton kernels read it in place."""
        ops = norm_ops(self.impl, x_BSND, self.weight, cos=cos, sin=sin)
        return ops.norm_rope(x_BSND, self.weight, self.eps, self.unit_offset, cos, sin)

    def reset_parameters(self):
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype):
    """cos/sin [S, R] for positions [S] shared by every row, or [B, S, R] for per-token positions
    [B, S] (packed rows restart them per sample); rotate-half convention (frequencies repeated
    over both halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=positions.device,
                                            dtype=torch.float64) / rotary_dim)
    ang = positions.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        # With the output gate, q_proj emits [q_head0, gate_head0, q_head1, ...] (per-head halves).
        self.q_proj = nn.Linear(h, n * d * (2 if cfg.attn_output_gate else 1), bias=False)
        self.k_proj = nn.Linear(h, k * d, bias=False)
        self.v_proj = nn.Linear(h, k * d, bias=False)
        self.o_proj = nn.Linear(n * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.cp = None  # a parallel.context_parallel.ContextParallel when the sequence is split
        self.sdpa = SDPA()  # impl.attention: the SDPA backend order (longmoe.ops.attention)

    def forward(self, x_BSH, cos_SR, sin_SR, packing=None):
        """`packing` (longmoe.model.packing.PackedRows, or None for one sample per row): the
        rows' samples; attention stays inside each."""
        q_BSND, k_BSKD, v_BSKD, gate_BSND = self.project(x_BSH, cos_SR, sin_SR)
        return self.output(self.core(q_BSND, k_BSKD, v_BSKD, packing), gate_BSND)

    def project(self, x_BSH, cos_SR, sin_SR):
        """(q, k, v, sigmoid of the output gate or None): the projections, q/k norms and RoPE."""
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = self.q_proj(x_BSH)
        gate_BSND = None
        if cfg.attn_output_gate:
            q, gate_BSND = q.view(B, S, n, 2 * d).chunk(2, dim=-1)
            gate_BSND = torch.sigmoid(gate_BSND)
        q_BSND = q.reshape(B, S, n, d)
        k_BSKD = self.k_proj(x_BSH).view(B, S, k, d)
        v_BSKD = self.v_proj(x_BSH).view(B, S, k, d)
        if cfg.qk_norm:
            q_BSND = self.q_norm.with_rope(q_BSND, cos_SR, sin_SR)
            k_BSKD = self.k_norm.with_rope(k_BSKD, cos_SR, sin_SR)
        else:
            q_BSND, k_BSKD = apply_rope(q_BSND, cos_SR, sin_SR), apply_rope(k_BSKD, cos_SR, sin_SR)
        return q_BSND, k_BSKD, v_BSKD, gate_BSND

    def core(self, q_BSND, k_BSKD, v_BSKD, packing=None):
        """The attention kernel: [B, S, N, D] out. Under context parallelism the local queries
        attend the CP group's gathered keys and values."""
        n, k = self.cfg.num_heads, self.cfg.num_kv_heads
        if self.cp is not None:
            k_BSKD, v_BSKD = self.cp.gather_kv(k_BSKD), self.cp.gather_kv(v_BSKD)
            return self.cp.attention(q_BSND, k_BSKD, v_BSKD, enable_gqa=n != k, sdpa=self.sdpa,
                                     packing=packing)
        if packing is not None:
            return self.sdpa.packed(q_BSND, k_BSKD, v_BSKD, packing.span())
        return self.sdpa(q_BSND.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2),
                         is_causal=True, enable_gqa=n != k).transpose(1, 2)

    def output(self, o_BSND, gate_BSND=None):
        """The gated output projection; `gate_BSND` is already through its sigmoid."""
        B, S = o_BSND.shape[:2]
        if gate_BSND is not None:
            o_BSND = o_BSND * gate_BSND
        return self.o_proj(o_BSND.reshape(B, S, -1))
