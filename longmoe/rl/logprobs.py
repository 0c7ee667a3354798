"""Forward-only per-token log-probs (and entropy) of the labels, for a PPO/GRPO step's old and
reference log-probs and for checking a rollout engine's numbers after a weight hand-off.

The LM head's linear cross-entropy computes them chunk by chunk, so [tokens, vocab] logits never
exist. Every rank calls this with its own batch (the MoE's all-to-alls and FSDP's all-gathers run
inside the model), the same way the training step calls the model.
"""

from __future__ import annotations

import torch

from longmoe.errors import UserError


def _check(model, input_ids, labels, positions, packing, values: bool = True, temperature=None,
           routes=None):
    """Host-side checks, before the first collective, so a bad batch stops every rank cleanly
    instead of leaving its peers waiting in an all-gather. `values`: the token ids' ranges too
    (on a device tensor each read waits for the device's queue)."""
    V = model.cfg.vocab_size
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point \
                or t.dtype == torch.bool:
            raise UserError(f"compute_logprobs: {name} must be an integer tensor [rows, tokens], "
                            f"got {getattr(t, 'dtype', type(t).__name__)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
    if labels.shape != input_ids.shape:
        raise UserError(f"compute_logprobs: labels {tuple(labels.shape)} and input_ids "
                        f"{tuple(input_ids.shape)} differ in shape")
    if values:
        _check_ranges(input_ids, labels, V)
    if positions is not None and tuple(positions.shape) != (input_ids.shape[1],):
        raise UserError(f"compute_logprobs: positions {tuple(positions.shape)} must be "
                        f"[{input_ids.shape[1]}] (one per token of a row)")
    if packing is not None and tuple(packing.shape) != tuple(input_ids.shape):
        raise UserError(f"compute_logprobs: packing {tuple(packing.shape)} does not match "
                        f"input_ids {tuple(input_ids.shape)}")
    if temperature is not None:
        if not isinstance(temperature, torch.Tensor) or tuple(temperature.shape) != \
                tuple(input_ids.shape) or not temperature.dtype.is_floating_point:
            raise UserError(f"compute_logprobs: temperature must be a float tensor shaped like "
                            f"input_ids {tuple(input_ids.shape)}, got "
                            f"{getattr(temperature, 'dtype', type(temperature).__name__)} "
                            f"{tuple(getattr(temperature, 'shape', ()))}")
        if values and not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
            raise UserError("compute_logprobs: temperature holds a value that is not a positive "
                            "finite number")
    if routes is not None:
        cfg = model.cfg
        want = (*input_ids.shape, cfg.num_layers, cfg.top_k)
        if not isinstance(routes, torch.Tensor) or tuple(routes.shape) != want \
                or routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise UserError(f"compute_logprobs: routes must be an integer tensor {list(want)} "
                            f"(rows, tokens, layers, top_k), got "
                            f"{getattr(routes, 'dtype', type(routes).__name__)} "
                            f"{tuple(getattr(routes, 'shape', ()))}")
        if values and not bool(((routes >= -1) & (routes < cfg.num_experts)).all()):
            raise UserError(f"compute_logprobs: routes holds a value that is not an expert id in "
                            f"[0, {cfg.num_experts}) or -1")
    if packing is not None and positions is not None:
        raise UserError("compute_logprobs: packed rows carry their own positions: pass "
                        "positions=None with packing")


def _check_ranges(input_ids, labels, V: int) -> None:
    bad = (input_ids < 0) | (input_ids >= V)
    if bool(bad.any()):
        r, s = (int(i) for i in bad.nonzero()[0])
        raise UserError(f"compute_logprobs: input_ids[{r}, {s}]={int(input_ids[r, s])} is outside "
                        f"the vocabulary [0, {V})")
    bad = (labels != -100) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        r, s = (int(i) for i in bad.nonzero()[0])
        raise UserError(f"compute_logprobs: labels[{r}, {s}]={int(labels[r, s])} is outside "
                        f"[0, {V}) and is not -100")


def compute_logprobs(model, input_ids, labels, positions=None, packing=None,
                     with_entropy: bool = False, check_values: bool = True, temperature=None,
                     routes=None):
    """(log p(labels) [rows, tokens] fp32, entropy of the full softmax [rows, tokens] fp32 or
    None), no gradient. Tokens whose label is -100 get 0 in both. `model`: the (FSDP2-sharded,
    expert-parallel) MoETransformer; `positions` [tokens] (default 0..tokens-1) or `packing`
    (PackedRows, samples end to end) as for its forward. `check_values=False` skips the
    token-id range checks, for callers that made the same checks on the host before the
    copy (PolicyTrainer: longmoe.api.checks), so micro-batches queue without a host wait.
    `temperature` [rows, tokens] (> 0, None: 1): per position, the rollout's sampling
    temperature; the values are those of softmax(logits / temperature). `routes` [rows,
    tokens, layers, top_k] (router replay): the experts each position uses per layer, -1 where
    the router decides."""
    inner = getattr(model, "cfg", None)
    if inner is None:
        raise UserError("compute_logprobs: model must be a longmoe MoETransformer")
    _check(model, input_ids, labels, positions, packing, check_values, temperature, routes)
    # no_grad rather than inference_mode: FSDP2 keeps the head's unsharded weight across calls,
    # and a tensor made under inference mode could not be saved by the next training forward.
    with torch.no_grad():
        lp, ent, _, _ = model(input_ids, labels, positions, with_entropy=with_entropy,
                              packing=packing, temperature_BS=temperature, routes_BSLK=routes)
    return lp.float(), (ent.float() if ent is not None else None)
