"""Compile checks for flash-linear-attention's Gated DeltaNet kernels (the `fla` fast path of
longmoe/ops/gated_delta.py), for every GPU target, without a GPU.

fla's kernels are launched by its own host code with shapes decided there, so the signatures are
not written out here: one forward+backward of `chunk_gated_delta_rule` is run on CPU tensors of
the preset's per-head shape with Triton's launcher replaced by a recorder (and each autotuner
reduced to its configs, without benchmarking). Every recorded launch is then compiled for the
target with each of its autotune configs, and checked against the target's register, shared
memory/LDS and spill budgets like our own kernels (aot.py). Needs the package; on CPU the host
code's outputs are uninitialised memory, which is fine because nothing reads them.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from longmoe.ops.kernels.aot import CompileReport, compile_and_check


@contextlib.contextmanager
def _recording():
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    launches: list = []
    configs: dict = {}
    run_jit, run_at = JITFunction.run, Autotuner.run

    def rec_jit(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    def rec_at(self, *args, **kwargs):
        configs[id(self.fn)] = list(self.configs)
        return self.fn.run(*args, **{**kwargs, **self.configs[0].all_kwargs()})

    JITFunction.run, Autotuner.run = rec_jit, rec_at
    try:
        yield launches, configs
    finally:
        JITFunction.run, Autotuner.run = run_jit, run_at


def record_launches(heads: int = 32, head_dim: int = 128, tokens: int = 256):
    """[(jit fn, bound arguments, autotune configs or None)], one per distinct kernel+constants."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    shape = (1, tokens, heads, head_dim)
    with _recording() as (launches, configs):
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(shape[:3]).requires_grad_()
        beta = torch.rand(shape[:3], dtype=torch.bfloat16).requires_grad_()
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()
    out, seen = [], set()
    for fn, args, kwargs in launches:
        bound = dict(zip(fn.arg_names, args)) | kwargs
        key = (fn.__name__, tuple(sorted((k, v) for k, v in bound.items()
                                         if not isinstance(v, torch.Tensor))))
        if key not in seen:
            seen.add(key)
            out.append((fn, bound, configs.get(id(fn))))
    return out


_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
       torch.int64: "i64"}
_TUNED = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _signature(fn, bound: dict):
    sig, consts = {}, {}
    for p in fn.params:
        v = bound.get(p.name)
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DT[v.dtype]
        elif v is None:
            sig[p.name] = "constexpr"
            consts[p.name] = None
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
    return sig, consts


def compile_fla(target: str, all_configs: bool = False,
                progress: Callable[[int, int, CompileReport], None] | None = None
                ) -> list[CompileReport]:
    """Each recorded kernel with its first and last autotune config (all with all_configs);
    `progress(done, total, report)` after each compile."""
    from triton.backends.compiler import GPUTarget
    from longmoe.backends.aot import compile_targets
    t = compile_targets()[target]
    gpu = GPUTarget(t.triton_backend, t.arch, t.warp_size)
    jobs, reports = [], []
    for fn, bound, cfgs in record_launches():
        picked = list(enumerate(cfgs or [None]))
        if not all_configs and len(picked) > 2:
            picked = [picked[0], picked[-1]]
        jobs += [(fn, bound, i, cfg) for i, cfg in picked]
    for fn, bound, i, cfg in jobs:
        b = dict(bound)
        opts = {k: b.pop(k) for k in _TUNED if k in b and b[k] is not None}
        if cfg is not None:
            b.update(cfg.kwargs)
            opts.update({k: getattr(cfg, k) for k in _TUNED
                         if getattr(cfg, k, None) is not None})
        opts = {k: v for k, v in opts.items() if k in ("num_warps", "num_stages")}
        sig, consts = _signature(fn, b)
        rep = CompileReport("fla", fn.__name__, target,
                            {"config": i, **{k: v for k, v in consts.items()
                                             if isinstance(v, (int, bool)) and k.isupper()},
                             **opts}, ok=False)
        reports.append(compile_and_check(rep, t, gpu, fn, sig, consts, opts))
        if progress:
            progress(len(reports), len(jobs), rep)
    return reports
