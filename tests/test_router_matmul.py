"""The router's logits GEMMs (ops/router_matmul.py) against fp64: the fp32 reference in every
dtype, and the mixed path (a bf16 GEMM with fp32 output for the logits, the reference's backward)
on CPU through its emulation (the same exact products on fp32 casts) and on a GPU through
torch.mm(..., out_dtype=float32)."""

import random

import pytest
import torch

from longmoe.ops.registry import ImplUnavailable
from longmoe.ops.router_matmul import ROUTER_MATMUL, _Fp32Logits, _MixedLogits, router_logits


@pytest.fixture
def gen():
    # Fresh inputs every run; failures print gen.initial_seed() to reproduce.
    return torch.Generator().manual_seed(random.randrange(2**31))


@pytest.fixture
def precision():
    old = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(old)


def _inputs(gen, T, H, E, dtype, device="cpu"):
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.randn(E, H, generator=gen) * 0.05).to(dtype)
    g = torch.randn(T, E, generator=gen) * 1e-3  # softmax gradients: small, fp32
    return x.to(device), w.to(device), g.to(device)


def _run(fn, x, w, g, keep=None):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()

    def pack(t):
        if keep is not None:
            keep.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(xx, ww)
    y.backward(g.to(y.dtype))
    return y.detach(), xx.grad, ww.grad


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_fp32_reference_matches_linear_on_casts_and_keeps_no_fp32_copy(gen, dtype):
    # The reference against autograd over F.linear on fp32 casts (the plain way to write the
    # router): same logits and gradients; the graph keeps x in its own dtype.
    T, H, E = 37, 24, 11
    x, w, g = _inputs(gen, T, H, E, dtype)
    acc = torch.promote_types(dtype, torch.float32)
    kept = []
    ours = _run(_Fp32Logits.apply, x, w, g.double(), kept)
    ref = _run(lambda a, b: torch.nn.functional.linear(a.to(acc), b.to(acc)), x, w, g.double())
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert sorted(kept) == sorted([(dtype, (T, H)), (dtype, (E, H))])


@pytest.mark.parametrize("shape", [(37, 24, 11), (130, 72, 9), (1, 16, 3)])
@pytest.mark.parametrize("prec", ["high", "highest"])
def test_mixed_against_fp64_and_the_reference(gen, precision, shape, prec):
    # The logits within fp32 rounding of fp64; the backward is the reference's, bit for bit; only
    # the bf16 inputs are kept.
    T, H, E = shape
    x, w, g = _inputs(gen, T, H, E, torch.bfloat16)
    precision(prec)
    kept = []
    y, dx, dw = _run(_MixedLogits.apply, x, w, g, kept)
    assert y.dtype == torch.float32 and dx.dtype == dw.dtype == torch.bfloat16
    assert sorted(kept) == sorted([(torch.bfloat16, (T, H)), (torch.bfloat16, (E, H))])
    assert _rel(y, x.double() @ w.double().t()) < 1e-6
    ref = _run(_Fp32Logits.apply, x, w, g)
    torch.testing.assert_close(y, ref[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(dx, ref[1]) and torch.equal(dw, ref[2])


def test_registry_picks_reference_without_native_mixed_gemm(gen):
    x, w, _ = _inputs(gen, 5, 8, 3, torch.bfloat16)
    assert ROUTER_MATMUL.select("auto", x, w).name == "reference"  # CPU: no mm(out_dtype=float32)
    with pytest.raises(ImplUnavailable, match="mixed"):
        router_logits(x, w, "mixed")
    assert "bf16" in ROUTER_MATMUL.why_not("mixed", x.float(), w.float())


def test_bad_impl_names_the_field():
    from longmoe.errors import ConfigError
    from longmoe.train.config import ImplConfig
    with pytest.raises(ConfigError, match="impl.router_matmul"):
        ImplConfig(router_matmul="tf16")


def test_paired_cli_case(gen):
    from longmoe.paired.cli import run_paired
    res = run_paired("router_matmul", seed=int(gen.initial_seed()))
    assert res.ok and set(res.errors) == {"logits", "dX", "dW"}, res.errors


@pytest.mark.needs_cuda
@pytest.mark.parametrize("T", [4096, 1000])
def test_mixed_on_gpu(precision, T):
    g0 = torch.Generator().manual_seed(T)
    x, w, g = _inputs(g0, T, 2048, 256, torch.bfloat16, "cuda")
    assert ROUTER_MATMUL.select("auto", x, w).name == "mixed"
    precision("high")
    x64, w64, g64 = x.double(), w.double(), g.double()
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = router_logits(xx, ww)
    # cuBLAS's bf16 GEMM with fp32 output measured 2.1e-6 here on an H200 (IEEE fp32 3.9e-7,
    # TF32 3.3e-6; bench/router_gemm.py)
    assert _rel(y, x64 @ w64.t()) < 1e-5
    dx, dw = torch.autograd.grad(y, (xx, ww), g)
    assert _rel(dx, g64 @ w64) < 2 ** -8 and _rel(dw, g64.t() @ x64) < 2 ** -8  # bf16 outputs

