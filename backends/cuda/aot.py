"""NVIDIA compile targets: registers and spills from ptxas -v on the kernel's PTX."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from longmoe.backends.aot import CompileTarget


def _ptxas_usage(compiled) -> tuple[int, int, int]:
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        tool = get_ptxas(90)  # triton >= 3.7 picks ptxas per arch
    except TypeError:
        tool = get_ptxas()
    ptxas = getattr(tool, "path", tool)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(compiled.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True, check=True)
    text = r.stdout + r.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return regs, spills, int(getattr(compiled.metadata, "shared", 0) or 0)


# H100/H200: 255 registers per thread, 227 KiB of shared memory per block.
TARGETS = (CompileTarget("sm_90", "cuda", "cuda", 90, 32, 255, 227 * 1024, _ptxas_usage),)
