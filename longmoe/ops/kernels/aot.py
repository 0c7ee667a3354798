"""Ahead-of-time compile checks: every shipped kernel config is compiled for every target GPU with
Triton's `GPUTarget` (no GPU needed) and its registers/VGPRs, shared memory/LDS and spills are
read from the compiler's output: ptxas -v for NVIDIA, the AMDGPU metadata for AMD.

A config that does not compile, spills, or exceeds the target's budget is a failure: the CPU test
suite and `longmoe kernels compile` run this.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Per-target budgets: registers per thread (NVIDIA) / VGPRs per lane (AMD), shared memory / LDS
# bytes per block. sm_90: 255 regs, 227 KiB smem; gfx942: 512 VGPRs (with AGPRs), 64 KiB LDS;
# gfx950: 512 VGPRs, 160 KiB LDS.
TARGETS = {
    "sm_90": {"backend": "cuda", "arch": 90, "warp": 32, "vendor": "cuda", "regs": 255, "shared": 227 * 1024},
    "gfx942": {"backend": "hip", "arch": "gfx942", "warp": 64, "vendor": "rocm", "regs": 512, "shared": 64 * 1024},
    "gfx950": {"backend": "hip", "arch": "gfx950", "warp": 64, "vendor": "rocm", "regs": 512, "shared": 160 * 1024},
}


@dataclass
class CompileReport:
    kernel: str
    variant: str
    target: str
    config: dict
    ok: bool
    regs: int | None = None
    spills: int | None = None
    shared: int | None = None
    error: str = ""


def _kernel_specs():
    """(table key, kernel name, jit fn, signature, constexprs from a config, num_warps key)."""
    from longmoe.ops.kernels import ce_rows
    specs = []
    for ent in (False, True):
        specs.append(("linear_ce_rows", f"ce_row_stats{'+entropy' if ent else ''}",
                      ce_rows.ce_row_stats_kernel,
                      {"z_ptr": "*fp32", "stride_z": "i32", "labels_ptr": "*i64", "lse_ptr": "*fp32",
                       "tgt_ptr": "*fp32", "ent_ptr": "*fp32", "V": "i32", "ignore_index": "i32",
                       "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"},
                      lambda c, e=ent: {"BLOCK_V": c["BLOCK_V"], "WITH_ENTROPY": e}, "num_warps"))
    for dt in ("bf16", "fp16", "fp32"):
        specs.append(("linear_ce_rows", f"ce_row_grad[{dt}]+entropy", ce_rows.ce_row_grad_kernel,
                      {"z_ptr": "*fp32", "stride_z": "i32", "dz_ptr": f"*{dt}", "stride_dz": "i32",
                       "labels_ptr": "*i64", "lse_ptr": "*fp32", "ez_ptr": "*fp32",
                       "w_lp_ptr": "*fp32", "w_ent_ptr": "*fp32", "V": "i32", "ignore_index": "i32",
                       "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr"},
                      lambda c: {"BLOCK_V": c["BLOCK_V_GRAD"], "WITH_ENTROPY": True}, "num_warps_grad"))
    return specs


def _configs_for(table: dict, key: str, target: str) -> list[tuple[str, dict]]:
    by_arch = table.get(key, {})
    out = []
    for arch in (target, "any"):
        for bucket, cfg in by_arch.get(arch, {}).items():
            out.append((f"{arch}/{bucket}", cfg))
    return out


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        tool = get_ptxas(90)  # triton >= 3.7 picks ptxas per arch
    except TypeError:
        tool = get_ptxas()
    ptxas = getattr(tool, "path", tool)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True, check=True)
    text = r.stdout + r.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return regs, spills


def _amdgcn_usage(asm: str) -> tuple[int, int, int]:
    def field(name):
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0
    vgpr = field("vgpr_count")
    agpr = field("agpr_count")
    spills = field("vgpr_spill_count") + field("sgpr_spill_count")
    return vgpr + agpr, spills, field("group_segment_fixed_size")


def compile_all(target: str, table: dict | None = None, only: str | None = None) -> list[CompileReport]:
    """Compile every config of the target vendor's shipped table (or of `table`); `only` keeps
    the kernel variants whose name starts with it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from longmoe.backends.kernels import load_kernel_table
    import longmoe.backends as lb
    t = TARGETS[target]
    if table is None:
        table = load_kernel_table(Path(lb.__file__).parent / t["vendor"] / "kernels.json")
    gpu = GPUTarget(t["backend"], t["arch"], t["warp"])
    reports = []
    for key, name, fn, sig, constexprs, warps_key in _kernel_specs():
        if only and not name.startswith(only):
            continue
        for where, cfg in _configs_for(table, key, target):
            rep = CompileReport(key, name, target, {"where": where, **cfg}, ok=False)
            opts = {"num_warps": cfg[warps_key]}
            if t["backend"] == "hip":
                opts.update({k: cfg[k] for k in ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
                             if k in cfg})
            try:
                src = ASTSource(fn=fn, signature=sig, constexprs=constexprs(cfg))
                k = triton.compile(src, target=gpu, options=opts)
                rep.shared = int(getattr(k.metadata, "shared", 0) or 0)
                if t["backend"] == "cuda":
                    rep.regs, rep.spills = _ptxas_usage(k.asm["ptx"])
                else:
                    rep.regs, rep.spills, lds = _amdgcn_usage(k.asm["amdgcn"])
                    rep.shared = max(rep.shared, lds)
                rep.ok = rep.spills == 0 and rep.regs <= t["regs"] and rep.shared <= t["shared"]
                if not rep.ok:
                    rep.error = f"over budget (regs {rep.regs}/{t['regs']}, spills {rep.spills}, shared {rep.shared}/{t['shared']})"
            except Exception as e:  # a config that does not compile is a finding, not a crash
                rep.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            reports.append(rep)
    return reports


def run_kernels_cli(target: str, as_json: bool = False) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    targets = list(TARGETS) if target == "all" else [target]
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    reports = [r for t in targets for r in compile_all(t)]
    if as_json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        table = Table(title="longmoe kernels compile")
        for col in ("target", "kernel", "config", "regs/VGPRs", "shared/LDS", "spills", "ok"):
            table.add_column(col)
        for r in reports:
            cfg = ", ".join(f"{k}={v}" for k, v in r.config.items())
            table.add_row(r.target, escape(r.variant), cfg, str(r.regs), str(r.shared), str(r.spills),
                          "yes" if r.ok else f"NO {r.error}")
        Console(width=160).print(table)
    return 0 if reports and all(r.ok for r in reports) else 1
