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


def test_pipeline_with_triton_rows_under_interpreter():
    # The chunk pipeline on 2 gloo ranks (expert chunks) and 1 rank (token chunks) with the
    # Triton row kernels, against one process on the eager reference.
    code = ("import json, random\n"
            "from longmoe.paired.dist_cases import ep_case\n"
            "s = random.randrange(2**31)\n"
            "out = [ep_case(2, s, T=19, chunks=3, top_k=2, rows_impl='triton').to_dict(),\n"
            "       ep_case(1, s, T=19, chunks=2, top_k=3, chunk_by='tokens',"
            " rows_impl='triton').to_dict()]\n"
            "print(json.dumps(out, default=str))\n")
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    for res in last_json_line(p.stdout):
        assert res["ok"] and "rows:triton" in res["candidate"], res


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_rows_on_gpu(dtype):
    # Qwen3.5-35B-A3B's widths (H 2048, F 512, top-8) and an odd token count.
    res = moe_rows_case("triton", random.randrange(2**31), T=1031, K=8, H=2048, F=512,
                        dtype=dtype, device="cuda")
    assert res.ok, res.failures()
