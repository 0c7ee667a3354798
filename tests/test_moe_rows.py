"""The MoE row kernels (combine, dispatch gradient, SwiGLU) against the eager reference:
Triton under the interpreter on CPU, on the GPU where there is one, and inside the chunk pipeline
on real gloo ranks. (The eager reference is checked against autograd and index_add in
test_moe_pipeline.py and test_expert_parallel.py.)"""

import random

import pytest
import torch

from longmoe.paired.cases import moe_rows_case
from longmoe.ops.moe_rows import MOE_ROWS, gather_sum
from _interpreter import last_json_line, run_interpreted


def test_auto_is_the_reference_on_cpu_without_interpreter():
    assert MOE_ROWS.select("auto", torch.zeros(2, 2, dtype=torch.bfloat16)).name == "reference"
    assert MOE_ROWS.why_not("triton", torch.zeros(2, dtype=torch.float64))  # fp64: reference only


def test_gather_sum_rejects_a_ragged_top_k():
    with pytest.raises(ValueError, match="top_k=3"):
        gather_sum(torch.zeros(4, 2), torch.arange(4), None, 3)


@pytest.mark.slow  # over 10 s on two cores
def test_triton_rows_under_interpreter():
    # Fresh seeds; odd H and F tile the host configs (16, 8) with masked tails; K = 1; one token.
    code = ("import json, random, torch\n"
            "from longmoe.paired.cases import moe_rows_case\n"
            "cases = [dict(dtype=torch.float32), dict(dtype=torch.bfloat16),\n"
            "         dict(dtype=torch.float16, T=5, K=8, H=48, F=16),\n"
            "         dict(T=1, K=1, H=5, F=3), dict(T=9, K=2, H=33, F=17)]\n"
            "print(json.dumps([moe_rows_case('triton', random.randrange(2**31), **c).to_dict()"
            " for c in cases]))\n")
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    for res in last_json_line(p.stdout):
        assert res["ok"] and res["candidate"] == "triton", res


@pytest.mark.slow  # the slow tier: the pipeline on ranks under the interpreter
def test_pipeline_with_triton_rows_under_interpreter():
    # The chunk pipeline on 2 gloo ranks (expert chunks) and 1 rank (token chunks; expert chunks,
    # whose combines read the chunks' rows in place) with the Triton row kernels, against one
    # process on the eager reference.
    code = ("import json, random\n"
            "from longmoe.paired.dist_cases import ep_case\n"
            "s = random.randrange(2**31)\n"
            "out = [ep_case(2, s, T=19, chunks=3, top_k=2, rows_impl='triton').to_dict(),\n"
            "       ep_case(1, s, T=19, chunks=2, top_k=3, chunk_by='tokens',"
            " rows_impl='triton').to_dict(),\n"
            "       ep_case(1, s, T=19, chunks=3, top_k=2, rows_impl='triton').to_dict()]\n"
            "print(json.dumps(out, default=str))\n")
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    for res in last_json_line(p.stdout):
        assert res["ok"] and "rows:triton" in res["candidate"], res


_PARTS_CODE = (
    "import json, random, torch\n"
    "from longmoe.ops.moe_rows import gather_sum, gather_sum_parts\n"
    "dev = {dev!r}; s = random.randrange(2**31); g = torch.Generator().manual_seed(s)\n"
    "bad = []\n"
    "for sizes in ([5, 0, 7], [3, 4], [0, 6, 1, 2], [2, 3, 1, 4, 2], [9]):\n"
    "    for dt in (torch.float32, torch.bfloat16):\n"
    "        T, K, H = 6, 3, 37\n"
    "        rows = torch.randn(sum(sizes), H, generator=g).to(dev, dt)\n"
    "        parts = list(rows.split(sizes))\n"
    "        parts = [p.clone() for p in parts]  # separate buffers\n"
    "        idx = torch.randint(0, sum(sizes), (T * K,), generator=g).to(dev)\n"
    "        w = torch.rand(T * K, generator=g).to(dev)\n"
    "        base = torch.randn(T, H, generator=g).to(dev, dt)\n"
    "        want = gather_sum(rows, idx, w, K, out=base.clone(), accumulate=True,"
    " impl='reference')\n"
    "        got = gather_sum_parts(parts, idx, w, K, out=base.clone(), accumulate=True,"
    " impl='triton')\n"
    "        tol = 1e-5 if dt == torch.float32 else 5e-2  # bf16: the reference rounds w * x\n"
    "        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):\n"
    "            bad.append([sizes, str(dt), s])\n"
    "print(json.dumps(bad))\n")


def test_gather_sum_parts_under_interpreter():
    # The combine over rows left in separate buffers (one rank's chunks) equals the combine over
    # their concatenation: empty buffers, one buffer, and more than the kernel takes (five).
    p = run_interpreted(["-c", _PARTS_CODE.format(dev="cpu")])
    assert p.returncode == 0, p.stderr[-2000:]
    assert last_json_line(p.stdout) == []


@pytest.mark.needs_cuda
def test_gather_sum_parts_on_gpu():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _PARTS_CODE.format(dev="cuda")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert last_json_line(p.stdout) == []


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rows_on_gpu(dtype):
    # Qwen3.5-35B-A3B's widths (H 2048, F 512, top-8) and an odd token count.
    res = moe_rows_case("triton", random.randrange(2**31), T=1031, K=8, H=2048, F=512,
                        dtype=dtype, device="cuda")
    assert res.ok, res.failures()
