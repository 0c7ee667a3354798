"""Run Python under Triton's interpreter on CPU in a fresh process (TRITON_INTERPRET must be set
before Triton is imported), for the tests that pair Triton kernels with their references."""

import json
import os
import subprocess
import sys

ENV = {"TRITON_INTERPRET": "1", "LONGMOE_BACKEND": "cpu", "TRITON_DEFAULT_FP_FUSION": "1"}


def run_interpreted(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`python <args>` with the interpreter on; the caller checks the return code."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=timeout)


def last_json_line(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])
