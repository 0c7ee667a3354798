"""The policy's weights for a rollout engine: Hugging Face names and full tensors, in buckets.

Layout: what `export_hf` writes (the same keys, shapes and values; experts per expert,
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`), which vLLM, SGLang and transformers load,
for the architecture longmoe.model.hf_compat.target picks (`hf_config` is its config.json). A
config no architecture computes is refused before any gather; the receiver must be built from
that config (load_into_hf_model checks it).

Who sends what (`senders`):
  "owners" (default)  rank 0 yields the dense tensors; the first rank of each expert-parallel
                      group's column (ranks 0..ep-1) yields its own experts. Experts are nearly
                      all the bytes of an MoE model, so ep ranks send in parallel and no expert
                      crosses the trainer's network first; the engine shards by expert anyway.
  "rank0"             rank 0 yields everything: the other expert owners send their experts to
                      rank 0 one layer at a time. One endpoint (a single-process engine, the CPU
                      RL loop's transformers model) at the cost of rank 0's link carrying all.
Every rank must drain the iterator (the gathers are collectives); a rank with nothing to send
yields nothing.

Memory: one parameter is gathered at a time and dropped as soon as its tensors are copied out,
and a full bucket is handed over before the next tensor is made, so on top of the model each
rank holds at most one bucket (bucket_bytes, or one tensor larger than that alone in its bucket)
plus one gathered parameter (under "rank0", rank 0 holds every expert of one layer and, while
receiving them, its own share once more) and the all-gather's copy of one local shard, which
torch's collective may keep until its work object is released — if the caller drops each bucket
before asking for the next. A rank with nothing to send drops each gathered tensor at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from longmoe.errors import UserError
from longmoe.model.hf import gathered_parameters, hf_config, hf_tensors
from longmoe.model.hf_compat import check_receiver, check_state, target

Bucket = list[tuple[str, torch.Tensor]]
SENDERS = ("owners", "rank0")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _owned(t: torch.Tensor, dtype) -> torch.Tensor:
    """`t` converted and contiguous, in storage of its own: a view would keep the whole gathered
    parameter alive while its bucket waits."""
    t = t.to(dtype).contiguous() if dtype is not None else t.contiguous()
    if t.untyped_storage().nbytes() != _nbytes(t):
        t = t.clone()
    return t


def _gather_experts(full: torch.Tensor, layout) -> torch.Tensor | None:
    """On rank 0, the stack of every expert of one layer (EP group of rank 0 gathers to it);
    None on the other ranks of that group; `full` itself where ep is 1."""
    if layout.ep == 1:
        return full
    if layout.rank >= layout.ep:  # not in rank 0's EP group: its experts are sent by ranks < ep
        return None
    stack = parts = None
    if layout.rank == 0:  # received in place: no second copy of the stack for a concatenation
        stack = full.new_empty((layout.ep * full.shape[0],) + tuple(full.shape[1:]))
        parts = list(stack.chunk(layout.ep))
    dist.gather(full.contiguous(), parts, dst=0, group=layout.ep_group)
    return stack


def named_weights_for_rollout(model, run_or_model_cfg, layout, bucket_bytes: int,
                              dtype: torch.dtype | None = None,
                              senders: str = "owners") -> Iterator[Bucket]:
    """Buckets of (Hugging Face name, full tensor) for this rank to send (see the module
    docstring). `run_or_model_cfg`: a RunConfig or the ModelConfig. `dtype`: the tensors' dtype
    (None: the parameters' own, e.g. fp32 masters; torch.bfloat16 for a bf16 engine). Tensors are
    on the model's device and may share memory with an unsharded parameter: copy them before
    the next optimizer step if they are kept."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise UserError(f"named_weights_for_rollout: bucket_bytes must be a positive int, "
                        f"got {bucket_bytes!r}")
    if senders not in SENDERS:
        raise UserError(f"named_weights_for_rollout: senders must be one of {', '.join(SENDERS)}, "
                        f"got {senders!r}")
    cfg = getattr(run_or_model_cfg, "model", run_or_model_cfg)
    target(cfg)  # the same verdict on every rank, before the first gather
    check_state(model, cfg, "named_weights_for_rollout")
    return _buckets(model, cfg, layout, bucket_bytes, dtype, senders)


def _buckets(model, cfg, layout, bucket_bytes, dtype, senders):
    bucket, size = [], 0
    for name, full, experts in gathered_parameters(model):
        if experts is None:
            first = 0 if layout.rank == 0 else None
        elif senders == "rank0":
            full, first = _gather_experts(full, layout), 0
            if full is None:
                first = None
        else:  # a rank outside rank 0's EP group has the experts of rank (rank % ep), which sends
            first = experts.first_expert if layout.rank < layout.ep else None
        if first is None:  # nothing to send: drop the gathered tensor before the next gather
            del full
            continue
        views = hf_tensors(name, full, first, cfg)
        del full
        for key in list(views):
            # The full bucket leaves before the next tensor is made, so a bucket never waits
            # beside a converted copy that is not in it.
            nb = views[key].numel() * (dtype or views[key].dtype).itemsize
            if bucket and size + nb > bucket_bytes:
                out, bucket, size = bucket, [], 0
                yield out
                del out
            bucket.append((key, _owned(views.pop(key), dtype)))
            size += nb
        del views
    if bucket:
        yield bucket


def _fused_slot(hf_params: dict, key: str):
    """(fused parameter name, expert, rows) for a per-expert key that a model with fused expert
    tensors (`mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F]) stores; else None."""
    head, sep, tail = key.rpartition(".mlp.experts.")
    if not sep:
        return None
    e, _, proj = tail.partition(".")
    if not e.isdigit():
        return None
    base = head + ".mlp.experts."
    if proj == "down_proj.weight" and base + "down_proj" in hf_params:
        return base + "down_proj", int(e), None
    if proj in ("gate_proj.weight", "up_proj.weight") and base + "gate_up_proj" in hf_params:
        F = hf_params[base + "gate_up_proj"].shape[1] // 2
        return base + "gate_up_proj", int(e), (0, F) if proj.startswith("gate") else (F, 2 * F)
    return None


@torch.no_grad()
def load_into_hf_model(hf_model, buckets, run_or_model_cfg) -> int:
    """Copy buckets (from every sending rank, in any order) into a transformers model's
    parameters; returns the number of tensors copied. `run_or_model_cfg`: the policy's RunConfig
    or ModelConfig; first, every value of `hf_model.config` that transformers reads to build the
    model must be what hf_config writes for it (hf_compat.check_receiver), so the receiver
    computes the policy's function. Per-expert keys go into fused expert parameters where the
    model has them. A config value, a name the model does not have, a shape that differs, or a
    parameter left unfilled raises one UserError naming it; all but the last are checked before
    a tensor is copied."""
    check_receiver(getattr(hf_model, "config", None), hf_config(run_or_model_cfg),
                   run_or_model_cfg, "load_into_hf_model")
    params = dict(hf_model.named_parameters())
    filled: dict[str, torch.Tensor] = {}  # per fused parameter: which (expert, row) were written
    seen, n = set(), 0
    for bucket in buckets:
        for key, t in bucket:
            if key in seen:
                raise UserError(f"load_into_hf_model: tensor {key} was sent twice")
            seen.add(key)
            if key in params:
                dst, where = params[key], None
            elif (slot := _fused_slot(params, key)) is not None:
                fused, e, rows = slot
                dst = params[fused][e] if rows is None else params[fused][e, rows[0]:rows[1]]
                where = (fused, e, rows)
            else:
                raise UserError(f"load_into_hf_model: the model has no parameter {key}")
            if tuple(dst.shape) != tuple(t.shape):
                raise UserError(f"load_into_hf_model: {key} has shape {tuple(t.shape)}, the model "
                                f"needs {tuple(dst.shape)}")
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
            if where is not None:
                fused, e, rows = where
                mask = filled.setdefault(fused, torch.zeros(params[fused].shape[:2], dtype=torch.bool))
                mask[e, slice(None) if rows is None else slice(*rows)] = True
            else:
                filled[key] = None
            n += 1
    for name, p in params.items():
        if name not in filled:
            raise UserError(f"load_into_hf_model: no tensor was sent for {name}")
        if filled[name] is not None and not bool(filled[name].all()):
            e = int((~filled[name]).any(1).nonzero()[0])
            raise UserError(f"load_into_hf_model: {name}: expert {e} was not sent")
    return n
