"""Linear cross-entropy against the plain-PyTorch reference (fp64 for fp32 candidates)."""

import random

import pytest
import torch

from longmoe.ops import ImplUnavailable, linear_cross_entropy, linear_logprobs
from longmoe.paired.cases import linear_ce_case
from longmoe.paired.memtrack import TensorBytes


def fresh_seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,chunk", [((47, 31, 123), 8), ((5, 16, 1000), 1), ((64, 24, 77), 64),
                                         ((33, 8, 50), 100)])
def test_chunked_matches_reference(dtype, shape, chunk):
    T, H, V = shape
    seed = fresh_seed()
    res = linear_ce_case("chunked", seed, T=T, H=H, V=V, dtype=dtype, chunk_tokens=chunk)
    assert res.ok, (seed, res.failures())


def test_never_materialises_logits():
    # At T=256, V=8192 the fp32 logits are 8 MiB; the chunked path holds a few [16, V] tiles
    # (0.5 MiB each) plus weight-sized gradients (H=4 keeps those small), far below one [T, V].
    T, H, V = 256, 4, 8192
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (T,))
    with TensorBytes() as mode:
        loss = linear_cross_entropy(h, w, y, impl="chunked", chunk_tokens=16)
        loss.backward()
    assert mode.peak < T * V * 4 / 3, mode.peak
    with TensorBytes() as naive:
        linear_cross_entropy(h, w, y, impl="reference").backward()
    assert naive.peak > T * V * 4  # the measurement can see a [T, V] tensor when one exists


def test_reductions_and_all_ignored():
    T, H, V = 19, 12, 40
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64)
    y = torch.randint(0, V, (T,))
    y[::3] = -100
    none = linear_cross_entropy(h, w, y, reduction="none", impl="chunked", chunk_tokens=4)
    ref = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none")
    torch.testing.assert_close(none, ref)
    torch.testing.assert_close(linear_cross_entropy(h, w, y, reduction="sum", impl="chunked"),
                               ref.sum())
    torch.testing.assert_close(linear_cross_entropy(h, w, y, impl="chunked"),
                               torch.nn.functional.cross_entropy(h @ w.T, y))
    all_ignored = torch.full((T,), -100)
    loss = linear_cross_entropy(h, w, all_ignored, impl="chunked")
    loss.backward()
    assert loss.item() == 0.0 and torch.all(h.grad == 0)


def test_entropy_matches_softmax_entropy():
    T, H, V = 23, 10, 57
    h, w = torch.randn(T, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    y = torch.randint(0, V, (T,))
    _, ent = linear_logprobs(h, w, y, with_entropy=True, impl="chunked", chunk_tokens=5)
    p = torch.softmax(h @ w.T, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))


def test_gradcheck_chunked():
    T, H, V = 7, 5, 11
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (T,))
    y[2] = -100
    fn = lambda h, w: linear_logprobs(h, w, y, with_entropy=True, impl="chunked", chunk_tokens=3)
    assert torch.autograd.gradcheck(fn, (h, w))


def test_bad_inputs_name_the_argument():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="hidden size"):
        linear_logprobs(h, torch.randn(10, 9), y)
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs(h, w, torch.randint(0, 10, (5,)))
    with pytest.raises(ValueError, match=r"labels\[2\]=10"):
        linear_logprobs(h, w, torch.tensor([1, 2, 10, 3]))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ImplUnavailable, match="unknown impl"):
        linear_logprobs(h, w, y, impl="nope")


def test_liger_adapter_is_behind_the_same_api():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    # On CPU (or without liger-kernel) a named impl that cannot run fails with the reason.
    if h.device.type == "cpu":
        with pytest.raises(ImplUnavailable, match="liger"):
            linear_cross_entropy(h, w, y, impl="liger")
    with pytest.raises(ImplUnavailable, match="liger"):
        linear_logprobs(h, w, y, impl="liger")  # liger gives the loss only


@pytest.mark.needs_cuda
def test_liger_adapter_matches_reference_on_gpu():
    pytest.importorskip("liger_kernel")
    g = torch.Generator().manual_seed(fresh_seed())
    h = torch.randn(301, 64, generator=g).cuda().bfloat16()
    w = (torch.randn(1003, 64, generator=g) * 0.1).cuda().bfloat16()
    y = torch.randint(0, 1003, (301,), generator=g).cuda()
    y[::9] = -100
    a = linear_cross_entropy(h, w, y, impl="liger")
    b = linear_cross_entropy(h.float(), w.float(), y, impl="reference")
    assert abs(float(a) - float(b)) < 2e-2 * abs(float(b))
