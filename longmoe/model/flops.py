"""FLOPs accounting for one training step: model FLOPs (what the math needs) and hardware FLOPs
(what the GPU executes, with recompute), per the transformer as longmoe builds it.

Per token and layer, forward (a multiply-add is 2 FLOPs):
  attention projections  2*H*(q_out + 2*K*D) + 2*N*D*H        (q_out = N*D, doubled with the gate)
  attention core         4*N*D*ctx, ctx = (S+1)/2 for causal attention over a sequence of S
  router                 2*H*E
  routed experts         top_k * 6*H*F                        (gate+up: 4*H*F, down: 2*F*H)
  shared expert          6*H*Fs + 2*H                         (and its sigmoid gate)
A linear_attention (Gated DeltaNet) layer replaces the attention terms by
  projections            2*H*(2*Kd + 2*Vd + 2*Hv) + 2*Vd*H    (qkv, z, a, b in; out)
  short conv             2*(2*Kd + Vd)*kernel
  gated delta core       Hv*(6*dk*dv + 2*C*(2*dk + dv) + C*(dk + dv)), C = 64 (chunked form:
                         state read/correct/write, intra-chunk QK^T, KK^T and A@U, the solve)
and once per token the LM head 2*H*V. Training is 3x forward (backward = 2x). Full recompute runs
each block's forward again (+1x the layers, not the head: linear CE is not recomputed; with
keep_attention not the attention cores of full-attention layers either); selective
recompute keeps every matmul/attention output and re-runs only memory-bound ops, which add no
matmul FLOPs (counted as 0 here). The routed experts' combine (a router-weighted sum of K rows
per token) is memory-bound row work, not a matmul (ops/moe_rows.py), and is not counted either:
2*K*H a token, 0.07% of the experts' FLOPs at F = 512.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from longmoe.config import ModelConfig
from longmoe.plan.hardware import profile_for_device


@dataclass(frozen=True)
class StepFlops:
    model: float            # 3 x forward, the MFU numerator
    hardware: float         # what runs, recompute included
    forward_layers: float   # all blocks, attention core included
    forward_head: float
    forward_attn_core: float


def attention_core_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    ctx = (seq_len + 1) / 2 if causal else seq_len
    return 4 * cfg.num_heads * cfg.head_dim * ctx


GDN_CHUNK = 64


def linear_attention_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(projections + conv, gated delta core) of one Gated DeltaNet layer, per token."""
    H, Hv = cfg.hidden_size, cfg.linear_num_value_heads
    dk, dv, C = cfg.linear_key_head_dim, cfg.linear_value_head_dim, GDN_CHUNK
    Kd, Vd = cfg.linear_num_key_heads * dk, Hv * dv
    proj = 2 * H * (2 * Kd + 2 * Vd + 2 * Hv) + 2 * Vd * H + 2 * (2 * Kd + Vd) * cfg.linear_conv_kernel
    core = Hv * (6 * dk * dv + 2 * C * (2 * dk + dv) + C * (dk + dv))
    return proj, core


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True,
                                  layer_type: str = "full_attention") -> float:
    H, N, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if layer_type == "linear_attention":
        proj, core = linear_attention_flops_per_token(cfg)
    else:
        q_out = N * D * (2 if cfg.attn_output_gate else 1)
        proj = 2 * H * (q_out + 2 * K * D) + 2 * N * D * H
        core = attention_core_flops_per_token(cfg, seq_len, causal)
    router = 2 * H * cfg.num_experts
    routed = cfg.top_k * 6 * H * cfg.moe_ffn_size
    shared = (6 * H * cfg.shared_expert_ffn_size + 2 * H) if cfg.shared_expert_ffn_size else 0
    return proj + core + router + routed + shared


def step_flops(cfg: ModelConfig, tokens: int, seq_len: int, recompute="none",
               causal: bool = True, lengths: Sequence[int] | None = None,
               keep_attention: bool = False) -> StepFlops:
    """FLOPs of one fwd+bwd over `tokens` tokens arranged in sequences of `seq_len`;
    `recompute` is one policy or one per layer. `lengths`: the tokens are instead samples of
    these lengths (packed rows: attention is per sample, so its core costs the sum over samples
    of length x (length + 1) / 2 pairs; `tokens` and `seq_len` are then ignored).
    `keep_attention` (parallel.keep_attention): fully recomputed full-attention layers do not
    run their attention core again."""
    groups = Counter(int(n) for n in lengths if n > 0) if lengths is not None else \
        {seq_len: tokens / seq_len if seq_len else 0}
    policies = [recompute] * cfg.num_layers if isinstance(recompute, str) else list(recompute)
    n_tok = sum(L * c for L, c in groups.items())
    per_layer, cores = [], []
    for i in range(cfg.num_layers):
        kind = cfg.layer_type(i)
        per_layer.append(sum(layer_forward_flops_per_token(cfg, L, causal, kind) * L * c
                             for L, c in groups.items()))
        cores.append(sum((attention_core_flops_per_token(cfg, L, causal) if kind == "full_attention"
                          else linear_attention_flops_per_token(cfg)[1]) * L * c
                         for L, c in groups.items()))
    layers, core = sum(per_layer), sum(cores)
    head = 2 * cfg.hidden_size * cfg.vocab_size * n_tok
    model = 3 * (layers + head)
    extra = sum(f - (c if keep_attention and cfg.layer_type(i) == "full_attention" else 0)
                for i, (f, c, p) in enumerate(zip(per_layer, cores, policies)) if p == "full")
    return StepFlops(model=model, hardware=model + extra, forward_layers=layers, forward_head=head,
                     forward_attn_core=core)


def balance_crossover(cfg: ModelConfig) -> float:
    """The sample length at which causal attention's work equals the per-token work of the
    whole model, from the forward FLOPs above: the `crossover` of longmoe.data.balance's
    sample cost (L + L^2 / crossover; inf without full attention)."""
    pair = 4 * cfg.num_heads * cfg.head_dim * sum(cfg.layer_type(i) == "full_attention"
                                                  for i in range(cfg.num_layers))
    per_token = 2 * cfg.hidden_size * cfg.vocab_size
    for i in range(cfg.num_layers):
        kind = cfg.layer_type(i)
        f = layer_forward_flops_per_token(cfg, 0, True, kind)
        per_token += f - (attention_core_flops_per_token(cfg, 0) if kind == "full_attention" else 0)
    # causal attention costs pair * L^2 / 2 a sample (L(L+1)/2 pairs)
    return 2 * per_token / pair if pair > 0 else float("inf")


def dense_peak_flops(probe: dict) -> float | None:
    """bf16 dense peak of the device a backend probed, from the hardware profiles (None on CPU
    or for a device without a profile)."""
    hw = profile_for_device(str(probe.get("device_name") or ""))
    return hw.bf16_dense_tflops * 1e12 if hw else None
