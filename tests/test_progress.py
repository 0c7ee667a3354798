"""The training log when stdout is a file or a pipe: every line whole, whatever its length, and
bracketed text kept as written (longmoe.train.progress)."""

import subprocess
import sys

CHILD = r"""
from longmoe.train.progress import Progress
p = Progress(True, 2, None, "test")
p.info("chunked EP: chunks=4 (tuning cache /x/chunks.json [cuda|sm_90|nvlink-8|ep2]), " + "x" * 120)
for step in (1, 2):
    p.step({"step": step, "loss": -0.123456, "aux_loss": 0.0123, "grad_norm": 1.5,
            "tokens_per_s": 123456.0, "peak_mem_bytes": 3 * 2**30, "step_time_s": 0.25,
            "hw_tflops_per_gpu": 12.5, "mfu": 0.12, "micro_batches": 3, "useful_tokens": 30000,
            "padding_share": 0.05, "rank_cost_imbalance": 1.02, "dropped_samples": 1,
            "truncated_samples": 2, "ratio": 1.0, "kl": 0.001, "tis_weight": 0.99,
            "tis_clip_frac": 0.01, "dual_clip_frac": 0.0})
"""


def test_step_lines_never_wrap_when_stdout_is_a_pipe():
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(lines) == 3 and len(steps) == 2, p.stdout
    for ln in steps:  # each ends with its last note: nothing folded onto a line of its own
        assert len(ln) > 200 and ln.rstrip().endswith("2 truncated"), ln
    assert "[cuda|sm_90|nvlink-8|ep2]" in lines[0] and lines[0].endswith("x" * 120)
