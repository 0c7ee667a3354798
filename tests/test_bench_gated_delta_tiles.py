"""`longmoe bench gated-delta-tiles` (the per-kernel tile sweep of the Triton Gated DeltaNet core):
its input checks through the command, its table from a report, and the compile check's spill
allowances in the shipped NVIDIA entry (each one needed: without it that kernel fails)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from longmoe.bench.gated_delta_tiles import markdown_table

def _cli(*args):
    env = {**os.environ, "LONGMOE_BACKEND": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "longmoe", "bench", "gated-delta-tiles", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("configs,names", [('[{"BV_QQ": 16}]', "BV_QQ"),
                                           ('{"BV": 16}', "--configs"),
                                           ('[{"num_warps": 4}]', "no GPU")])
def test_bad_input_is_one_line(configs, names):
    p = _cli("--configs", configs)
    assert p.returncode == 2, p.stderr
    errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and names in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_table_lists_each_kernel_per_config():
    rows = [{"T": 64, "variant": "fla_fwd", "status": "ok", "fwd_ms": 1.5},
            {"T": 64, "variant": "chunked_triton", "overrides": {}, "status": "ok",
             "fwd_ms": 2.0, "fwd_bwd_ms": 7.0,
             "kernels_ms": {"gdn_prep_kernel": 1.25, "gdn_bwd_qk_kernel": 2.5, "copy": 0.1}},
            {"T": 64, "variant": "chunked_triton", "overrides": {"BV": 64},
             "status": "failed: RuntimeError: boom"}]
    table = markdown_table({"results": rows}).splitlines()
    assert table[0].split(" | ")[4:6] == ["bwd_qk", "prep |"]
    assert "| 64 | table | 2.00 | 7.00 | 2.50 | 1.25 |" in table
    assert any('{"BV": 64}' in r and "boom" in r for r in table)
    assert any("fla forward | 1.50" in r for r in table)


def test_shipped_spill_allowances_are_each_needed():
    pytest.importorskip("triton")
    from longmoe.backends.aot import compile_targets
    from longmoe.backends.kernels import load_kernel_table
    from longmoe.ops.kernels.aot import compile_all, spill_allowance
    table = load_kernel_table(compile_targets()["sm_90"].kernel_table)
    entry = table["gated_delta_chunk"]["any"]["any"]
    assert spill_allowance(entry, "gdn_output@aligned") == entry["max_spills"]["gdn_output"]
    assert spill_allowance(entry, "gdn_prep") == 0
    for kernel in entry["max_spills"]:
        strict = copy.deepcopy(table)
        del strict["gated_delta_chunk"]["any"]["any"]["max_spills"]
        got = compile_all("sm_90", table=strict, only=kernel)
        mine = [r for r in got if r.variant.split("@")[0] == kernel]
        assert mine and all(not r.ok and r.spills > 0 for r in mine), (kernel, mine)
        allowed = compile_all("sm_90", table=table, only=kernel)
        assert all(r.ok for r in allowed if r.variant.split("@")[0] == kernel)
