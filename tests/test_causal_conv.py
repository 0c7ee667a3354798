"""The depthwise causal conv + SiLU kernels of the Gated DeltaNet layer (ops/kernels/causal_conv.py)
on CPU under TRITON_INTERPRET=1, paired against the eager `causal_conv_silu` of model/deltanet.py
in fp64 on the same (rounded) inputs: y and the gradients of x, w and the halo under random
upstream gradients (representable in the tested dtype, so only the kernels' own rounding shows).
Lengths 1, 3, 37, 130 and widths 24, 100 against the host table's 16-token programs and
128-channel blocks (one case in 64-channel blocks: two, the second partial); 2 to 4 taps (8
once); plain, with a halo, with packed rows' history (samples restarting mid-program and inside
the first K-1 tokens of a row and of a program, one-token samples, a row continuing a sample
from before the span, fully or for one token), both together; a column slice of a wider x read
in place; fp32, fp16, bf16 (and bf16 x with fp32 w); fresh random inputs each run. Also: the
history's reach bits against their definition, which path GatedDeltaNet._conv takes where, the
compile checks, and the bf16 kernels on a GPU.

Triton 3.9's interpreter rounds fp32 -> bf16 toward zero (compiled kernels round to nearest
even), so bf16 results sit within one bf16 ulp of the reference here. The interpreter runs a
kernel's token loop step by step (~10 ms a step), so the cases are short and split over two
processes, which start before the compile checks so the two overlap."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from _interpreter import ENV, last_json_line

# (B, S, C, K, x dtype, w dtype, halo, history, x a column slice of a wider tensor)
CASES = {
    "fp32_plain": (1, 37, 100, 4, "float32", "float32", False, False, False),
    "fp16_plain_k3": (1, 130, 24, 3, "float16", "float16", False, False, False),
    "bf16_plain_k2_s3": (2, 3, 24, 2, "bfloat16", "bfloat16", False, False, False),
    "fp32_halo_s1": (2, 1, 100, 4, "float32", "float32", True, False, False),
    "fp32_halo_k3": (1, 37, 24, 3, "float32", "float32", True, False, False),
    "fp16_halo": (2, 37, 100, 4, "float16", "float16", True, False, False),
    "fp32_history": (2, 37, 24, 4, "float32", "float32", False, True, False),
    "bf16_history_k3": (1, 37, 100, 3, "bfloat16", "bfloat16", False, True, False),
    "fp32_halo_history": (2, 70, 24, 4, "float32", "float32", True, True, False),
    "bf16_halo_history": (2, 37, 24, 4, "bfloat16", "bfloat16", True, True, False),
    "fp16_halo_history_k2_s3": (1, 3, 100, 2, "float16", "float16", True, True, False),
    "fp32_halo_history_slice": (2, 37, 100, 4, "float32", "float32", True, True, True),
    "bf16_x_fp32_w_halo_history": (1, 37, 100, 4, "bfloat16", "float32", True, True, False),
    "fp32_halo_history_k8": (1, 37, 24, 8, "float32", "float32", True, True, False),
    # y as the layer takes it, q | k | v in three contiguous tensors (split=): parts inside one
    # channel block, and (narrow) a block straddling a part's edge
    "fp32_halo_history_split": (2, 37, 100, 4, "float32", "float32", True, True, False, True),
    "bf16_plain_split_narrow": (1, 37, 100, 3, "bfloat16", "bfloat16", False, False, False, True),
}
# channel blocks other than the host table's 128 (kernel_overrides): C = 100 in two
NARROW = {"fp32_plain": 64, "bf16_plain_split_narrow": 64}
# largest |error| / largest |reference| per tensor, by the dtype it is stored in: fp32 is the
# kernels' fp32 sums in another order; fp16 a rounding to 11 bits; bf16 one ulp (2^-7) of the
# largest value at most, the interpreter's truncation
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
HALVES = 2


def _err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0


def _history(B, S, K, halo, gen):
    """Packed rows: random restarts plus one at token 1 (inside the row's first K-1), at 17 and
    18 (a one-token sample inside the first K-1 of a 16-token program) and at 33. With a halo
    the last row continues a sample from before the span (5 tokens back for one row: every tap
    reads the halo; 1 token back for the last of two: only the nearest halo token) and row 0
    of two begins one at token 0 (no tap reads the halo)."""
    starts = torch.rand(B, S, generator=gen) < 0.15
    starts[:, 0] = True
    for t in (1, 17, 18, 33):
        if t < S:
            starts[0, t] = True
    t = torch.arange(S).expand(B, S)
    hist = t - torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    if halo:
        first = starts.long().cumsum(1) == 1  # the row's first sample
        hist[-1] += first[-1] * (1 if B > 1 else 5)
    return hist


def _case(B, S, C, K, x_dt, w_dt, halo, history, sliced, seed, device="cpu", split=False):
    from longmoe.model.deltanet import causal_conv_silu
    from longmoe.ops.kernels.causal_conv import _unit_channel, causal_conv_silu_triton
    gen = torch.Generator().manual_seed(seed)
    xd, wd = getattr(torch, x_dt), getattr(torch, w_dt)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    wide = r(B, S, C + 9 if sliced else C).to(device, xd)
    w = (r(C, K) * 0.7).to(device, wd)
    h = r(B, K - 1, C).to(device, xd) if halo else None
    hist = _history(B, S, K, halo, gen).to(device) if history else None
    dy = r(B, S, C).to(device, xd)
    leaves = [t.requires_grad_() for t in (wide, w, h) if t is not None]

    def x_of(t):
        return t[..., 4:4 + C] if sliced else t

    if sliced:  # read where it lies: no copy of x
        assert _unit_channel(x_of(wide)).data_ptr() == x_of(wide).data_ptr()
    if split:  # uneven parts; each comes back contiguous
        parts = causal_conv_silu_triton(x_of(wide), w, h, hist, split=(C // 4, C // 3,
                                                                       C - C // 4 - C // 3))
        assert [t.shape[-1] for t in parts] == [C // 4, C // 3, C - C // 4 - C // 3]
        assert all(t.is_contiguous() for t in parts)
        y = torch.cat(parts, -1)
    else:
        y = causal_conv_silu_triton(x_of(wide), w, h, hist)
    got = [y, *torch.autograd.grad((y * dy).sum(), leaves)]
    got[1] = x_of(got[1])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_h = ref_leaves[2] if halo else None
    want_y = causal_conv_silu(x_of(ref_leaves[0]), ref_leaves[1], ref_h, hist)
    want = [want_y, *torch.autograd.grad((want_y * dy.double()).sum(), ref_leaves)]
    want[1] = x_of(want[1])
    assert [t.dtype for t in got] == [xd, xd, wd] + ([xd] if halo else [])
    out = {name: _err(a, b) for name, a, b in zip(("y", "dx", "dw", "dhalo"), got, want)}
    # what a kernel ignoring the history, or the halo, would give
    if history:
        out["mutant_no_history"] = _err(causal_conv_silu(x_of(ref_leaves[0]), ref_leaves[1],
                                                         ref_h, None), want_y)
    if halo:
        out["mutant_no_halo"] = _err(causal_conv_silu(x_of(ref_leaves[0]), ref_leaves[1],
                                                      None, hist), want_y)
    return out


def _wiring():
    """Under the interpreter: which impls run the Triton kernel in GatedDeltaNet._conv, for the
    three ways the layer calls it (and halo with history), and its outputs against the eager
    conv; an fp64 layer (no kernel dtype) with history."""
    from longmoe.config import get_preset
    from longmoe.model.deltanet import GatedDeltaNet, causal_conv_silu
    from longmoe.ops.kernels import causal_conv
    calls = []
    real = causal_conv.causal_conv_silu_triton
    causal_conv.causal_conv_silu_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
    layer = GatedDeltaNet(get_preset("tiny-hybrid"))
    K, C = layer.kernel, layer.conv_dim
    x, halo = torch.randn(1, 9, C), torch.randn(1, K - 1, C)
    hist = _history(1, 9, K, True, torch.Generator().manual_seed(1))
    modes = {"plain": (None, None), "halo": (halo, None), "history": (None, hist),
             "both": (halo, hist)}
    runs = [(impl, mode, torch.float32) for impl in ("auto", "chunked_triton", "fla",
                                                     "chunked_compiled", "chunked", "reference")
            for mode in modes]
    # fp64 with history only: the eager F.conv1d path takes seconds on its first fp64 call
    runs += [("auto", "history", torch.float64), ("auto", "both", torch.float64)]
    out = {}
    for impl, mode, dtype in runs:
        layer.to(dtype)
        layer.impl = impl
        args = [a if a is None or not a.is_floating_point() else a.to(dtype)
                for a in modes[mode]]
        n = len(calls)
        y = layer._conv(x.to(dtype), *args)
        if isinstance(y, tuple):  # the kernel's q, k, v, each contiguous
            assert all(t.is_contiguous() for t in y) and \
                [t.shape[-1] for t in y] == [layer.Hk * layer.dk] * 2 + [layer.Hv * layer.dv]
            y = torch.cat(y, -1)
        want = causal_conv_silu(x.to(dtype), layer.conv1d.weight[:, 0], *args)
        out[f"{impl}/{mode}/{str(dtype)[6:]}"] = [len(calls) > n, _err(y, want)]
    return out


def _reach_bits_match_their_definition(seed: int) -> bool:
    """reach_bits against a loop over tokens and taps."""
    from longmoe.ops.kernels.causal_conv import reach_bits
    gen = torch.Generator().manual_seed(seed)
    for K in (2, 4, 8):
        hist = _history(2, 23, K, True, gen)
        got = reach_bits(hist, K)
        for b in range(2):
            for p in range(23 + K - 1):
                u = p - (K - 1)
                want = sum(1 << c for c in range(1, K)
                           if 0 <= u + c < 23 and hist[b, u + c] >= c)
                if int(got[b, p]) != want:
                    return False
    return True


def _run_half(seed: int, half: int) -> dict:
    from longmoe.backends import active_backend
    out = {}
    for i, name in enumerate(CASES):
        if i % HALVES != half:
            continue
        narrow = {"BLOCK_C": NARROW[name], "BLOCK_C_BWD": NARROW[name]} if name in NARROW else {}
        with active_backend().kernel_overrides("causal_conv", narrow):
            spec = CASES[name]
            out[name] = _case(*spec[:9], seed=seed + i, split=len(spec) > 9 and spec[9])
    if half == 0:
        out["wiring"] = _wiring()
    return out


@pytest.fixture(scope="module")
def launched():
    """Both halves started in interpreter processes (the compile checks, first in this file,
    run meanwhile)."""
    seed = random.randrange(2**31)
    procs = [subprocess.Popen([sys.executable, __file__, str(seed), str(h)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **ENV}) for h in range(HALVES)]
    yield seed, procs
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def results(launched):
    seed, procs = launched
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.update(last_json_line(stdout))
    return seed, out


# One target in the fast tier (the quickest to compile on CPU), the others in the slow tier.
@pytest.mark.parametrize("target", [pytest.param("sm_90", marks=pytest.mark.slow), "gfx942",
                                    pytest.param("gfx950", marks=pytest.mark.slow)])
def test_compiles_without_spills(launched, target):
    from longmoe.ops.kernels.aot import compile_all
    reports = compile_all(target, only="causal_conv")
    assert {r.variant for r in reports} >= {"causal_conv_fwd[bf16]", "causal_conv_bwd[bf16]",
                                            "causal_conv_fwd[bf16]+halo+history",
                                            "causal_conv_bwd[bf16]+halo+history"}
    assert all(r.ok and r.spills == 0 for r in reports), [(r.variant, r.error) for r in reports]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_eager_conv_in_fp64(results, case):
    seed, res = results
    r, spec = res[case], CASES[case]
    x_dt, w_dt, halo = spec[4], spec[5], spec[6]
    assert max(r["y"], r["dx"]) < TOL[x_dt], (seed, r)
    assert r["dw"] < TOL[w_dt], (seed, r)
    if halo:
        assert r["dhalo"] < TOL[x_dt], (seed, r)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][6] or CASES[c][7]])
def test_a_kernel_ignoring_the_history_or_the_halo_would_fail(results, case):
    seed, res = results
    r, tol = res[case], TOL[CASES[case][4]]
    for key in ("mutant_no_history", "mutant_no_halo"):
        if key in r:
            assert r[key] > 5 * tol, (seed, key, r)


def test_the_layer_runs_the_kernel_where_triton_runs(results):
    """Under the interpreter (where Triton kernels run), every impl but the compiled and eager
    cores' runs the kernel, for each way the layer calls it, and gets the eager conv's outputs;
    fp64 (no kernel dtype) stays off it."""
    seed, res = results
    for key, (ran, err) in res["wiring"].items():
        impl, _, dtype = key.split("/")
        kernel = impl in ("auto", "chunked_triton", "fla") and dtype != "float64"
        assert ran == kernel, key
        assert err < (TOL["float32"] if dtype == "float32" else 1e-12), (seed, key, err)


def test_reach_bits_match_their_definition():
    assert _reach_bits_match_their_definition(random.randrange(2**31))


def test_cpu_without_the_interpreter_keeps_the_eager_and_compiled_paths(monkeypatch):
    """No interpreter: the CPU layer runs the eager conv, and the compiled one where compiled
    pieces are forced (as the packing tests run the GPU path on CPU); never the kernel."""
    from longmoe.config import get_preset
    from longmoe.model import deltanet
    from longmoe.ops.compiled import forced
    from longmoe.ops.kernels import causal_conv
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(causal_conv, "causal_conv_silu_triton",
                        lambda *a, **k: pytest.fail("the Triton conv ran on CPU"))
    compiled_fns = []
    monkeypatch.setattr(deltanet, "compiled",
                        lambda fn, **kw: compiled_fns.append(fn) or fn)
    layer = deltanet.GatedDeltaNet(get_preset("tiny-hybrid"))
    x = torch.randn(1, 9, layer.conv_dim)
    layer._conv(x)
    assert compiled_fns == []
    with forced("aot_eager_decomp_partition"):
        layer._conv(x, history_BS=torch.arange(9)[None])
    assert compiled_fns == [deltanet.causal_conv_silu]


@pytest.mark.parametrize("bad", ["taps", "halo", "history", "dtype", "split"])
def test_declines_what_it_cannot_take(bad):
    from longmoe.ops.kernels.causal_conv import causal_conv_silu_triton
    x, w = torch.randn(1, 5, 8), torch.randn(8, 9 if bad == "taps" else 4)
    halo = torch.randn(1, 2, 8) if bad == "halo" else None
    history = torch.zeros(1, 5) if bad == "history" else None
    split = (4, 4, 1) if bad == "split" else None
    with pytest.raises(ValueError, match="causal_conv"):
        causal_conv_silu_triton(x.double() if bad == "dtype" else x, w, halo, history, split)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("spec", [(1, 4099, 8192, 4, False, False, False, False),
                                  (1, 4099, 8192, 4, False, False, False, True),
                                  (2, 1031, 1000, 4, True, True, True, True)])
def test_bf16_on_gpu_matches_the_eager_conv_in_fp64(spec):
    """Compiled kernels (casts round to nearest even) at the layer's width, split into three
    outputs or not, and a packed, context-parallel piece of a column slice, odd sizes."""
    B, S, C, K, halo, history, sliced, split = spec
    seed = random.randrange(2**31)
    r = _case(B, S, C, K, "bfloat16", "bfloat16", halo, history, sliced, seed, "cuda", split)
    assert max(r.get(k, 0.0) for k in ("y", "dx", "dw", "dhalo")) < TOL["bfloat16"], (seed, r)


if __name__ == "__main__":  # the interpreted half: one process per half of the cases
    print(json.dumps(_run_half(int(sys.argv[1]), int(sys.argv[2]))))
