"""The fused RMS norm kernels (ops/kernels/norm_rows.py) on CPU under TRITON_INTERPRET=1, paired
with the eager functions they replace (rms_norm, norm_rope and gated_rms_norm, longmoe/ops/norm.py,
also imported from longmoe.model.layers and deltanet) and with the same expressions in fp64: values and the
gradients of x, the weight and the gate (random upstream weights), row counts that end in a
partial tile of the host table's 4 rows and a partial backward program (2 tiles), widths of
2048, 256, 128, 96 and 24, q as the layer slices it (beside the output gate, per head), shared
([S, R]) and per-token ([B, S, R]) cos/sin, unit_offset both ways, fp32 / bf16 / fp16, fresh
random inputs each run. The "norm" registry's choices and the layers' wiring are checked here too.

Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (compiled kernels round to nearest
even), so every bf16 rounding the kernels share with the eager chain may land one ulp apart
here; fp32 differs only in the order of the row sums."""

import json
import random
import sys

import pytest
import torch

from _interpreter import last_json_line, run_interpreted

EPS = 1e-6
# kind, leading shape, D, x dtype, weight dtype, extra:
#   rms:   unit_offset
#   rope:  (unit_offset, R, per-token cos/sin, q sliced beside a gate, cos/sin dtype)
#   gated: (x's storage dtype before the rounding to `dtype`, gate sliced)
CASES = {
    "rms_fp32_d96": ("rms", (3, 7), 96, "float32", "float32", False),
    "rms_bf16_d2048_offset": ("rms", (1, 5), 2048, "bfloat16", "float32", True),
    "rms_bf16_d256_bf16_weight": ("rms", (2, 3, 5), 256, "bfloat16", "bfloat16", False),
    "rms_fp16_d128_offset": ("rms", (13,), 128, "float16", "float32", True),
    "rope_bf16_d256_r64_q_slice": ("rope", (2, 5, 3), 256, "bfloat16", "bfloat16",
                                   (True, 64, False, True, "bfloat16")),
    "rope_fp32_d128_full_per_token": ("rope", (2, 7, 2), 128, "float32", "float32",
                                      (False, 128, True, False, "float32")),
    "rope_bf16_d96_r32_per_token_slice": ("rope", (3, 3, 3), 96, "bfloat16", "float32",
                                          (True, 32, True, True, "bfloat16")),
    "rope_bf16_fp32_cos": ("rope", (1, 9, 2), 64, "bfloat16", "float32",
                           (False, 16, False, False, "float32")),
    "gated_fp32_core_bf16_d128": ("gated", (2, 5, 3), 128, "bfloat16", "float32",
                                  ("float32", False)),
    "gated_bf16_d96_bf16_weight": ("gated", (3, 7), 96, "bfloat16", "bfloat16",
                                   ("bfloat16", True)),
    "gated_fp32_d24": ("gated", (5, 5), 24, "float32", "float32", ("float32", False)),
    "gated_fp16_d128_gate_slice": ("gated", (1, 11, 2), 128, "float16", "float32",
                                   ("float16", True)),
}
# largest |error| / largest |reference| of each tensor. Against the eager chain: fp32 the order
# of the row sums (and of dweight's sum over rows); fp16 a few ulps of the largest value (the
# interpreter rounds it as torch does: the forward gives the same bits); bf16 the interpreter's
# truncation in every rounding the two share, up to 3 on a path (RoPE's and the gated norm's
# backward), 1.8e-2 seen
TOL_EAGER = {"float32": 2e-6, "float16": 4e-3, "bfloat16": 4e-2}
# against fp64: the storage dtype's rounding of the inputs' path
TOL_EXACT = {"float32": 2e-5, "float16": 8e-3, "bfloat16": 5e-2}


def _err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _coarser(*names):
    order = ("float32", "float16", "bfloat16")
    return max(names, key=order.index)


def _rope_ref(x, w, eps, uo, cos, sin, sign=1.0):
    """norm_rope in plain fp64 steps (sign -1: rotated the wrong way, the mutant)."""
    from longmoe.model.layers import apply_rope, rms_norm
    return apply_rope(rms_norm(x, w, eps, uo), cos, sign * sin)


def _gated64(x, gate, w, dtype):
    x = x.to(dtype).double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return n * w.double() * torch.nn.functional.silu(gate.double())


def _case(kind, lead, D, x_dt, w_dt, extra, seed, device="cpu"):
    from longmoe.model.deltanet import gated_rms_norm
    from longmoe.model.layers import norm_rope, rms_norm, rope_cos_sin
    from longmoe.ops.kernels.norm_rows import gated_rms_norm_rows, norm_rope_rows, rms_norm_rows
    gen = torch.Generator().manual_seed(seed)
    xdt, wdt = getattr(torch, x_dt), getattr(torch, w_dt)

    def rnd(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dt)

    uo = extra if kind == "rms" else extra[0] if kind == "rope" else False
    w = rnd(D, scale=0.3, dt=torch.float64) + (0.0 if uo else 1.0)
    w = w.to(wdt)
    dy_dt = xdt
    if kind == "rope":
        _, R, per_token, sliced, c_dt = extra
        B, S, N = lead
        pos = torch.randint(0, 4 * S, (B, S), generator=gen) if per_token else torch.arange(S)
        cos, sin = rope_cos_sin(pos.to(device), R, 10000.0, getattr(torch, c_dt))
        x = rnd(B, S, N, 2 * D, scale=3.0, dt=xdt)[..., :D] if sliced else \
            rnd(B, S, N, D, scale=3.0, dt=xdt)
        assert x.is_contiguous() != sliced
        dy_dt = torch.promote_types(xdt, cos.dtype)
        ins = [x, w]
        got_fn = lambda a, b: norm_rope_rows(a, b, EPS, uo, cos, sin)  # noqa: E731
        eager_fn = lambda a, b: norm_rope(a, b, EPS, uo, cos, sin)  # noqa: E731
        exact_fn = lambda a, b: _rope_ref(a, b, EPS, uo, cos.double(), sin.double())  # noqa: E731
        mutant_fn = lambda a, b: _rope_ref(a, b, EPS, uo, cos, sin, -1.0)  # noqa: E731
    elif kind == "rms":
        x = rnd(*lead, D, scale=3.0, dt=xdt)
        ins = [x, w]
        got_fn = lambda a, b: rms_norm_rows(a, b, EPS, uo)  # noqa: E731
        eager_fn = lambda a, b: rms_norm(a, b, EPS, uo)  # noqa: E731
        exact_fn = eager_fn  # fp64 stays fp64
        mutant_fn = lambda a, b: rms_norm(a, b, EPS, not uo)  # noqa: E731
    else:
        store_dt, sliced = extra
        x = rnd(*lead, D, scale=3.0, dt=getattr(torch, store_dt))
        gate = rnd(*lead, 2 * D, scale=2.0, dt=xdt)[..., D:] if sliced else \
            rnd(*lead, D, scale=2.0, dt=xdt)
        ins = [x, gate, w]
        got_fn = lambda a, g, b: gated_rms_norm_rows(a, g, b, EPS, xdt)  # noqa: E731
        eager_fn = lambda a, g, b: gated_rms_norm(a, g, b, EPS, xdt)  # noqa: E731
        exact_fn = lambda a, g, b: _gated64(a, g, b, xdt)  # noqa: E731
        mutant_fn = lambda a, g, b: gated_rms_norm(a, -g, b, EPS, xdt)  # noqa: E731
    dy = rnd(*ins[0].shape, dt=dy_dt)

    def grads(fn, tensors, cast=None):
        leaves = [(t.detach().to(cast) if cast else t.detach()).requires_grad_() for t in tensors]
        y = fn(*leaves)
        gs = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        return [y.detach(), *gs]

    got = grads(got_fn, ins)
    eager = grads(eager_fn, ins)
    exact = grads(exact_fn, ins, torch.float64)
    mutant = grads(mutant_fn, ins)
    names = ["y", "dx", "dgate", "dw"] if kind == "gated" else ["y", "dx", "dw"]
    out = {}
    for name, g, e, t, m in zip(names, got, eager, exact, mutant):
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, e.dtype)
        out[f"{name}_eager"] = _err(g, e)
        out[f"{name}_exact"] = _err(g, t)
        out[f"{name}_eager_exact"] = _err(e, t)
        out[f"{name}_mutant"] = _err(m, e)
        out[f"{name}_dtype"] = str(g.dtype).removeprefix("torch.")
        out[f"{name}_bits_equal"] = float((g == e).double().mean())
    return out


def _layers():
    """The layers with impl "triton" against "reference": the attention's q/k norm + RoPE on
    q_proj's slices (tiny-hybrid: output gate, partial rotary, unit offset), per-token
    positions; the gated norm of a Gated DeltaNet layer; the final RMSNorm."""
    from longmoe.config import get_preset
    from longmoe.model.deltanet import GatedRMSNorm
    from longmoe.model.layers import Attention, RMSNorm, rope_cos_sin
    torch.manual_seed(random.randrange(2**31))
    cfg = get_preset("tiny-hybrid")
    attn, gated, final = Attention(cfg), GatedRMSNorm(16, 1e-6), RMSNorm(64, 1e-6, True)
    with torch.no_grad():
        for m in (attn.q_norm, attn.k_norm, gated, final):
            m.weight.normal_(0.0, 0.2)
    x = torch.randn(2, 11, 64)
    pos = torch.randint(0, 30, (2, 11))
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, torch.float32)
    o, z = torch.randn(2, 11, 4, 16), torch.randn(2, 11, 4, 16)
    res = {}
    for impl in ("reference", "triton"):
        for m in (attn.q_norm, attn.k_norm, gated, final):
            m.impl = impl
            m.zero_grad()
        q, k, _, _ = attn.project(x, cos, sin)
        g = gated(o, z, fused=True)
        f = final(x)
        (q.square().sum() + k.sum() + (g * z).sum() + f.square().sum()).backward()
        res[impl] = [q, k, g, f] + [m.weight.grad for m in (attn.q_norm, attn.k_norm, gated,
                                                               final)]
    return max(_err(a.detach(), b.detach()) for a, b in zip(res["triton"], res["reference"]))


def _empty():
    from longmoe.ops.kernels.norm_rows import gated_rms_norm_rows, rms_norm_rows
    x = torch.randn(0, 3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    (rms_norm_rows(x, w, EPS, False).sum() + gated_rms_norm_rows(x, x, w, EPS).sum()).backward()
    return list(x.grad.shape) == [0, 3, 16] and float(w.grad.abs().sum()) == 0.0


@pytest.fixture(scope="module")
def results():
    seed = random.randrange(2**31)
    p = run_interpreted([__file__, str(seed)], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return seed, last_json_line(p.stdout)


def _tensors(case):
    return ["y", "dx", "dgate", "dw"] if CASES[case][0] == "gated" else ["y", "dx", "dw"]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_eager_function_it_replaces(results, case):
    seed, res = results
    r = res[case]
    for name in _tensors(case):
        # a tensor computed from x's dtype's roundings is as close as that dtype allows
        tol = TOL_EAGER[_coarser(r[f"{name}_dtype"], CASES[case][3])]
        assert r[f"{name}_eager"] < tol, (seed, name, r)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] == "float16"])
def test_fp16_forward_gives_the_eager_bits(results, case):
    """Where the interpreter rounds as torch does, the kernels' forward makes the eager chain's
    roundings: the same bits but where the fp32 row sums' order moves one across a boundary."""
    seed, res = results
    assert res[case]["y_bits_equal"] > 0.98, (seed, res[case])


@pytest.mark.parametrize("case", list(CASES))
def test_as_close_to_fp64_as_the_eager_function(results, case):
    seed, res = results
    r = res[case]
    for name in _tensors(case):
        tol = TOL_EXACT[_coarser(r[f"{name}_dtype"], CASES[case][3])]
        assert r[f"{name}_exact"] < max(2 * r[f"{name}_eager_exact"], tol), (seed, name, r)


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_kernel_would_fail(results, case):
    """The tolerances sit far below what a flipped unit offset, a rotation the wrong way or a
    gate of the wrong sign changes."""
    seed, res = results
    r = res[case]
    assert r["y_mutant"] > 5 * TOL_EAGER[_coarser(r["y_dtype"], CASES[case][3])], (seed, r)


def test_layers_with_triton_norms_match_the_reference(results):
    seed, res = results
    assert res["layers"] < 1e-5, (seed, res["layers"])


def test_no_rows(results):
    assert results[1]["empty"]


def test_registry_keeps_cpu_eager_unless_named_or_forced(monkeypatch):
    """auto on CPU: the eager reference, or the compiled graphs under ops.compiled.forced (the
    CPU tests of those graphs); triton only by name, and only where Triton runs."""
    import longmoe.ops.kernels.norm_rows  # noqa: F401  (imported with the interpreter off: its
    # kernels stay compilable for the compile checks in this process)
    from longmoe.ops.compiled import forced
    from longmoe.ops.norm import CompiledNorms, ReferenceNorms, TritonNorms, norm_ops
    from longmoe.ops.registry import ImplUnavailable
    x, w = torch.randn(3, 8), torch.randn(8)
    monkeypatch.delenv("LONGMOE_FORCE_COMPILE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert norm_ops("auto", x, w) is ReferenceNorms
    assert norm_ops("triton", x, w) is TritonNorms
    with forced("eager"):
        assert norm_ops("auto", x, w) is CompiledNorms
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ImplUnavailable, match="norm: impl 'triton' cannot run here"):
        norm_ops("triton", x, w)
    with pytest.raises(ImplUnavailable, match="compiled"):
        norm_ops("compiled", x, w)
    assert norm_ops("reference", x.double(), w) is ReferenceNorms


def test_config_field_names_an_implementation():
    from longmoe.errors import ConfigError
    from longmoe.train.config import ImplConfig
    assert ImplConfig(norm="compiled").norm == "compiled"
    with pytest.raises(ConfigError, match="impl.norm"):
        ImplConfig(norm="inductor")


def test_run_config_reaches_every_norm():
    """impl.norm is what build_model hands each RMSNorm and gated norm of the model."""
    from longmoe.model.deltanet import GatedRMSNorm
    from longmoe.model.layers import RMSNorm
    from longmoe.parallel.mesh import Layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    run = from_dict({"model": {"preset": "tiny-hybrid"}, "parallel": {"ep": 1, "fsdp": False},
                     "impl": {"norm": "compiled"}})
    model = build_model(run, Layout(1, 0, 1, None, None, None), torch.device("cpu"))
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
    assert len(norms) > 10 and {m.impl for m in norms} == {"compiled"}
    assert any(isinstance(m, GatedRMSNorm) for m in norms)


@pytest.mark.needs_cuda
def test_registry_picks_triton_on_gpu():
    from longmoe.ops.norm import CompiledNorms, TritonNorms, norm_ops
    x = torch.randn(3, 8, device="cuda")
    assert norm_ops("auto", x, x[0]) is TritonNorms
    assert norm_ops("auto", x.double(), x[0].double()) is CompiledNorms  # fp64: not ours


@pytest.mark.needs_cuda
@pytest.mark.parametrize("case", [
    ("rms", (2, 4099), 2048, "bfloat16", "float32", True),
    ("rms", (1, 777), 2048, "bfloat16", "bfloat16", False),
    ("rope", (2, 777, 16), 256, "bfloat16", "bfloat16", (True, 64, True, True, "bfloat16")),
    ("rope", (1, 1031, 2), 256, "bfloat16", "bfloat16", (True, 64, False, False, "bfloat16")),
    ("gated", (2, 777, 32), 128, "bfloat16", "float32", ("float32", False)),
], ids=["rms_h2048", "rms_h2048_bf16_weight", "rope_q_per_token", "rope_k", "gated"])
def test_gpu_bf16_at_qwen35_widths(case):
    """Compiled, the casts round to nearest even as torch's do: the eager function's results
    within its own rounding, and no further from fp64 than it."""
    seed = random.randrange(2**31)
    r = _case(*case, seed=seed, device="cuda")
    for name in (n for n in ("y", "dx", "dgate", "dw") if f"{n}_eager" in r):
        # as on CPU: a tensor stored in fp32 but computed from bf16 roundings (the gated norm's
        # fp32 input is rounded to the compute dtype first) is as close as bf16 allows
        dt = _coarser(r[f"{name}_dtype"], case[3])
        assert r[f"{name}_eager"] < TOL_EAGER[dt], (seed, name, r)
        assert r[f"{name}_exact"] < max(2 * r[f"{name}_eager_exact"], TOL_EXACT[dt]), \
            (seed, name, r)


@pytest.mark.parametrize("target", ["sm_90", "gfx942", "gfx950"])
def test_compiles_without_spills(target):
    from longmoe.ops.kernels.aot import compile_all
    reports = compile_all(target, only="norm_rows")
    assert {r.variant for r in reports} >= {
        "norm_rows_fwd[bf16]+rms", "norm_rows_bwd[bf16]+rms", "norm_rows_fwd[bf16]+rope",
        "norm_rows_bwd[bf16]+rope", "norm_rows_gated_fwd[bf16]", "norm_rows_gated_bwd[bf16]"}
    assert all(r.ok and r.spills == 0 for r in reports), [(r.variant, r.error) for r in reports]


if __name__ == "__main__":  # the interpreted half: one process for every case
    base = int(sys.argv[1])
    random.seed(base)
    out = {name: _case(*spec, seed=base + i) for i, (name, spec) in enumerate(CASES.items())}
    out["layers"] = _layers()
    out["empty"] = _empty()
    print(json.dumps(out))
