"""Named implementations (impl.* other than "auto") checked on the rank's device before any
process group starts: one that cannot run here fails with one line naming the field, instead of
a registry error from inside the first step. "auto" needs no check: it falls back by itself."""

from __future__ import annotations

import torch

from longmoe.errors import UserError


def _probes(device: torch.device, dtype: torch.dtype):
    """(field, registry, small arguments of the kinds the step passes) per checkable setting."""
    from longmoe.ops import GROUPED_MM, LINEAR_CE, POLICY_LOSS
    from longmoe.ops.document_attention import DOCUMENT_ATTENTION, DocumentSpan
    from longmoe.ops.gated_delta import GATED_DELTA
    from longmoe.ops.moe_rows import MOE_ROWS
    from longmoe.ops.norm import NORM
    from longmoe.ops.router_matmul import ROUTER_MATMUL

    def t(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt, device=device)

    head = (t(8, 32), t(64, 32), t(8, dt=torch.long))
    qkv = [t(1, 64, 1, 16) for _ in range(3)]
    return (("linear_ce", LINEAR_CE, head), ("policy_loss", POLICY_LOSS, head),
            ("grouped_mm", GROUPED_MM, (t(32, 32), t(2, 32, 32), [16, 16])),
            ("moe_rows", MOE_ROWS, (t(4, 32),)),
            ("router_matmul", ROUTER_MATMUL, (t(4, 32), t(8, 32))),
            ("gated_delta", GATED_DELTA, (*qkv, t(1, 64, 1), t(1, 64, 1))),
            ("norm", NORM, (t(4, 32), t(32))),
            # the document-causal names of impl.attention (the SDPA backends are torch's)
            ("attention", DOCUMENT_ATTENTION, (*qkv, DocumentSpan.causal(1, 64, device=device))))


def check_named_impls(impl, device: torch.device, dtype: torch.dtype) -> None:
    """Raises UserError("impl.FIELD: ...") for a named implementation that cannot run on
    `device` with `dtype` operands (the run's compute dtype)."""
    for field, reg, args in _probes(device, dtype):
        name = getattr(impl, field)
        if name == "auto" or name not in reg.names():  # e.g. policy_loss "unfused"
            continue
        reason = reg.why_not(name, *args)
        if reason:
            raise UserError(f"impl.{field}: {name!r} cannot run here: {reason}")


def check_on_rank(run, backend, local_rank: int) -> None:
    """The check on a GPU rank's own device, before its process group starts (CPU runs were
    checked in the launcher, launch.validate, without opening any device context)."""
    if backend.device_type == "cpu":
        return
    from longmoe.train.setup import torch_dtype
    backend.set_device(local_rank)
    check_named_impls(run.impl, backend.device(local_rank), torch_dtype(run.parallel.param_dtype))
