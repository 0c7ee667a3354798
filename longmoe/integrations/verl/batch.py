"""verl's no-padding micro-batches as longmoe packed rows, and per-token results back.

verl (verl.workers.utils.padding.left_right_2_no_padding) hands an engine each sequence as one
row of a jagged nested tensor: `input_ids` [bsz, j] (prompt then response, padding removed),
`position_ids` [bsz, j] (0..len-1 for a text model). Its losses read the model output in the same
layout: `log_probs[i][t]` is log p(input_ids[i][t+1]) (verl.workers.utils.padding.
no_padding_2_padding takes the response's log-probs at t = prompt_len-1 .. len-2).

Each sequence becomes a longmoe Sample whose "prompt" is its first token and whose "response" is
the rest, so every next token of the sequence is labelled; the samples are packed end to end in
one row (longmoe.data.packing.pack_rows: sample ids and positions restart per sequence, so
attention and Gated DeltaNet never cross a boundary). The packed row's per-token results are
then verl's layout directly: the sequences sit in order from offset 0, and each sequence's last
position (nothing to predict inside it) holds 0.
"""

from __future__ import annotations

import torch

from longmoe.data.routes import repeats_expert
from longmoe.data.sample import Sample
from longmoe.errors import UserError


def check_sequences(data, vocab_size: int) -> None:
    """Once per batch, on the host: input_ids is verl's no-padding nested tensor of token ids in
    [0, vocab_size) (on the device a bad id would be a device-side assert, and checking it there
    a synchronisation), every sequence has a prompt token and a response token, and its
    positions are the plain 0..len-1 of each sequence (longmoe derives positions from sample
    boundaries)."""
    ids = data["input_ids"]
    if not getattr(ids, "is_nested", False):
        raise UserError("longmoe engine: input_ids must be verl's no-padding nested tensor "
                        "(left_right_2_no_padding); got a padded tensor")
    values = ids.values().detach().cpu()
    bad = ((values < 0) | (values >= vocab_size)).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise UserError(f"longmoe engine: input_ids holds token id {int(values[t])} (flat "
                        f"position {t}), outside the vocabulary [0, {vocab_size})")
    offsets = ids.offsets().cpu()
    lengths = offsets.diff()
    short = (lengths < 2).nonzero()
    if short.numel():
        i = int(short[0, 0])
        raise UserError(f"longmoe engine: sequence {i} of the batch has {int(lengths[i])} "
                        f"token(s); a sequence needs a prompt token and a response token")
    pos = data.get("position_ids", None)
    if pos is None:
        return
    if pos.dim() != 2:
        raise UserError(f"longmoe engine: position_ids must be one position per token "
                        f"(text models); got {pos.dim()}-D positions (multimodal RoPE is "
                        f"not supported)")
    have = pos.values().detach().cpu().long()
    total = int(offsets[-1])
    want = (torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths,
                                                          output_size=total))
    if have.shape != want.shape or not torch.equal(have, want):
        raise UserError("longmoe engine: position_ids must restart at 0 and count up by one "
                        "within each sequence (longmoe derives positions from sample "
                        "boundaries)")


def infer_fields(data, routes: bool = False):
    """What inference reads of a batch: its tokens, verl's settings (non-tensor entries), a
    per-sequence temperature and, when replayed (`routes`), the routed experts."""
    extra = ("temperature", "routed_experts") if routes else ("temperature",)
    keep = ["input_ids"] + [k for k in data.keys() if not isinstance(data[k], torch.Tensor)
                            or k in extra]
    return data.select(*keep)


def sequences(micro_batch) -> tuple[torch.Tensor, list[int]]:
    """(token values [total] int64 on the host, offsets [bsz + 1]) of a micro-batch's nested
    input_ids (checked once per batch by check_sequences)."""
    ids = micro_batch["input_ids"]
    return ids.values().detach().cpu().long(), ids.offsets().tolist()


def to_samples(values: torch.Tensor, offsets: list[int], temps: list[float] | None = None,
               routes: torch.Tensor | None = None) -> list[Sample]:
    """One sample per sequence, every next token labelled (see the module docstring), at its
    rollout temperature (`temps`, from temperatures(); None: 1), replaying `routes` (the
    micro-batch's routed_experts values [total, layers, top_k], or None)."""
    return [Sample(values[a:a + 1], values[a + 1:b], advantage=0.0, index=i,
                   temperature=1.0 if temps is None else temps[i],
                   routed_experts=None if routes is None else routes[a:b],
                   where=f"micro-batch sequence {i}")
            for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]


def routed_values(micro_batch) -> torch.Tensor | None:
    """The micro-batch's routed_experts (verl's jagged [bsz, j, layers, top_k]) as host values
    [total, layers, top_k] in longmoe's convention, or None where the batch has none. verl
    marks a token the rollout engine recorded no route for by an all-zero row (its agent loop
    zero-fills the rows past the rollout's: the final generated token, trailing tool tokens);
    a row that repeats an expert becomes -1, the router's own choice, as verl's own engines
    route such rows natively. Routed experts are distinct, so no recorded route is lost."""
    v = _given_routes(micro_batch)
    if v is None:
        return None
    return torch.where(repeats_expert(v).unsqueeze(-1), torch.full_like(v, -1), v)


def _given_routes(micro_batch) -> torch.Tensor | None:
    """routed_experts' values as verl gives them, on the host."""
    if "routed_experts" not in micro_batch.keys():
        return None
    r = micro_batch["routed_experts"]
    return (r.values() if getattr(r, "is_nested", False) else r).detach().cpu()


def check_routes(data, layers: int, top_k: int, experts: int) -> None:
    """Once per batch, on the host: routed_experts holds, per token of input_ids, `layers` rows
    of `top_k` expert ids in [0, experts), or of -1 (the router's choice). A row that repeats an
    expert is verl's mark of no recorded route (routed_values)."""
    if "routed_experts" not in data.keys():
        raise UserError("longmoe engine: router_replay needs routed_experts in the batch (R3: "
                        "rollout.enable_rollout_routing_replay=true; R2: the actor's "
                        "compute_log_prob output)")
    v, total = _given_routes(data), int(data["input_ids"].offsets()[-1])
    if v.dtype.is_floating_point or tuple(v.shape) != (total, layers, top_k):
        raise UserError(f"longmoe engine: routed_experts must be integers [{total}, {layers}, "
                        f"{top_k}] (tokens, MoE layers, top_k); got {v.dtype} {tuple(v.shape)}")
    bad = ((v < -1) | (v >= experts)).nonzero()
    if bad.numel():
        t, j, k = (int(x) for x in bad[0])
        raise UserError(f"longmoe engine: routed_experts[{t}, {j}, {k}] = {int(v[t, j, k])} is "
                        f"not an expert id in [0, {experts})")
    off = v < 0
    mixed = (off.any(-1) & ~off.all(-1)).nonzero()
    if mixed.numel():
        t, j = (int(x) for x in mixed[0])
        raise UserError(f"longmoe engine: routed_experts[{t}, {j}] = {v[t, j].tolist()} mixes "
                        f"expert ids and -1 (a token's row is all ids or all -1)")


def temperatures(micro_batch) -> list[float] | None:
    """Per sequence, the rollout temperature verl's trainer attaches to a batch (a number for
    all, or a [bsz] tensor, one per sequence); None where it is absent or 1 for every sequence.
    The LM head divides each sequence's logits by its value (LMHead.forward), as verl's FSDP
    engine does. Host only: the value is verl's setting, or a host tensor."""
    if "temperature" not in micro_batch.keys():
        return None
    t = micro_batch["temperature"]
    n = micro_batch.batch_size[0] if len(micro_batch.batch_size) else None
    v = torch.as_tensor(t.values() if getattr(t, "is_nested", False) else t,
                        dtype=torch.float64).detach().cpu().reshape(-1)
    if v.numel() == 1 and n is not None:
        v = v.expand(n)
    if n is not None and v.numel() != n:
        raise UserError(f"longmoe engine: temperature has {v.numel()} values for {n} sequences "
                        f"(one number, or one per sequence)")
    bad = ~(torch.isfinite(v) & (v > 0))
    if bool(bad.any()):
        raise UserError(f"longmoe engine: temperature {float(v[bad][0])} is not a positive "
                        f"finite number (rollout.temperature)")
    return None if bool((v == 1.0).all()) else v.tolist()


def to_nested(row_values: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """A packed row's per-token values [>= total] as verl's jagged [bsz, j] nested tensor
    (autograd flows through it)."""
    total = offsets[-1]
    off = torch.tensor(offsets, dtype=torch.long, device=row_values.device)
    return torch.nested.nested_tensor_from_jagged(row_values[:total].contiguous(), off)

