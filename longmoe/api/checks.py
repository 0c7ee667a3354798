"""Checks of the samples a PolicyTrainer call receives: every field on the host first, then one
small collective that every rank reaches, so a bad list stops all ranks with the same kind of
error instead of leaving some inside the model's all-to-alls.

Every message is one line naming the call, the sample (its position in the list and, when set,
its `where`) and the field.

Log-prob fields are read only at the tokens the loss trains (the loss mask, minus the first
response token of an empty prompt, which nothing predicts, and tokens data.overlong cuts):
there they must be finite and at most LOGPROB_TOL. Untrained positions may hold anything, NaN
included (compute_logprobs returns NaN where it has no value). NaN never means on-policy: a
missing field (None) does, for old_logprobs. A loss mask is bool or all 0/1 (integers or floats).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import torch
import torch.distributed as dist

from longmoe.data.routes import check_ids
from longmoe.data.sample import LOGPROB_FIELDS, Sample
from longmoe.errors import UserError

# A log-probability is <= 0. The LM head's log-softmax is exact to a few fp32 ulps of the
# log-sum-exp, so a near-certain token can come out a hair above 0; an engine's bf16 numbers
# are within 1e-2 of ours but never above 0 by more than rounding of 0 itself.
LOGPROB_TOL = 1e-4


def sample_name(k: int, s) -> str:
    where = getattr(s, "where", "")
    return f"samples[{k}]" + (f" ({where})" if where else "")


def trained_positions(s: Sample) -> torch.Tensor:
    """[R] bool: the response tokens the loss trains (see the module docstring)."""
    keep = torch.ones(s.response.numel(), dtype=torch.bool)
    if s.loss_mask is not None:
        keep &= s.loss_mask.reshape(-1).to(torch.bool).cpu()
    if s.prompt_len == 0:
        keep[0] = False
    return keep


def _ids(name: str, field: str, t, vocab_size: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point \
            or t.dtype == torch.bool or t.is_complex():
        raise UserError(f"{name}: {field} must be a 1-D integer tensor of token ids, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    bad = (t < 0) | (t >= vocab_size)
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise UserError(f"{name}: {field}[{j}]: token id {int(t[j])} is outside the vocabulary "
                        f"[0, {vocab_size})")


def _per_token(name: str, field: str, t, R: int, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != R \
            or (floating and not t.dtype.is_floating_point):
        what = "a 1-D float tensor" if floating else "a 1-D tensor"
        raise UserError(f"{name}: {field} must be {what} of {R} values (one per response "
                        f"token), got {getattr(t, 'dtype', type(t).__name__)} "
                        f"{tuple(getattr(t, 'shape', ()))}")


def check_samples(samples, what: str, vocab_size: int, require: dict[str, str] | None = None,
                  signal: bool = True, kept: list[int] | None = None,
                  routes: tuple[int, int, int] | None = None) -> None:
    """UserError for the first bad sample. `signal`: the training fields (advantage, log-probs,
    loss mask) are checked too; compute_logprobs reads the token ids alone. `require`: log-prob
    fields the objective needs (field -> the setting that needs it). `kept`: per sample, the
    response tokens data.overlong keeps (log-probs past them are never read). `routes`: the
    model's (layers, top_k, experts), for routed_experts (None: a sample with them is refused)."""
    if not isinstance(samples, (list, tuple)):
        raise UserError(f"{what}: samples must be a list of longmoe.data.sample.Sample, got "
                        f"{type(samples).__name__}")
    if not samples:
        raise UserError(f"{what}: the list of samples is empty")
    for k, s in enumerate(samples):
        name = f"{what}: {sample_name(k, s)}"
        if not isinstance(s, Sample):
            raise UserError(f"{name}: expected a longmoe.data.sample.Sample, got "
                            f"{type(s).__name__}")
        _ids(name, "prompt", s.prompt, vocab_size)
        _ids(name, "response", s.response, vocab_size)
        R = s.response.numel()
        if R == 0:
            raise UserError(f"{name}: response is empty")
        _check_temperature(name, s.temperature)
        if s.routed_experts is not None:
            _check_routes(name, s, routes)
        if signal:
            _check_signal(name, s, R, require or {}, R if kept is None else kept[k])


def _check_temperature(name: str, t) -> None:
    """The rollout's sampling temperature: a positive finite number (it divides the logits)."""
    if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
        t = float(t)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise UserError(f"{name}: temperature: {t!r} is not a positive finite number (the "
                        f"rollout's sampling temperature)")


def _check_routes(name: str, s: Sample, routes) -> None:
    """Router replay: integers [P + R, layers, top_k], each an expert id or -1 (router's choice),
    a token's row either all -1 or k distinct experts."""
    t = s.routed_experts
    if routes is None:
        raise UserError(f"{name}: routed_experts: this call does not take replayed routes")
    L, K, E = routes
    want = (len(s), L, K)
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool \
            or t.is_complex() or tuple(t.shape) != want:
        raise UserError(f"{name}: routed_experts must be an integer tensor {list(want)} (prompt + "
                        f"response tokens, layers, top_k), got {getattr(t, 'dtype', type(t).__name__)}"
                        f" {tuple(getattr(t, 'shape', ()))}")
    check_ids(name, t.detach().cpu().long(), E)


def _check_mask(name: str, s: Sample, R: int) -> None:
    """bool, or integers / floats that are all 0 or 1 (with_bool_mask makes them bool)."""
    m = s.loss_mask
    if m is None:
        return
    _per_token(name, "loss_mask", m, R, floating=False)
    if m.is_complex():
        raise UserError(f"{name}: loss_mask must be bool or 0/1 integers or floats, got {m.dtype}")
    if m.dtype != torch.bool:
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise UserError(f"{name}: loss_mask[{j}]: {m[j].item()!r} is not 0 or 1 (the mask "
                            f"is bool or 0/1)")


def check_masks(samples, what: str) -> None:
    """UserError for the first loss_mask that is not bool or all 0/1 (samples already passed
    check_samples with signal=False). Runs before the call is planned: the plan counts the
    trained tokens through the masks."""
    for k, s in enumerate(samples):
        _check_mask(f"{what}: {sample_name(k, s)}", s, s.response.numel())


def with_bool_mask(s: Sample) -> Sample:
    """The sample with a 0/1 integer or float loss mask as bool (what packing indexes with)."""
    m = s.loss_mask
    if m is None or m.dtype == torch.bool:
        return s
    return replace(s, loss_mask=m != 0)


def _check_signal(name: str, s: Sample, R: int, require: dict[str, str], kept: int) -> None:
    a = s.advantage
    if isinstance(a, torch.Tensor):
        _per_token(name, "advantage", a, R)
        bad = ~torch.isfinite(a)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise UserError(f"{name}: advantage[{j}]: {float(a[j])} is not finite")
    elif isinstance(a, bool) or not isinstance(a, (int, float)):
        raise UserError(f"{name}: advantage must be a number or a tensor of {R} values, got "
                        f"{type(a).__name__}")
    elif not math.isfinite(a):
        raise UserError(f"{name}: advantage: {a} is not finite")
    _check_mask(name, s, R)
    keep = trained_positions(s)
    keep[kept:] = False
    for field in LOGPROB_FIELDS:
        t = getattr(s, field)
        if t is None:
            if field in require:
                raise UserError(f"{name}: {field} is missing ({require[field]})")
            continue
        _per_token(name, field, t, R)
        v = t.detach().cpu().double()
        bad = keep & ~torch.isfinite(v)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            hint = "; on-policy is old_logprobs=None" if field == "old_logprobs" else ""
            raise UserError(f"{name}: {field}[{j}]: {float(v[j])} is not finite (a trained "
                            f"token needs a log-probability{hint})")
        bad = keep & (v > LOGPROB_TOL)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise UserError(f"{name}: {field}[{j}]: {float(v[j]):g} is positive (a "
                            f"log-probability is <= 0)")


def _tensor_bytes(h, label: str, t) -> None:
    h.update(label.encode())
    if t is None:
        h.update(b"-")
    elif isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(t).encode())


def sample_digests(samples, signal: bool = True) -> list[int]:
    """Per sample, 63 bits of a sha256 over its fields (the training fields when `signal`)."""
    out = []
    for s in samples:
        h = hashlib.sha256()
        if isinstance(s, Sample):
            _tensor_bytes(h, "p", s.prompt)
            _tensor_bytes(h, "r", s.response)
            _tensor_bytes(h, "t", float(s.temperature))
            _tensor_bytes(h, "x", s.routed_experts)
            if signal:
                _tensor_bytes(h, "a", s.advantage)
                for f in (*LOGPROB_FIELDS, "loss_mask"):
                    _tensor_bytes(h, f, getattr(s, f))
        else:
            h.update(repr(type(s)).encode())
        out.append(int.from_bytes(h.digest()[:8], "little") >> 1)
    return out


def agree(samples, what: str, error: UserError | None, call: str, group, device,
          signal: bool = True) -> None:
    """Raise `error` (this rank's host-side verdict) on every rank, or a UserError when the
    ranks were not given the same call with the same samples. One all-reduce that every rank
    reaches whatever its own verdict; a second (per-sample digests) only when the lists differ,
    to name the first sample that does. `call` describes the call's other arguments."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        if error is not None:
            raise error
        return
    n = len(samples) if isinstance(samples, (list, tuple)) else -1
    per = sample_digests(samples, signal) if n > 0 else []
    h = hashlib.sha256()
    for d in per:
        h.update(d.to_bytes(8, "little"))
    d = int.from_bytes(h.digest()[:8], "little") >> 1
    c = int.from_bytes(hashlib.sha256(call.encode()).digest()[:8], "little") >> 1
    mine = torch.tensor([c, -c, n, -n, d, -d, int(error is not None)], dtype=torch.int64,
                        device=device)
    got = mine.clone()
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
    same = lambda i, v: int(got[i]) == v and int(-got[i + 1]) == v  # noqa: E731
    if not same(0, c):
        raise UserError(f"{what}: the ranks made different calls ({call} here): every rank "
                        f"must make the same calls in the same order")
    if bool(got[6]):
        raise error if error is not None else UserError(
            f"{what}: another rank rejected its samples, this rank's passed the checks: every "
            f"rank must pass the same list")
    if not same(2, n):
        raise UserError(f"{what}: the ranks passed lists of different lengths ({int(-got[3])} to "
                        f"{int(got[2])} samples, {n} here): every rank must pass the same list")
    if same(4, d):
        return
    rows = torch.tensor(per, dtype=torch.int64, device=device)
    lo, hi = -rows, rows.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=group)
    k = int((hi != -lo).nonzero()[0])
    raise UserError(f"{what}: {sample_name(k, samples[k])} differs between ranks: every rank "
                    f"must pass the same list")
