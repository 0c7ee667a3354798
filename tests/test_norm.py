"""RMSNorm's compiled path (impl.norm=compiled: torch.compile's kernels on GPUs) against the eager
function it compiles, and both against fp64; the switch that turns compiled pieces off. The
Triton kernels of the default GPU path: tests/test_norm_rows.py."""

import random

import pytest
import torch

from longmoe.model.layers import RMSNorm, rms_norm
from longmoe.ops.compiled import compile_unavailable, forced


def _case(shape, dtype, unit_offset, device="cpu"):
    seed = random.randrange(2**31)
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(*shape, generator=g, device=device) * 3).to(dtype).requires_grad_()
    norm = RMSNorm(shape[-1], 1e-6, unit_offset).to(device)
    norm.impl = "compiled"
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g, device=device) * 0.1
                          + (0.0 if unit_offset else 1.0))
    dy = torch.randn(*shape, generator=g, device=device).to(dtype)
    return seed, x, norm, dy


def _run(fn, x, w, dy):
    y = fn(x)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    return y.float(), gx.float(), gw.float()


@pytest.mark.parametrize("shape,dtype,unit_offset", [
    ((2, 37, 48), torch.float32, False), ((1, 13, 3, 64), torch.bfloat16, True),
    ((5, 96), torch.float32, True)])
def test_compiled_graph_matches_eager_on_cpu(shape, dtype, unit_offset):
    """The graph torch.compile runs (traced and partitioned into forward and backward as
    inductor would, without generating kernels) gives the eager results."""
    seed, x, norm, dy = _case(shape, dtype, unit_offset)
    eager = _run(lambda t: rms_norm(t, norm.weight, norm.eps, unit_offset), x, norm.weight, dy)
    with forced("aot_eager_decomp_partition"):
        assert compile_unavailable(x.device) is None
        got = _run(norm, x, norm.weight, dy)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, msg=f"seed {seed}", **tol)


def test_env_turns_compiled_pieces_off(monkeypatch):
    monkeypatch.setenv("LONGMOE_COMPILE", "0")
    assert "LONGMOE_COMPILE=0" in compile_unavailable(torch.device("cuda"))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("shape,unit_offset", [((1, 4099, 2048), True), ((1, 777, 16, 256), False)])
def test_gpu_compiled_norm_bf16_against_fp64(shape, unit_offset):
    """Inductor's fused kernels in bf16 against the fp64 definition, no worse than eager bf16."""
    seed, x, norm, dy = _case(shape, torch.bfloat16, unit_offset, device="cuda")
    assert compile_unavailable(x.device) is None
    got = _run(norm, x, norm.weight, dy)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    ref = _run(lambda t: rms_norm(t, w64, norm.eps, unit_offset), x64, w64, dy.double())
    eager = _run(lambda t: rms_norm(t, norm.weight, norm.eps, unit_offset), x, norm.weight, dy)
    for name, a, e, r in zip(("y", "dx", "dw"), got, eager, ref):
        scale = r.abs().max()
        err, err_eager = float((a - r).abs().max() / scale), float((e - r).abs().max() / scale)
        assert err <= max(2 * err_eager, 1e-2), (name, err, err_eager, seed)


@pytest.mark.parametrize("packed", [False, True])
def test_norm_with_rope_compiled_graph_matches_eager(packed):
    """The q/k norm and RoPE as one compiled piece (RMSNorm.with_rope) against the eager chain,
    per-row cos/sin (packed rows restart positions) as well as shared ones; gradients of x and
    the weight."""
    from longmoe.model.layers import apply_rope, rope_cos_sin
    seed, x, norm, dy = _case((2, 29, 3, 16), torch.float32, True)
    pos = torch.randint(0, 29, (2, 29)) if packed else torch.arange(29)
    cos, sin = rope_cos_sin(pos, 8, 10000.0, torch.float32)

    def eager(t):
        return apply_rope(rms_norm(t, norm.weight, norm.eps, norm.unit_offset), cos, sin)

    want = _run(eager, x, norm.weight, dy)
    with forced("aot_eager_decomp_partition"):
        got = _run(lambda t: norm.with_rope(t, cos, sin), x, norm.weight, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
