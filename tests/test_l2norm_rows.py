"""The fused q/k L2 norm of the Triton Gated DeltaNet core (ops/kernels/l2norm_rows.py) on CPU
under TRITON_INTERPRET=1, paired two ways: against the plain expression x * rsqrt(|x|^2 + eps) *
scale in fp64, and against the eager chain it replaces (L2Norm on x.float(), * scale, the cast).
Values and gradients (random upstream weights), row counts that end in a partial tile of the host
table's 4 rows, D = 16, 32, 128, rows small enough that eps shows, scales other than 1, fp32 /
fp16 / bf16 storage (mixed in and out too), strided inputs, fresh random inputs each run.

Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (`cast_impl`; compiled kernels round to
nearest even), so bf16 results are within one bf16 ulp of the eager chain here, not bit-equal."""

import json
import random
import sys

import pytest
import torch

from _interpreter import last_json_line, run_interpreted

# (leading shape, D, x dtype, output dtype, scale, layout of x): "slice" as the layer hands q
# and k over (columns of a wider tensor, read in place), "transposed" a view whose leading dims
# do not merge (copied first)
CASES = {
    "fp32_d16": ((2, 37, 3), 16, "float32", "float32", 0.25, None),
    "fp16_d32_q": ((1, 53, 1), 32, "float16", "float16", 32 ** -0.5, None),
    "fp16_d128_k_slice": ((3, 19, 2), 128, "float16", "float16", 1.0, "slice"),
    "bf16_d128_q": ((2, 29, 2), 128, "bfloat16", "bfloat16", 128 ** -0.5, None),
    "bf16_d16_slice": ((1, 41, 3), 16, "bfloat16", "bfloat16", 3.0, "slice"),
    "fp32_d32_transposed": ((3, 11, 2), 32, "float32", "float32", 0.5, "transposed"),
    "bf16_in_fp32_out": ((1, 23, 5), 128, "bfloat16", "float32", 128 ** -0.5, None),
    "fp32_in_bf16_out": ((2, 13, 3), 32, "float32", "bfloat16", 2.0, None),
}
# largest |error| / largest |reference| in a row: y by the output's dtype, dx by the coarser of
# the two (dy arrives in the output's, dx is stored in x's). fp32 is the kernel's own rounding;
# fp16 and bf16 a few ulps of the row's largest value (dy's rounding grows where the projection
# cancels most of it; bf16 rounds by up to a whole ulp, 2^-7 of a value, under the interpreter)
TOL_EXACT = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}
# against the eager chain (the same dy): y by the output's dtype, dx by x's. fp32 differs only
# in the order of the row sums; the 16-bit dtypes by at most one ulp where the two fp32 results
# round to neighbours (2^-10 resp. 2^-7 of a value)
TOL_EAGER = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1e-2}
EPS = 1e-6


def _coarser(a: str, b: str) -> str:
    order = ("float32", "float16", "bfloat16")
    return max(a, b, key=order.index)


def _err(a, b):
    """Largest |error| / largest |reference| within a row, over the rows: the small-norm rows'
    gradients are ~1e3 times the others', and one maximum over all would hide the rest."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-300)).max())


def _case(lead, D, in_dt, out_dt, scale, layout, seed, device="cpu"):
    from longmoe.ops.gated_delta import L2Norm
    from longmoe.ops.kernels.l2norm_rows import _as_NHD, l2norm_rows
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=gen, dtype=torch.float64)
    # rows with |x|^2 near eps, where rsqrt(|x|^2 + eps) and 1 / |x| part
    small = torch.rand(*lead, generator=gen) < 0.2
    x = torch.where(small[..., None], x * 1e-4, x)
    idt, odt = getattr(torch, in_dt), getattr(torch, out_dt)
    # the layouts are made on the device: moving a view there would copy it into a dense tensor
    x = x.to(device)
    if layout == "slice":
        wide = torch.randn(*lead, 2 * D, generator=gen, dtype=torch.float64).to(device, idt)
        wide[..., D:] = x.to(idt)
        x_in = wide[..., D:]
    elif layout == "transposed":
        x_in = x.to(idt).transpose(0, 1).contiguous().transpose(0, 1)
    else:
        x_in = x.to(idt)
    assert x_in.is_contiguous() == (layout is None)
    # the layer's slices are read where they lie; only what cannot be rows x strides is copied
    assert (_as_NHD(x_in).data_ptr() == x_in.data_ptr()) == (layout != "transposed")
    # upstream weights with a part along each row of x as large as the rest (a loss that sees
    # the output's direction), so the backward's projection term is as large as the rest too
    along = torch.randn(*lead, 1, generator=gen, dtype=torch.float64) * D ** 0.5
    w = torch.randn(*lead, D, generator=gen, dtype=torch.float64).to(device) + (
        along.to(device) * x / x.norm(dim=-1, keepdim=True))

    def grad_of(fn, leaf):
        leaf = leaf.detach().requires_grad_()
        y = fn(leaf)
        (dx,) = torch.autograd.grad((y.double() * w).sum(), leaf)
        return y.detach(), dx

    got_y, got_dx = grad_of(lambda t: l2norm_rows(t, scale, odt, EPS), x_in)
    eager_y, eager_dx = grad_of(lambda t: (L2Norm.apply(t.float(), EPS) * scale).to(odt), x_in)
    x64 = x_in.double()

    def plain(t, eps=EPS):
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + eps) * scale

    want_y, want_dx = grad_of(plain, x64)
    # what a kernel without eps, or without the backward's projection term, would give
    no_eps_y = plain(x64, eps=0.0)
    r = torch.rsqrt(x64.pow(2).sum(-1, keepdim=True) + EPS)
    no_proj_dx = scale * r * w.to(odt).double()
    assert got_y.dtype == odt and got_dx.dtype == idt and got_y.shape == x_in.shape
    return {"y_exact": _err(got_y, want_y), "dx_exact": _err(got_dx, want_dx),
            "y_eager": _err(got_y, eager_y), "dx_eager": _err(got_dx, eager_dx),
            "y_bits_equal": float((got_y == eager_y).double().mean()),
            "dx_bits_equal": float((got_dx == eager_dx).double().mean()),
            "mutant_no_eps": _err(no_eps_y, want_y),
            "mutant_no_projection": _err(no_proj_dx, want_dx)}


def _empty():
    """No rows: no launch, empty results and gradient."""
    from longmoe.ops.kernels.l2norm_rows import l2norm_rows
    x = torch.randn(0, 3, 16, requires_grad=True)
    y = l2norm_rows(x, 0.5)
    y.sum().backward()
    return list(y.shape) == [0, 3, 16] and list(x.grad.shape) == [0, 3, 16]


@pytest.fixture(scope="module")
def results():
    seed = random.randrange(2**31)
    p = run_interpreted([__file__, str(seed)], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return seed, last_json_line(p.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_expression_in_fp64(results, case):
    seed, res = results
    r, (in_dt, out_dt) = res[case], CASES[case][2:4]
    assert r["y_exact"] < TOL_EXACT[out_dt], (seed, r)
    assert r["dx_exact"] < TOL_EXACT[_coarser(in_dt, out_dt)], (seed, r)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_eager_chain_it_replaces(results, case):
    seed, res = results
    r, (in_dt, out_dt) = res[case], CASES[case][2:4]
    assert r["y_eager"] < TOL_EAGER[out_dt] and r["dx_eager"] < TOL_EAGER[in_dt], (seed, r)
    # where the interpreter rounds as torch does, the same computation gives mostly the same bits
    for name, dt in (("y", out_dt), ("dx", in_dt)):
        if dt != "bfloat16":
            assert r[f"{name}_bits_equal"] > 0.5, (seed, name, r)


@pytest.mark.parametrize("case", list(CASES))
def test_a_kernel_without_eps_or_the_projection_term_would_fail(results, case):
    """The tolerances sit far below what dropping eps (F.normalize-style 1/|x|) or the
    backward's -y * sum(g * y) term changes."""
    seed, res = results
    r, (in_dt, out_dt) = res[case], CASES[case][2:4]
    assert r["mutant_no_eps"] > 5 * TOL_EXACT[out_dt], (seed, r)
    assert r["mutant_no_projection"] > 5 * TOL_EXACT[_coarser(in_dt, out_dt)], (seed, r)


def test_no_rows(results):
    assert results[1]["empty"]


@pytest.mark.needs_cuda
def test_bf16_on_gpu_matches_the_expression_and_the_eager_chain():
    """Compiled, the casts round to nearest even; the layer's shapes (16 heads of 128), q's
    scale, the layer's column slices."""
    seed = random.randrange(2**31)
    r = _case((2, 1031, 16), 128, "bfloat16", "bfloat16", 128 ** -0.5, "slice", seed, "cuda")
    assert max(r["y_exact"], r["dx_exact"]) < TOL_EXACT["bfloat16"], (seed, r)
    assert max(r["y_eager"], r["dx_eager"]) < TOL_EAGER["bfloat16"], (seed, r)
    assert min(r["mutant_no_eps"], r["mutant_no_projection"]) > 5 * TOL_EXACT["bfloat16"], r


@pytest.mark.parametrize("shape,dtype", [((4, 24), torch.float32), ((4, 8), torch.float32),
                                         ((4, 16), torch.float64)])
def test_declines_what_one_tile_per_row_cannot_take(shape, dtype):
    from longmoe.ops.kernels.l2norm_rows import l2norm_rows
    with pytest.raises(ValueError, match="l2norm_rows"):
        l2norm_rows(torch.randn(shape, dtype=dtype))


@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx950"])
def test_compiles_without_spills(target):
    from longmoe.ops.kernels.aot import compile_all
    reports = compile_all(target, only="l2norm_rows")
    assert {r.variant for r in reports} >= {"l2norm_rows_fwd[bf16]", "l2norm_rows_bwd[bf16]"}
    assert all(r.ok and r.spills == 0 for r in reports), [(r.variant, r.error) for r in reports]


if __name__ == "__main__":  # the interpreted half: one process for every case
    base = int(sys.argv[1])
    out = {name: _case(*spec, seed=base + i) for i, (name, spec) in enumerate(CASES.items())}
    out["empty"] = _empty()
    print(json.dumps(out))
