"""Gated DeltaNet's q/k L2 normalisation (ops.gated_delta.L2Norm) against the plain expression
x * rsqrt(|x|^2 + eps) in fp64: values and gradients, odd shapes, small norms (where eps shows)."""

from __future__ import annotations

import pytest
import torch

from longmoe.ops.gated_delta import L2Norm


@pytest.mark.parametrize("shape,scale", [((3, 7, 5), 1.0), ((2, 1, 3, 33), 1e-3), ((4, 1), 10.0)])
def test_l2norm_matches_the_expression(shape, scale):
    x = (torch.randn(shape, dtype=torch.float64) * scale).requires_grad_()
    w = torch.randn(shape, dtype=torch.float64)
    got = L2Norm.apply(x)
    (dx,) = torch.autograd.grad((got * w).sum(), x)
    ref_x = x.detach().requires_grad_()
    want = ref_x * torch.rsqrt(ref_x.pow(2).sum(-1, keepdim=True) + 1e-6)
    (ref_dx,) = torch.autograd.grad((want * w).sum(), ref_x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(L2Norm.apply, (x,))
