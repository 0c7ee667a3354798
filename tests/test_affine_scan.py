"""AffineScan (the chunked Gated DeltaNet core's state recurrence, with a hand-written backward)
against the plain autograd loop: states and the gradients of M, N and the initial state."""

import pytest
import torch

from longmoe.ops.gated_delta import AffineScan, affine_scan_reference


@pytest.mark.parametrize("n,b,dk,dv", [(1, 1, 3, 2), (7, 3, 5, 4), (33, 2, 16, 9)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_affine_scan_matches_loop(n, b, dk, dv, dtype, tol):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    # Transitions like the delta rule's: a decay times identity minus a small rank update,
    # so the states neither vanish nor blow up over 33 steps.
    decay = torch.rand(n, b, 1, 1, generator=g, dtype=dtype) * 0.5 + 0.5
    low = torch.randn(n, b, dk, dk, generator=g, dtype=dtype) * (0.3 / dk)
    leaves = [decay * torch.eye(dk, dtype=dtype) - low,
              torch.randn(n, b, dk, dv, generator=g, dtype=dtype),
              torch.randn(b, dk, dv, generator=g, dtype=dtype)]
    upstream = torch.randn(n + 1, b, dk, dv, generator=g, dtype=dtype)
    outs, grads = [], []
    for fn in (AffineScan.apply, affine_scan_reference):
        xs = [x.clone().requires_grad_() for x in leaves]
        y = fn(*xs)
        (y * upstream).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad for x in xs])
    scale = outs[1].abs().max()
    assert (outs[0] - outs[1]).abs().max() <= tol * scale
    for a, r in zip(*grads):
        assert (a - r).abs().max() <= tol * r.abs().max() * n, (a - r).abs().max()


def test_affine_scan_gradcheck():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 2, 3, 3, generator=g, dtype=torch.float64) * 0.5,
          torch.randn(4, 2, 3, 2, generator=g, dtype=torch.float64),
          torch.randn(2, 3, 2, generator=g, dtype=torch.float64)]
    assert torch.autograd.gradcheck(AffineScan.apply, [x.requires_grad_() for x in xs])
