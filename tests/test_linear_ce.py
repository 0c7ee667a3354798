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


# The in-place layouts: the gradient over the logits chunk, dW accumulated in the weight's dtype.
@pytest.mark.parametrize("impl", ["chunked_inplace", "chunked_lowp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,chunk", [((47, 31, 123), 8), ((33, 8, 50), 100)])
def test_inplace_layouts_match_reference(impl, dtype, shape, chunk):
    T, H, V = shape
    seed = fresh_seed()
    res = linear_ce_case(impl, seed, T=T, H=H, V=V, dtype=dtype, chunk_tokens=chunk)
    assert res.ok, (seed, res.failures())


def test_inplace_dw_in_bf16_costs_about_one_rounding():
    # 64 chunks, each added to a bf16 dW by a GEMM that sums in fp32 and rounds once: measured
    # 5.6e-3 to 1.2e-2 of max |dW| against the fp32 reference at T = 1,024 (the fp32 accumulator
    # with one final rounding: 2.8e-3 to 4.9e-3), for 2 to 256 chunks alike. Bound: 3x the fp32
    # accumulator's error plus a bf16 ulp, and the bf16 tolerance.
    seed = fresh_seed()
    kw = dict(T=512, H=64, V=3001, dtype=torch.bfloat16, chunk_tokens=8)
    acc32 = linear_ce_case("chunked", seed, **kw).errors["dW"]
    res = linear_ce_case("chunked_inplace", seed, **kw)
    assert res.ok, (seed, res.failures())
    assert res.errors["dW"] <= 3 * acc32 + 2**-8, (seed, res.errors["dW"], acc32)
    # log-probs, entropy and dH do not change with the layout (the same fp32 logits and rows)
    ref = linear_ce_case("chunked", seed, **kw)
    for k in ("logprobs", "entropy", "ce_loss"):
        assert res.errors[k] == pytest.approx(ref.errors[k], rel=1e-3, abs=1e-7), k


def _peaked_head(seed, T=64, H=64, V=4001):
    # Logits of std ~6 with a boosted token per row (p_max ~0.6) and labels on it half the time:
    # bf16 logits there are spaced 0.125-0.25 apart (|z| 16-34).
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.75
    top = torch.randint(0, V, (T,), generator=g)
    h += 3.0 * w[top] / w[top].norm(dim=-1, keepdim=True)
    y = torch.where(torch.rand(T, generator=g) < 0.5, top, torch.randint(0, V, (T,), generator=g))
    return h.bfloat16(), w.bfloat16(), y


def test_lowp_logprob_error_with_large_logits():
    # |z| up to ~34, p_max ~0.6: bf16 logits reduced as they are miss log p by 0.08-0.10; the
    # fp32 fix-up of the target and the largest logit brings that to 0.020-0.025 (the other
    # large logits keep their rounding), the in-place layout's fp32 logits to ~1e-6.
    seed = fresh_seed()
    h, w, y = _peaked_head(seed)
    ref, ref_ent = linear_logprobs(h.double(), w.double(), y, with_entropy=True, impl="reference")
    z = (h @ w.T).double()
    plain = (z.gather(1, y[:, None])[:, 0] - torch.logsumexp(z, -1) - ref).abs().max()
    assert plain > 4e-2, "the inputs do not exercise the rounding"
    lp, ent = linear_logprobs(h, w, y, with_entropy=True, impl="chunked_lowp", chunk_tokens=16)
    assert (lp.double() - ref).abs().max() < plain / 2.5, (seed, float((lp.double() - ref).abs().max()))
    lp32, _ = linear_logprobs(h, w, y, impl="chunked_inplace", chunk_tokens=16)
    assert (lp32.double() - ref).abs().max() < 1e-4, seed


def test_fused_gradients_cannot_run_backward_twice():
    h = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 20, (9,)), impl="chunked_inplace")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.needs_cuda
def test_inplace_layout_holds_one_logits_chunk_on_gpu():
    # Extra peak over inputs and gradients: one fp32 [C, V] chunk plus per-token vectors.
    T, H, V, C = 4096, 256, 50_000, 512
    g = torch.Generator().manual_seed(fresh_seed())
    h = torch.randn(T, H, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), generator=g).cuda()
    peaks = {}
    for impl in ("triton", "triton_inplace"):
        linear_cross_entropy(h, w, y, impl=impl, chunk_tokens=C).backward()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        linear_cross_entropy(h, w, y, impl=impl, chunk_tokens=C).backward()
        peaks[impl] = torch.cuda.max_memory_allocated() - base - 2 * (h.numel() + w.numel())
        h.grad = w.grad = None
    assert peaks["triton_inplace"] < C * V * 4 * 1.05 + T * 64, peaks
    assert peaks["triton"] > C * V * 6, peaks


@pytest.mark.parametrize("impl", ["chunked", "chunked_inplace"])
def test_fused_gradients_take_the_upstream_gradient(impl):
    # The loss is usually scaled before backward (the trainer's world-size scale): the gradients
    # computed in the forward are scaled by it in the backward.
    T, H, V = 23, 8, 37
    g = torch.Generator().manual_seed(fresh_seed())
    h = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=g)
    (linear_cross_entropy(h, w, y, impl=impl, chunk_tokens=5) * -2.5).backward()
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.nn.functional.cross_entropy(ref_h @ ref_w.T, y) * -2.5).backward()
    torch.testing.assert_close(h.grad, ref_h.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)
