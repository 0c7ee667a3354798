"""A fast path's one-time trial call can happen inside a recomputed block's first forward; the
recomputation finds the verdict cached and skips it. ops.registry.trial_call keeps the trial's
saved tensors away from torch.utils.checkpoint, which otherwise fails the backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from longmoe.ops.registry import trial_call


def _block(verdicts: dict, scoped: bool):
    def fn(x):
        if "trial" not in verdicts:  # first use only, as the registries' trial caches do
            ctx = trial_call() if scoped else torch.enable_grad()
            with ctx:
                probe = torch.randn(5, 3, requires_grad=True)
                (probe.exp() * probe.sin()).sum().backward()
            verdicts["trial"] = True
        return (x.tanh() * x.exp()).sum(-1)
    return fn


def test_a_trial_inside_a_recomputed_forward_leaves_the_backward_intact():
    x = torch.randn(4, 3, requires_grad=True)
    out = checkpoint(_block({}, scoped=True), x, use_reentrant=False)
    out.sum().backward()
    want = x.detach().requires_grad_()
    (want.tanh() * want.exp()).sum().backward()
    torch.testing.assert_close(x.grad, want.grad)


def test_an_unscoped_trial_breaks_the_recompute():
    x = torch.randn(4, 3, requires_grad=True)
    out = checkpoint(_block({}, scoped=False), x, use_reentrant=False)
    with pytest.raises(CheckpointError):
        out.sum().backward()


def test_the_varlen_trial_inside_a_recomputed_forward_leaves_the_backward_intact(monkeypatch):
    """The document-attention trial compares its output with the reference's; that comparison
    must not join the enclosing checkpoint's saved tensors either (on a GPU it added four to the
    first forward of a packed block, and the backward failed). The flash kernels need a GPU, so
    the reference stands in for them: the trial's own bookkeeping is what is under test."""
    from longmoe.ops import document_attention as da
    monkeypatch.setattr(da, "varlen_document_attention", da._reference)
    monkeypatch.setattr(da, "_VARLEN_TRIAL", {})

    def fn(x):
        assert da._varlen_trial(x.device, torch.float32, 8) is None
        return (x.tanh() * x.exp()).sum(-1)

    x = torch.randn(4, 3, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()
    want = x.detach().requires_grad_()
    (want.tanh() * want.exp()).sum().backward()
    torch.testing.assert_close(x.grad, want.grad)
