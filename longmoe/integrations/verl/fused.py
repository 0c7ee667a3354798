"""The fast path: verl's `ppo_loss` computed inside longmoe's LM head.

When the loss verl hands the engine is its own `ppo_loss` (functools.partial(ppo_loss,
config=actor_config)) with settings longmoe's objective computes identically (the vanilla
clipped surrogate with verl's dual clip, token-mean, no entropy or KL term, no rollout
importance weights, no entropy requested), the engine runs longmoe's fused linear-CE policy loss
(longmoe.train.step.forward_backward) on the micro-batch instead of returning log-probs for
verl's loss: the same loss and gradient, without the [tokens] log-prob graph that verl's loss
would differentiate. Per verl token t of a response (r = exp(logp - old), A the advantage):

  verl   max(-A r, -A clip(r, 1-lo, 1+hi)), then min(., -c A) where A < 0   (clip_ratio_c = c)
  ours   -min(r A, clip(r, 1-lo, 1+hi) A), then min(., -c A) where A < 0    (dual_clip_c = c)

verl clamps logp - old to [-20, 20] before the exp; ours does not (a ratio beyond e^20 is
outside anything PPO's clip lets through, and the clipped branch is then active either way).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from longmoe.data.packing import pack_rows
from longmoe.integrations.verl.batch import routed_values, temperatures
from longmoe.data.sample import Sample
from longmoe.train.feed import min_row, pad_multiple
from longmoe.train.setup import set_cp_row_length
from longmoe.train.step import forward_backward, local_micro_batch

NEEDED = ("prompts", "responses", "attention_mask", "response_mask", "advantages",
          "old_log_probs")


def fused_run(loss_function, run, data):
    """The RunConfig whose objective is `loss_function` (verl's ppo_loss with matching
    settings), or None when the loss must run as verl's own code."""
    if not (isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss):
        return None
    cfg = loss_function.keywords.get("config")
    if cfg is None or run.loss.type != "grpo" or run.impl.policy_loss == "unfused":
        return None
    if (cfg.policy_loss.get("loss_mode", "vanilla") != "vanilla"
            or cfg.loss_agg_mode != "token-mean" or cfg.entropy_coeff or cfg.use_kl_loss
            or cfg.loss_scale_factor is not None):
        return None
    if tu.get_non_tensor_data(data, "calculate_entropy", False) or "rollout_is_weights" in data:
        return None
    if not all(k in data.keys() and not data[k].is_nested for k in NEEDED):
        return None
    lo = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    hi = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    loss = replace(run.loss, clip_low=float(lo), clip_high=float(hi),
                   dual_clip_c=float(cfg.get("clip_ratio_c", 3.0)), entropy_coef=0.0,
                   kl_coef=0.0, tis_cap=0.0, loss_agg_mode="token-mean")
    return replace(run, loss=loss)


def micro_samples(mb, replay: bool = False) -> list[Sample]:
    """verl's padded per-sample fields of a micro-batch as longmoe samples: prompt and response
    split where the attention mask says, the response mask as the loss mask; `replay`: with the
    micro-batch's routed_experts."""
    ids = mb["input_ids"]
    offsets = ids.offsets().tolist()
    values = ids.values().detach().cpu().long()
    att = mb["attention_mask"].cpu()
    P = mb["prompts"].shape[1]
    plen, rlen = att[:, :P].sum(1).tolist(), att[:, P:].sum(1).tolist()
    adv, old = mb["advantages"].float().cpu(), mb["old_log_probs"].float().cpu()
    mask = mb["response_mask"].cpu().bool()
    temps = temperatures(mb)
    routes = routed_values(mb) if replay else None
    out = []
    for i, (a, p, r) in enumerate(zip(offsets, plen, rlen)):
        out.append(Sample(values[a:a + p], values[a + p:a + p + r], advantage=adv[i, :r].clone(),
                          old_logprobs=old[i, :r].clone(), loss_mask=mask[i, :r].clone(),
                          temperature=1.0 if temps is None else temps[i],
                          routed_experts=None if routes is None else routes[a:a + p + r],
                          index=i, where=f"micro-batch sample {i}"))
    return out


def fused_micro_step(pt, mb, run, global_tokens: int, dp_size: int, micro_batches: int,
                     replay: bool = False):
    """Forward and backward of one micro-batch through the fused head (gradients added), and
    verl's ppo_loss metrics for it. Returns (loss, aux, output entry) like the engine's
    unfused micro-step, the backward already done."""
    samples = micro_samples(mb, replay)
    pb = pack_rows([samples], pad_multiple=pad_multiple(run), min_len=min_row(run))
    layout = pt.layout
    batch, positions, packing = local_micro_batch(pb, layout, pt.device)
    if layout.cp > 1:
        set_cp_row_length(pt.model, layout, int(pb.input_ids.shape[1]))
    loss, aux, st = forward_backward(pt.model, batch, run, layout, global_tokens, positions,
                                     None, packing, finish=False, aux_scale=1.0 / micro_batches)
    # This rank's tokens' sums (its CP slice): the loss and the statistics of the micro-batch
    # are their sum over the CP group.
    sums = torch.stack([loss.detach().double()] + [
        st[k].detach().double() if k in st else torch.zeros((), dtype=torch.float64,
                                                             device=loss.device)
        for k in ("clip_frac", "dual_clip_frac", "logprob_sum")])
    if layout.cp > 1:
        dist.all_reduce(sums, group=layout.cp_group)
    total, clip, lower, logp = sums.tolist()
    n = pb.trained_tokens
    old = sum(float(s.old_logprobs[s.loss_mask].sum()) for s in samples)
    pg_loss = total * dp_size  # verl's pg_loss carries dp_size (gradients average over ranks)
    metrics = {
        "actor/pg_clipfrac": Metric(value=clip / n if n else 0.0,
                                    aggregation=AggregationType.MEAN),
        "actor/ppo_kl": Metric(value=(old - logp) / n if n else 0.0,
                               aggregation=AggregationType.MEAN),
        "actor/pg_clipfrac_lower": Metric(value=lower / n if n else 0.0,
                                          aggregation=AggregationType.MEAN),
        "actor/pg_loss": Metric(value=pg_loss, aggregation=AggregationType.SUM),
    }
    return loss, aux, {"model_output": {}, "loss": pg_loss, "metrics": metrics}
