"""The RL policy loss on the LM head with fused gradients: the objective
(longmoe/rl/objective.py) gives each token's loss and its derivatives with respect to the
token's log-prob and entropy once the forward has seen the chunk, so dH and dW are computed in
the forward pass, chunk by chunk (linear_ce_chunks.FusedGrad), and the backward only scales
them by the incoming gradient. The logits are computed once: 6*T*H*V FLOPs instead of 8. Only
O(T) per-token scalar math depends on the objective; the [C, V] work is the same for every
setting. (CE with mean/sum reduction takes the same path, in linear_ce.py.)

Legend: T tokens, H hidden, V vocab, C tokens in a chunk.
"""

from __future__ import annotations

from longmoe.ops.linear_ce import LINEAR_CE, linear_logprobs
from longmoe.ops.linear_ce_chunks import (FusedGrad, check_inputs, check_label_range,
                                          engine_chunk_tokens)
from longmoe.ops.linear_ce_engines import ENGINES
from longmoe.ops.registry import Registry
from longmoe.rl.objective import Objective, TokenInputs

POLICY_LOSS = Registry("policy_loss")


def _objective_weights(objective: Objective, x_T: TokenInputs, valid_T):
    def weights(sl, lp_C, ent_C, lse_C):
        loss_C, w_lp_C, w_ent_C = objective.token_loss_grads(lp_C, ent_C, x_T.map(lambda t: t[sl]),
                                                             valid_T[sl])
        return loss_C, w_lp_C, w_ent_C, None
    return weights


def _policy_check(h, w, labels, *a):
    return LINEAR_CE.why_not("triton", h, w, labels)


def _run_fused(engine, h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk):
    chunk = chunk or engine_chunk_tokens(engine, h_TH.shape[0], w_VH.shape[0], h_TH.dtype)
    weights = _objective_weights(objective, x_T, labels_T != ignore_index)
    return FusedGrad.apply(h_TH, w_VH, labels_T, ignore_index, chunk, True, engine, weights)


@POLICY_LOSS.register("fused", priority=10, check=_policy_check)
def _fused_policy(h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk):
    return _run_fused(ENGINES["triton"], h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk)


# The in-place layouts of linear_ce.py (triton_inplace, triton_lowp): the gradient written over
# the logits chunk, dW accumulated in the weight's dtype.
def _register_layout(name, engine, priority, check=None):
    def fn(h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk):
        return _run_fused(ENGINES[engine], h_TH, w_VH, labels_T, objective, x_T, ignore_index,
                          chunk)
    POLICY_LOSS.register(name, priority=priority, **({"check": check} if check else {}))(fn)


_register_layout("fused_inplace", "triton_inplace", 20, _policy_check)
_register_layout("fused_lowp", "triton_lowp", 8, _policy_check)
_register_layout("fused_inplace_torch", "torch_inplace", 3)
_register_layout("fused_lowp_torch", "torch_lowp", 2)


@POLICY_LOSS.register("fused_torch", priority=5)
def _fused_torch_policy(h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk):
    return _run_fused(ENGINES["torch"], h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk)


@POLICY_LOSS.register("reference", priority=0, reference=True)
def _reference_policy(h_TH, w_VH, labels_T, objective, x_T, ignore_index, chunk):
    lp, ent = linear_logprobs(h_TH, w_VH, labels_T, ignore_index=ignore_index, with_entropy=True,
                              impl="reference")
    loss = objective.token_loss(lp, ent, x_T, labels_T != ignore_index).sum()
    return loss, lp.detach(), ent.detach()


def linear_policy_loss(hidden, weight, labels, objective: Objective, inputs: TokenInputs, *,
                       ignore_index: int = -100, impl: str = "auto",
                       chunk_tokens: int | None = None):
    """The objective's loss, sum_t w_t loss_t, on logits = hidden @ weight.T without holding
    them: `inputs` are shaped like `labels` (their `weights` carry the aggregation mode and the
    global normaliser). Returns (loss, logprobs, entropy); the last two are detached, for
    logging and statistics."""
    check_inputs(hidden, weight, labels)
    inputs.check(labels.shape, objective)
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    check_label_range(labels_T, weight.shape[0], ignore_index)
    x_T = inputs.map(lambda t: t.reshape(-1))
    chosen = POLICY_LOSS.select(impl, h_TH, weight, labels_T)
    loss, lp, ent = chosen.fn(h_TH, weight, labels_T, objective, x_T, ignore_index, chunk_tokens)
    return loss, lp.reshape(labels.shape), ent.reshape(labels.shape)
