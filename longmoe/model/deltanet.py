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
from longmoe.ops.compiled import compile_unavailable, compiled
from longmoe.ops.gated_delta import gated_delta_rule
from longmoe.ops.kernels import triton_ready
from longmoe.ops.norm import gated_rms_norm, norm_ops  # noqa: F401  (its reference, re-exported)


def causal_conv_silu(x_BSC, w_CK, halo_BKC=None, history_BS=None):
    """SiLU(depthwise causal conv) as K shifted multiply-adds in the [B, S, C] layout, summed in
    fp32 (or wider): the same as F.conv1d over the transposed input with K-1 zeros (or `halo`) in
    front, without the transposes, and fusable. The GPU path compiles it: F.conv1d's depthwise
    kernel took 5.8 ms forward at 64K tokens x 8192 channels on an H200, ~10x the time its bytes
    need. The eager path of unpacked rows stays F.conv1d (autograd would keep K fp32 copies of
    the input here). `history_BS` (packed rows): tokens since each token's sample began; a tap
    reaching further back reads zero, so no sample sees another's inputs."""
    K, S = w_CK.shape[1], x_BSC.shape[1]
    xp = F.pad(x_BSC, (0, 0, K - 1, 0)) if halo_BKC is None else torch.cat([halo_BKC, x_BSC], 1)
    acc = torch.promote_types(x_BSC.dtype, torch.float32)
    w = w_CK.to(acc)
    y = None
    for j in range(K):
        back = K - 1 - j  # this tap reads the input `back` tokens earlier
        tap = xp[:, j:j + S].to(acc)
        if history_BS is not None and back:
            tap = tap * (history_BS >= back)[..., None].to(acc)
        y = tap * w[:, j] if y is None else y + tap * w[:, j]
    return F.silu(y).to(x_BSC.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim (weight initialised to one), then times SiLU(gate). `fused`:
    through the "norm" registry (ops/norm.py, `impl` = impl.norm: our Triton kernels on GPUs,
    or torch.compile's); else the eager function."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.impl = "auto"

    def forward(self, x, gate, fused: bool = False, dtype=None):
        if not fused:
            return gated_rms_norm(x, gate, self.weight, self.eps, dtype)
        ops = norm_ops(self.impl, x, self.weight, gate=gate)
        return ops.gated_rms_norm(x, gate, self.weight, self.eps, dtype)

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
        self.cp = None  # a parallel.context_parallel.ContextParallel when the sequence is split

    def reset_parameters(self, gen: torch.Generator):
        """The non-matrix parameters: A = exp(A_log) uniform in [1, 16], dt_bias = 1."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.Hv, device=self.A_log.device).uniform_(
                1.0, 16.0, generator=gen).log())
            self.dt_bias.fill_(1.0)

    def _fused(self, x) -> bool:
        """Compile the conv on GPUs where our conv kernels do not run, unless an eager core was
        asked for."""
        return self.impl not in ("chunked", "reference") and not compile_unavailable(x.device)

    def _conv(self, qkv_BSC, halo_BKC=None, history_BS=None):
        """Depthwise causal conv + SiLU; `halo` = the K-1 inputs before this span (else zeros);
        `history` (packed rows): tokens since each token's sample began. Where Triton kernels
        run (GPUs; CPU under TRITON_INTERPRET=1) our kernels, ops/kernels/causal_conv.py
        (against the compiled conv: results/h200/causal_conv.json); else, on GPUs, compiled. The
        compiled core ("chunked_compiled") keeps the compiled conv beside it, an eager core the
        eager conv. The kernels return q, k and v as three contiguous tensors (the core would
        copy v's column slice, and the slices' gradients would be concatenated); the other
        paths one [B, S, C] tensor. _split takes either."""
        w_CK = self.conv1d.weight[:, 0]
        kernel_dtypes = {torch.float32, torch.bfloat16, torch.float16}  # fp64 (tests) is not
        if (self.impl not in ("chunked", "reference", "chunked_compiled")
                and triton_ready(qkv_BSC.device) is None and 2 <= self.kernel <= 8  # its taps
                and {qkv_BSC.dtype, w_CK.dtype} <= kernel_dtypes):
            from longmoe.ops.kernels.causal_conv import causal_conv_silu_triton
            kd = self.Hk * self.dk
            return causal_conv_silu_triton(qkv_BSC, w_CK, halo_BKC, history_BS,
                                           split=(kd, kd, self.Hv * self.dv))
        if self._fused(qkv_BSC):
            # the token dim of x and history is symbolic: one graph for every row length
            # (the halo's K-1 tokens are not a row's)
            return compiled(causal_conv_silu, token_dims={0: 1, 3: 1})(qkv_BSC, w_CK, halo_BKC,
                                                                       history_BS)
        if history_BS is not None:  # per-tap masks: F.conv1d has no way to take them
            return causal_conv_silu(qkv_BSC, w_CK, halo_BKC, history_BS)
        x = qkv_BSC.transpose(1, 2)  # eager: F.conv1d keeps only its input for backward
        x = F.pad(x, (self.kernel - 1, 0)) if halo_BKC is None else \
            torch.cat([halo_BKC.transpose(1, 2), x], -1)
        return F.silu(F.conv1d(x, self.conv1d.weight, groups=self.conv_dim)).transpose(1, 2)

    def _split(self, qkv):
        """q, k, v heads of the conv's output: one [B, S, C] tensor, or (q, k, v) already."""
        if isinstance(qkv, tuple):
            q, k, v = qkv
        else:
            kd = self.Hk * self.dk
            q, k, v = qkv.split([kd, kd, self.Hv * self.dv], dim=-1)
        B, S, _ = q.shape
        return (q.reshape(B, S, self.Hk, self.dk), k.reshape(B, S, self.Hk, self.dk),
                v.reshape(B, S, self.Hv, self.dv))

    def forward(self, x_BSH, cos=None, sin=None, packing=None):
        """`packing` (longmoe.model.packing.PackedRows, or None for one sample per row): the
        state and the conv restart where each sample begins."""
        B, S, _ = x_BSH.shape
        beta = torch.sigmoid(self.in_proj_b(x_BSH))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BSH).float() + self.dt_bias)
        qkv = self.in_proj_qkv(x_BSH)
        if self.cp is not None:
            o = self._forward_cp(qkv, g, beta, packing)
        elif packing is not None:
            q, k, v = self._split(self._conv(qkv, history_BS=packing.history))
            o, _ = gated_delta_rule(q, k, v, g, beta, impl=self.impl, starts=packing.starts,
                                    cu_seqlens=packing.cu_seqlens, out_dtype=x_BSH.dtype)
        else:
            q, k, v = self._split(self._conv(qkv))
            o, _ = gated_delta_rule(q, k, v, g, beta, impl=self.impl, out_dtype=x_BSH.dtype)
        z = self.in_proj_z(x_BSH).reshape(B, S, self.Hv, self.dv)
        # the registry's norm (impl.norm) unless an eager core was asked for
        o = self.norm(o, z, fused=self.impl not in ("chunked", "reference"), dtype=x_BSH.dtype)
        return self.out_proj(o.reshape(B, S, -1))

    def _forward_cp(self, qkv_BsC, g_BsV, beta_BsV, packing=None):
        """Context parallel over the zigzag split: this rank holds sequence pieces j0 < j1.

        1. conv halo: every piece's last K-1 inputs are gathered; piece j's conv reads piece
           j-1's (zeros for the first piece).
        2. summaries: each local piece runs the rule from a zero state with extra value columns
           started at the identity, which yields its affine state map S_end = A S_start + B in
           one pass (columns of the state evolve independently).
        3. the [A | B] of all 2*cp pieces are gathered and composed in sequence order, giving
           each local piece its true initial state, from which it is recomputed.
        All steps are differentiable (the gathers reduce-scatter their gradients).
        Packed rows (`packing`, this rank's share): the conv masks by the whole rows' history,
        halo included, and a sample starting inside a piece resets the state there; in step 2
        that zeroes the identity columns too, so A = 0: the piece's end state no longer depends
        on its start state, which the composition then passes on exactly."""
        cp, K = self.cp, self.kernel - 1
        B, s, _ = qkv_BsC.shape
        P = s // 2
        if P < K:
            raise ValueError(f"context parallel pieces of {P} tokens are shorter than the "
                             f"conv's {K}-token history")
        pieces = [slice(0, P), slice(P, s)]
        tails = torch.stack([qkv_BsC[:, sl][:, -K:] for sl in pieces])     # [2, B, K, C]
        all_tails = cp.gather_pieces(tails)                                # [2cp, B, K, C]
        ins, starts = [], []
        for sl, j in zip(pieces, cp.local_pieces()):
            halo = all_tails[j - 1] if j > 0 else None
            history = None if packing is None else packing.history[:, sl]
            q, k, v = self._split(self._conv(qkv_BsC[:, sl], halo, history))
            ins.append((q, k, v, g_BsV[:, sl], beta_BsV[:, sl]))
            starts.append(None if packing is None else packing.starts[:, sl])
        dk, dv = self.dk, self.dv
        eye = torch.eye(dk, device=qkv_BsC.device).expand(B, self.Hv, dk, dk)
        init = torch.cat([eye, eye.new_zeros(B, self.Hv, dk, dv)], -1)    # [I | 0]
        summaries = []
        for (q, k, v, g, beta), st in zip(ins, starts):
            v_ext = torch.cat([v.new_zeros(v.shape[:-1] + (dk,)), v], -1)
            _, S = gated_delta_rule(q, k, v_ext, g, beta, initial_state=init, impl=self.impl,
                                    starts=st)
            summaries.append(S)                                            # [A | B]
        every = cp.gather_pieces(torch.stack(summaries))                   # [2cp, B, Hv, dk, dk+dv]
        begin, state = {}, None
        for j in range(max(cp.local_pieces()) + 1):
            begin[j] = state
            A, Bm = every[j][..., :dk], every[j][..., dk:]
            state = Bm if state is None else A @ state + Bm
        outs = []
        for (q, k, v, g, beta), st, j in zip(ins, starts, cp.local_pieces()):
            o, _ = gated_delta_rule(q, k, v, g, beta, initial_state=begin[j], impl=self.impl,
                                    starts=st)
            outs.append(o)
        return torch.cat(outs, 1)
