"""Grouped GEMM implementations against a per-row dense reference."""

import random

import pytest
import torch

from longmoe.ops import grouped_mm
from longmoe.paired.cases import grouped_mm_case
from _interpreter import last_json_line, run_interpreted


def test_loop_matches_per_row_reference():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    sizes = [3, 0, 7, 1, 0, 5]
    x = torch.randn(sum(sizes), 13, dtype=torch.float64, generator=g)
    w = torch.randn(len(sizes), 13, 9, dtype=torch.float64, generator=g)
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    ref = torch.einsum("mk,mkn->mn", x, w[group])
    torch.testing.assert_close(grouped_mm(x, w, sizes, impl="reference"), ref)


@pytest.mark.parametrize("sizes", [(5, 0, 17, 1, 9), (0, 0, 4), (0, 0, 0)])
def test_auto_paired(sizes):
    res = grouped_mm_case("auto", random.randrange(2**31), sizes=sizes)
    assert res.ok, res.failures()


def test_empty_groups_keep_graph_connected():
    # A rank whose experts receive no rows must still produce a gradient path to x: the
    # backward all-to-all upstream of it runs on every rank.
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    out = grouped_mm(x, w, [0, 0, 0], impl="reference")
    assert out.shape == (0, 4) and out.grad_fn is not None
    (out.sum()).backward()
    assert x.grad is not None


def test_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sizes"):
        grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 3), [2, 2])


@pytest.mark.needs_cuda
def test_torch_grouped_mm_bf16_on_gpu():
    res = grouped_mm_case("torch", random.randrange(2**31), sizes=(16, 0, 48, 32), K=64, N=128,
                          dtype=torch.bfloat16)
    assert res.ok, res.failures()


def test_triton_grouped_gemm_under_interpreter():
    # The portable Triton kernels (forward/dX and dW) on CPU tensors through Triton's interpreter,
    # against the loop reference: odd group sizes, empty groups, all-empty.
    code = ("import json, random\n"
            "from longmoe.paired.cases import grouped_mm_case\n"
            "out = [grouped_mm_case('triton', random.randrange(2**31), sizes=s, K=40, N=24).to_dict()"
            " for s in [(5, 0, 17, 1, 9), (0, 0, 4), (0, 0, 0), (33,)]]\n"
            "print(json.dumps(out))\n")
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    for res in last_json_line(p.stdout):
        assert res["ok"] and res["candidate"] == "triton", res


@pytest.mark.needs_cuda
def test_triton_grouped_gemm_bf16_on_gpu():
    res = grouped_mm_case("triton", random.randrange(2**31), sizes=(300, 0, 17, 512, 1), K=256,
                          N=384, dtype=torch.bfloat16)
    assert res.ok, res.failures()


def test_compile_check_covers_the_aligned_variant():
    # Triton specialises arguments divisible by 16 at run time; the compile check builds that
    # variant too (on sm_90 the grouped GEMM's loads then go through cp.async into a deeper
    # shared-memory pipeline), so its budgets are checked for the code that really runs.
    from longmoe.ops.kernels.aot import _aligned_attrs, compile_all
    reports = compile_all("sm_90", only="grouped_mm[bf16]")
    by = {(r.variant, r.config["where"]): r for r in reports}
    wheres = {w for _, w in by}
    assert wheres and all(("grouped_mm[bf16]@aligned", w) in by for w in wheres)
    assert all(r.ok for r in reports), [(r.variant, r.error) for r in reports if not r.ok]
    assert any(by[("grouped_mm[bf16]@aligned", w)].shared != by[("grouped_mm[bf16]", w)].shared
               for w in wheres)
    sig = {"x_ptr": "*bf16", "M": "i32", "K": "i32", "stride_xm": "i32", "BLOCK": "constexpr"}
    assert set(_aligned_attrs(sig)) == {(0,), (2,), (3,)}  # not the row count M, not constexprs
