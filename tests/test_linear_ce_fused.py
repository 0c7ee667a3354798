"""Fused-gradient losses (CE, GRPO/PPO) and the Triton row kernels against the references."""

import json
import random

import pytest
import torch

from longmoe.ops import linear_cross_entropy, linear_policy_loss
from longmoe.rl.objective import Objective, TokenInputs
from longmoe.backends.aot import compile_targets
from longmoe.ops.kernels.aot import compile_all
from _interpreter import run_interpreted
from longmoe.paired.cases import policy_loss_case


def fresh_seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk,coef", [((53, 29, 131), 8, 0.01), ((9, 16, 400), 4, 0.0),
                                              ((64, 12, 33), 100, 0.1)])
def test_fused_policy_loss_matches_reference(dtype, shape, chunk, coef):
    T, H, V = shape
    seed = fresh_seed()
    res = policy_loss_case("fused_torch", seed, T=T, H=H, V=V, dtype=dtype, chunk_tokens=chunk,
                           objective=Objective(entropy_coef=coef))
    assert res.ok, (seed, res.failures())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk", [((53, 29, 131), 8), ((9, 16, 400), 4)])
def test_fused_inplace_policy_loss_matches_reference(dtype, shape, chunk):
    T, H, V = shape
    seed = fresh_seed()
    res = policy_loss_case("fused_inplace_torch", seed, T=T, H=H, V=V, dtype=dtype,
                           chunk_tokens=chunk)
    assert res.ok, (seed, res.failures())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lowp_policy_loss_matches_reference(dtype):
    # bf16 logits move log-probs by ~1e-4 to 1e-3 here: a token that close to a clip bound can
    # change regime and its gradient with it, which is why fused_lowp is not the default. The
    # gradient math is checked with bounds no token reaches.
    seed = fresh_seed()
    res = policy_loss_case("fused_lowp_torch", seed, T=61, H=24, V=301, dtype=dtype,
                           chunk_tokens=16, objective=Objective(clip_low=0.99, clip_high=50.0,
                                                                entropy_coef=0.01))
    assert res.ok, (seed, res.failures())


def test_policy_loss_clipping_and_on_policy_by_hand():
    # Two tokens, vocab 2, hidden 1: logits are w * h, so log-probs are known in closed form.
    h = torch.tensor([[1.0], [2.0]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.5], [-0.5]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1])
    lp = torch.log_softmax((h @ w.T), -1).gather(1, y[:, None])[:, 0].detach()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    # Token 0: ratio 2 with A > 0 is clipped at 1.28 (no gradient); token 1 on-policy (NaN).
    old = torch.tensor([float(lp[0]) - torch.log(torch.tensor(2.0)).item(), float("nan")],
                       dtype=torch.float64)
    objective = Objective()
    inputs = TokenInputs(adv, objective.token_weights(y != -100, 2), old)
    loss, lp_out, _ = linear_policy_loss(h, w, y, objective, inputs, impl="fused_torch")
    expected = -(1.28 * 1.0 + 1.0 * -2.0) / 2
    assert abs(float(loss) - expected) < 1e-12
    torch.testing.assert_close(lp_out, lp)
    loss.backward()
    # Only token 1 carries gradient: d/dh1 of -(A * logp1)/2.
    assert h.grad[0].abs().item() < 1e-15 and h.grad[1].abs().item() > 1e-3


def test_fused_ce_matches_naive_with_grads():
    T, H, V = 37, 11, 90
    g = torch.Generator().manual_seed(fresh_seed())
    h = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=g)
    y[::4] = -100
    for red in ("mean", "sum"):
        a = linear_cross_entropy(h, w, y, reduction=red, impl="chunked", chunk_tokens=6)
        ga = torch.autograd.grad(a * 0.7, [h, w])
        b = torch.nn.functional.cross_entropy(h @ w.T, y, reduction=red)
        gb = torch.autograd.grad(b * 0.7, [h, w])
        torch.testing.assert_close(a, b)
        for x, z in zip(ga, gb):
            torch.testing.assert_close(x, z)


def test_policy_loss_bad_shapes():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    objective = Objective(kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        linear_policy_loss(h, w, y, objective, TokenInputs(torch.randn(5), torch.ones(4),
                                                           ref_logprobs=-torch.rand(4)))
    with pytest.raises(ValueError, match="weights"):
        linear_policy_loss(h, w, y, objective, TokenInputs(torch.randn(4), torch.ones(3),
                                                           ref_logprobs=-torch.rand(4)))
    with pytest.raises(ValueError, match="ref_logprobs: required .*kl_coef=0.1"):
        linear_policy_loss(h, w, y, objective, TokenInputs(torch.randn(4), torch.ones(4)))


def _has_gpu() -> bool:
    from longmoe.backends import active_backend
    return active_backend().device_type != "cpu"


@pytest.mark.skipif(_has_gpu(), reason="GPU machines run the compiled kernels instead "
                                       "(test_triton_paths_on_gpu); the interpreter check is for CPU CI")
# The default (in-place) layout in the fast tier, the split layout in the slow tier.
@pytest.mark.parametrize("primitive,impl", [
    pytest.param("linear_ce", "triton", marks=pytest.mark.slow),
    pytest.param("policy_loss", "fused", marks=pytest.mark.slow),
    ("linear_ce", "triton_inplace"), ("policy_loss", "fused_inplace")])
def test_triton_kernels_under_interpreter(primitive, impl):
    # The Triton row kernels run on CPU tensors through Triton's interpreter.
    out = run_interpreted(["-m", "longmoe", "paired", primitive, "--impl", impl, "--json",
                           "--seed", str(random.randrange(2**31))])
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["ok"] and res["candidate"] == impl, res


@pytest.mark.slow  # 16 s on 2 cores; the bf16 split path also runs in the memory test below
@pytest.mark.skipif(_has_gpu(), reason="GPU machines run the compiled kernels instead")
def test_inplace_kernels_under_interpreter_bf16():
    # bf16 inputs take the kernels the fp32 paired run does not: a bf16 gradient beside fp32
    # logits (triton), written over their bytes (triton_inplace), bf16 logits with the arg-max
    # and fix-ups (triton_lowp).
    code = (
        "import json, sys, torch\n"
        "from longmoe.paired.cases import linear_ce_case, policy_loss_case\n"
        "from longmoe.rl.objective import Objective\n"
        "s = int(sys.argv[1]); out = {}\n"
        "kw = dict(T=37, H=24, V=301, dtype=torch.bfloat16, chunk_tokens=8)\n"
        "for impl in ('triton', 'triton_inplace', 'triton_lowp'):\n"
        "    out[impl] = linear_ce_case(impl, s, **kw).failures()\n"
        "out['fused_inplace'] = policy_loss_case('fused_inplace', s, **kw).failures()\n"
        "wide = Objective(clip_low=0.99, clip_high=50.0, entropy_coef=0.01)\n"
        "out['fused_lowp'] = policy_loss_case('fused_lowp', s, objective=wide, **kw).failures()\n"
        "print(json.dumps(out))\n")
    seed = random.randrange(2**31)
    out = run_interpreted(["-c", code, str(seed)])
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(res.values()), (seed, res)


@pytest.mark.skipif(_has_gpu(), reason="GPU machines measure the allocator instead "
                                       "(test_inplace_layout_holds_one_logits_chunk_on_gpu)")
def test_inplace_layouts_drop_the_gradient_chunk_and_fp32_dw():
    # Tensor bytes (paired.memtrack) of the Triton paths under the interpreter, CE and the policy
    # loss with entropy: the in-place layout holds neither the bf16 [C, V] gradient chunk nor the
    # fp32 [V, H] accumulator of the split one, and lowp holds half its chunk.
    code = (
        "import json, torch\n"
        "from longmoe.ops import linear_cross_entropy, linear_policy_loss\n"
        "from longmoe.paired.memtrack import TensorBytes\n"
        "from longmoe.rl.objective import Objective, TokenInputs\n"
        "T, H, V, C = 64, 8, 1024, 32\n"
        "h = torch.randn(T, H).bfloat16().requires_grad_()\n"
        "w = torch.randn(V, H).bfloat16().requires_grad_()\n"
        "y = torch.randint(0, V, (T,))\n"
        "obj = Objective(entropy_coef=0.01)\n"
        "x = TokenInputs(torch.randn(T), obj.token_weights(y != -100, T))\n"
        "out = {}\n"
        "for ce, pl in (('triton', 'fused'), ('triton_inplace', 'fused_inplace'),\n"
        "               ('triton_lowp', 'fused_lowp')):\n"
        "    with TensorBytes() as a:\n"
        "        linear_cross_entropy(h, w, y, impl=ce, chunk_tokens=C).backward()\n"
        "    with TensorBytes() as b:\n"
        "        linear_policy_loss(h, w, y, obj, x, impl=pl, chunk_tokens=C)[0].backward()\n"
        "    out[ce] = [a.peak, b.peak]\n"
        "print(json.dumps(out))\n")
    out = run_interpreted(["-c", code])
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    C, V, H = 32, 1024, 8
    for k in range(2):  # CE, policy loss
        split, inplace, lowp = (peaks[n][k] for n in ("triton", "triton_inplace", "triton_lowp"))
        assert inplace + C * V * 2 + V * H * 4 <= split, peaks
        assert lowp + C * V * 2 <= inplace, peaks


# One target in the fast tier (the quickest to compile on CPU), the others in the slow tier.
@pytest.mark.parametrize("target", [pytest.param("sm_90", marks=pytest.mark.slow), "gfx942",
                                    pytest.param("gfx950", marks=pytest.mark.slow)])
def test_every_kernel_config_compiles_without_spills(target):
    assert target in compile_targets()
    reports = compile_all(target)
    assert reports, "no kernel configs found"
    bad = [(r.variant, r.config.get("where"), r.error) for r in reports if not r.ok]
    assert not bad, bad
    assert all(r.regs and r.regs > 0 for r in reports)


def test_compile_check_flags_an_over_budget_config():
    # An 8K-wide fp32 tile in one warp (256 values per lane) cannot fit in registers: the check
    # must report the spills.
    table = {"linear_ce_rows": {"any": {"any": {"BLOCK_V": 8192, "num_warps": 1,
                                                "BLOCK_V_GRAD": 8192, "num_warps_grad": 1}}}}
    reports = compile_all("sm_90", table=table, only="ce_row_stats+entropy")
    assert reports and all(not r.ok and r.spills > 0 for r in reports)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_paths_on_gpu(dtype):
    from longmoe.paired.cases import linear_ce_case
    seed = fresh_seed()
    # fused_lowp with clip bounds no token reaches (test_fused_lowp_policy_loss_matches_reference)
    wide = Objective(clip_low=0.99, clip_high=50.0, entropy_coef=0.01)
    for ce, pl, obj in (("triton", "fused", None), ("triton_inplace", "fused_inplace", None),
                        ("triton_lowp", "fused_lowp", wide)):
        res = linear_ce_case(ce, seed, T=1031, H=256, V=5003, dtype=dtype, chunk_tokens=300)
        assert res.ok, (ce, seed, res.failures())
        res = policy_loss_case(pl, seed, T=1031, H=256, V=5003, dtype=dtype, chunk_tokens=300,
                               objective=obj)
        assert res.ok, (pl, seed, res.failures())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_z_loss_matches_reference(reduction):
    g = torch.Generator().manual_seed(fresh_seed())
    h = torch.randn(37, 11, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(90, 11, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 90, (37,), generator=g)
    y[::4] = -100
    a = linear_cross_entropy(h, w, y, reduction=reduction, impl="chunked", chunk_tokens=6, z_loss=1e-2)
    ga = torch.autograd.grad(a, [h, w])
    z = h @ w.T
    lse = torch.logsumexp(z, -1)
    per = torch.nn.functional.cross_entropy(z, y, reduction="none") + 1e-2 * lse**2 * (y != -100)
    b = per.sum() / ((y != -100).sum() if reduction == "mean" else 1)
    gb = torch.autograd.grad(b, [h, w])
    torch.testing.assert_close(a, b)
    for x, r in zip(ga, gb):
        torch.testing.assert_close(x, r)
    with pytest.raises(ValueError, match="z_loss"):
        linear_cross_entropy(h, w, y, reduction="none", z_loss=1e-2)


@pytest.mark.parametrize("nproc,V,chunk", [(2, 123, 8), (4, 101, 5)])
def test_vocab_parallel_matches_single_rank(nproc, V, chunk):
    # V split over gloo ranks (unevenly for 4 ranks and V=101): log-probs, entropy, dH on every
    # rank and the concatenated dW equal the single-rank reference, fp64.
    from longmoe.paired.dist_cases import vocab_parallel_case
    seed = fresh_seed()
    res = vocab_parallel_case(nproc, seed, V=V, chunk=chunk)
    assert res.ok, (seed, res.failures())
