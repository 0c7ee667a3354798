"""The Triton Gated DeltaNet core (`chunked_triton`, longmoe/ops/kernels/gated_delta_*.py) against
the one-token-at-a-time reference in fp64, on CPU under TRITON_INTERPRET=1 (the host tiles use
16-token chunks, so these lengths span several chunks and end in a partial one): output, final
state and the gradients of q, k, v, g, beta and the initial state, for fp32 and fp16 inputs (bf16
on GPUs), with strong decay (g down to -40 per token), GQA, packed sample starts (one at t = 0,
one-token samples, a start on a chunk's first token), both forms of the state passes' chunk loop
and fresh random inputs each run."""

import json
import random
import sys

import pytest
import torch

from _interpreter import last_json_line, run_interpreted

NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")

# (B, T, Hk, Hv, dk, dv, dtype, max decay per token, initial state, starts)
CASES = {
    "fp32_strong_decay_packed": (2, 101, 1, 2, 16, 32, "float32", 40.0, True, True),
    "fp32_plain": (1, 67, 2, 2, 32, 16, "float32", 1.0, False, False),
    "fp16_packed": (2, 77, 1, 2, 32, 32, "float16", 4.0, True, True),
    "fp32_chunk64_packed": (2, 130, 2, 4, 16, 16, "float32", 20.0, True, True),
    "fp32_while_loop_packed": (1, 61, 1, 2, 16, 16, "float32", 20.0, True, True),
}
# the state passes' chunk loop as the while loop that interpreters without run-time for-loop
# bounds run (runtime_loop_bounds() False), here forced where the for loop would run
WHILE_LOOP = {"fp32_while_loop_packed"}
# chunk length where not the host table's 16: 64 (the NVIDIA tiles) runs the block-wise
# inverse's off-diagonal 16 x 16 blocks
CHUNK = {"fp32_chunk64_packed": 64}
# largest |error| / largest |reference| per tensor: fp32 runs in IEEE fp32 here (the reference
# in fp64); a 16-bit dtype rounds q/k/v, Tinv, the chunk states and v_new before each product.
# The half-precision path runs as fp16 on CPU: Triton's interpreter gets bf16 dots wrong (a
# 16 x 16 bf16 product came out ~3e10 off in Triton 3.9); bf16 itself is paired on GPUs below.
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def _starts(B, T, gen):
    s = torch.rand(B, T, generator=gen) < 0.06
    s[0, 16] = True                     # on a chunk's first token: carries nothing across
    s[-1, 0] = True                     # drops that row's initial state
    s[0, 40:43] = True                  # one-token samples
    return s


def _case(B, T, Hk, Hv, dk, dv, dtype, decay, with_h0, with_starts, seed, device="cpu"):
    """Errors of chunked_triton against the fp64 reference, and how far the reference moves
    when the starts are ignored (a core that leaks state across samples)."""
    from longmoe.ops.gated_delta import GATED_DELTA, gated_delta_rule
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    leaves = [r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv),
              -torch.rand(B, T, Hv, generator=gen, dtype=torch.float64) * decay,
              torch.rand(B, T, Hv, generator=gen, dtype=torch.float64),
              r(B, Hv, dk, dv) if with_h0 else None]
    starts = _starts(B, T, gen) if with_starts else None
    if starts is not None:  # mild decay on the start tokens: a leaked state would survive them
        leaves[3] = torch.where(starts[..., None], leaves[3] * 1e-3, leaves[3])
    w_o, w_s = r(B, T, Hv, dv), r(B, Hv, dk, dv)
    leaves, starts, w_o, w_s = ([None if x is None else x.to(device) for x in leaves],
                                None if starts is None else starts.to(device),
                                w_o.to(device), w_s.to(device))
    dt = getattr(torch, dtype)
    assert GATED_DELTA.why_not("chunked_triton", *[x.to(dt) for x in leaves[:3]],
                               *leaves[3:5]) is None

    def run(impl, exact, use_starts=True):
        # q, k, v in the tested dtype, the gates and the state as the layer makes them (fp32);
        # the reference takes the same values in fp64
        xs = [None if x is None else x.to(dt if i < 3 else torch.float32) for i, x in
              enumerate(leaves)]
        xs = [None if x is None else (x.double() if exact else x).requires_grad_() for x in xs]
        o, S = gated_delta_rule(*xs[:5], initial_state=xs[5], impl=impl,
                                starts=starts if use_starts else None)
        ((o.double() * w_o).sum() + (S.double() * w_s).sum()).backward()
        return [o.detach().double(), S.detach().double()] + [
            None if x is None else x.grad.double() for x in xs]

    got = run("chunked_triton", exact=False)
    want = run("reference", exact=True)
    # a reference of zeros (the initial state's gradient in a row that starts at t = 0) must
    # be met exactly
    errs = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            for n, a, b in zip(NAMES, got, want) if b is not None}
    leak = None
    if starts is not None:
        leaky = run("reference", exact=True, use_starts=False)
        leak = float((leaky[0] - want[0]).abs().max() / want[0].abs().max())
    return {"errs": errs, "leak": leak}


def _out_dtype_case(seed):
    """o written in the inputs' half dtype against the fp32 o rounded once, and the gradients
    of the two runs (the half one takes its output gradient in half, as the layer's norm hands
    it back): the kernels round both the same way, so every difference must be zero."""
    from longmoe.ops.gated_delta import gated_delta_rule
    gen = torch.Generator().manual_seed(seed)
    B, T, Hk, Hv, d = 1, 70, 1, 2, 16
    base = [torch.randn(B, T, Hk, d, generator=gen), torch.randn(B, T, Hk, d, generator=gen),
            torch.randn(B, T, Hv, d, generator=gen),
            -torch.rand(B, T, Hv, generator=gen) * 4, torch.rand(B, T, Hv, generator=gen)]
    starts = torch.rand(B, T, generator=gen) < 0.1
    w = torch.randn(B, T, Hv, d, generator=gen, dtype=torch.float64)
    runs = []
    for out_dtype in (None, torch.float16):
        # fresh leaves each run (a same-dtype .to() would hand back the shared tensor)
        xs = [x.to(torch.float16 if i < 3 else torch.float32).clone().requires_grad_()
              for i, x in enumerate(base)]
        o, _ = gated_delta_rule(*xs, impl="chunked_triton", starts=starts, out_dtype=out_dtype)
        (o.double() * w).sum().backward()
        runs.append((o.detach(), [x.grad.double() for x in xs]))
    (o32, g32), (o16, g16) = runs
    return {"dtype": str(o16.dtype), "o": float((o16.double() - o32.half().double()).abs().max()),
            "grads": [float((a - b).abs().max()) for a, b in zip(g16, g32)]}


def test_half_output_is_the_fp32_output_rounded_once(results):
    seed, res = results
    got = res["_out_dtype"]
    assert got["dtype"] == "torch.float16", (seed, got)
    assert got["o"] == 0 and got["grads"] == [0.0] * 5, (seed, got)


@pytest.fixture(scope="module")
def results():
    seed = random.randrange(2**31)
    p = run_interpreted([__file__, str(seed)], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return seed, last_json_line(p.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_in_fp64(results, case):
    seed, res = results
    errs = res[case]["errs"]
    tol = TOL[CASES[case][6]]
    expected = set(NAMES) - ({"dh0"} if not CASES[case][8] else set())
    assert set(errs) == expected
    assert all(e < tol for e in errs.values()), (seed, errs)     # NaN fails too


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][9]])
def test_leaking_across_starts_would_fail(results, case):
    """The tolerance above is far below what one state leaking across the starts changes."""
    seed, res = results
    assert res[case]["leak"] > 20 * TOL[CASES[case][6]], (seed, res[case])


@pytest.mark.needs_cuda
def test_bf16_on_gpu_matches_reference_in_fp64():
    seed = random.randrange(2**31)
    res = _case(2, 301, 2, 4, 64, 64, "bfloat16", 20.0, True, True, seed, device="cuda")
    assert all(e < TOL["bfloat16"] for e in res["errs"].values()), (seed, res)
    assert res["leak"] > 20 * TOL["bfloat16"], (seed, res)


def test_declines_cpu_without_the_interpreter_and_auto_keeps_the_torch_core():
    from longmoe.ops import gated_delta as gd
    x = torch.randn(1, 8, 1, 16)
    g = torch.zeros(1, 8, 1)
    assert "TRITON_INTERPRET" in gd.GATED_DELTA.why_not("chunked_triton", x, x, x, g, g)
    assert gd.GATED_DELTA.select("auto", x, x, x, g, g).name == "chunked"
    assert gd.gated_delta_choice(torch.device("cpu"))["core"] == "chunked"


if __name__ == "__main__":  # the interpreted half: one process for every case
    base = int(sys.argv[1])
    from contextlib import nullcontext
    from unittest import mock

    from longmoe.backends import active_backend
    from longmoe.ops.kernels import gated_delta_chunk
    out = {}
    for i, (name, spec) in enumerate(CASES.items()):
        loop = (mock.patch.object(gated_delta_chunk, "runtime_loop_bounds", lambda: False)
                if name in WHILE_LOOP else nullcontext())
        tiles = {"CHUNK": CHUNK[name]} if name in CHUNK else {}
        with active_backend().kernel_overrides("gated_delta_chunk", tiles), loop:
            out[name] = _case(*spec, seed=base + i)
    out["_out_dtype"] = _out_dtype_case(base + len(CASES))
    print(json.dumps(out))


def test_bench_anchors_on_fla_forward_and_records_what_cannot_run():
    from longmoe.bench.gated_delta import add_fla_ratios, markdown_table, run_bench
    rep = run_bench([32], ["chunked", "chunked_triton", "fla_direct"], "tiny-hybrid", warmup=0,
                    iters=1)
    rows = {r["variant"]: r for r in rep["results"]}
    assert rows["chunked"]["status"] == "ok" and rows["chunked"]["fwd_ms"] > 0
    assert "cannot run here" in rows["chunked_triton"]["status"]     # no interpreter here
    assert rows["fla_direct"]["status"].startswith("skipped")          # CPU: no fla kernels
    assert "fwd_vs_fla_fwd" not in rows["chunked"]                     # no anchor, no ratio
    # with an anchor: each ok row over fla's forward at its own T; a refused backward stays
    # a reason, not a number
    fwd, both = random.uniform(1, 5), random.uniform(5, 20)
    res = [{"variant": "fla_direct", "T": 8, "status": "ok", "fwd_ms": 2.0,
            "bwd_status": "refused: RuntimeError: x"},
           {"variant": "chunked_triton", "T": 8, "status": "ok", "fwd_ms": fwd,
            "fwd_bwd_ms": both, "extra_peak_bytes": 0},
           {"variant": "chunked", "T": 16, "status": "ok", "fwd_ms": 1.0, "fwd_bwd_ms": 2.0}]
    add_fla_ratios(res)
    assert res[1]["fwd_vs_fla_fwd"] == fwd / 2 and res[1]["fwd_bwd_vs_fla_fwd"] == both / 2
    assert res[0]["fwd_vs_fla_fwd"] == 1 and "fwd_bwd_vs_fla_fwd" not in res[0]
    assert "fwd_vs_fla_fwd" not in res[2]
    assert "refused" in markdown_table({"results": res})
