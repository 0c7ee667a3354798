"""Ahead-of-time compile checks: every shipped kernel config is compiled for every target GPU with
Triton's `GPUTarget` (no GPU needed) and its registers/VGPRs, shared memory/LDS and spills are
read from the compiled kernel by the target's backend.

A config that does not compile, spills, or exceeds the target's budget is a failure: the CPU test
suite and `longmoe kernels compile` (aot_cli.py) run this. The targets, their budgets and how to read a
compiled kernel's resources come from longmoe.backends (each vendor registers its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from longmoe.backends.aot import compile_targets

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


def _l2norm_specs():
    """The q/k norm of the Triton Gated DeltaNet core as training runs it: bf16 in and out,
    Qwen3.5's 128-wide heads."""
    from longmoe.ops.kernels import l2norm_rows as ln
    rows = lambda c: {"D": 128, "BLOCK_ROWS": c["BLOCK_ROWS"]}  # noqa: E731
    tail = {"M": "i32", "H": "i32", "stride_n": "i32", "stride_h": "i32", "scale": "fp32"}
    consts = {"D": "constexpr", "BLOCK_ROWS": "constexpr"}
    return [
        ("l2norm_rows", "l2norm_rows_fwd[bf16]", ln.l2norm_rows_fwd_kernel,
         {"x_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*fp32", **tail, "eps": "fp32", **consts},
         rows, "num_warps"),
        ("l2norm_rows", "l2norm_rows_bwd[bf16]", ln.l2norm_rows_bwd_kernel,
         {"x_ptr": "*bf16", "r_ptr": "*fp32", "dy_ptr": "*bf16", "dx_ptr": "*bf16", **tail,
          **consts}, rows, "num_warps"),
    ]


def _norm_specs():
    """The RMS norms as Qwen3.5's layers run them in training, bf16 tensors and weights (FSDP's
    param_dtype): RMSNorm over the 2048-wide hidden (bucket "any"), the q/k norm with RoPE over
    256-wide heads rotating 64 dims, the gated norm over 128-wide value heads ("d<=256"). A
    table key "norm_rows@BUCKET" compiles only that bucket's entries (the runtime looks a row
    width up in one bucket)."""
    from longmoe.ops.kernels import norm_rows as nr
    bf, f32 = "*bf16", "*fp32"
    ints = {"M": "i32", "H": "i32"}
    specs = []
    for tag, bucket, D, R in (("rms", "any", 2048, 0), ("rope", "d<=256", 256, 64)):
        flags = {"D": D, "R": R, "UNIT_OFFSET": True, "ROPE": R > 0, "XR": 1, "PR": 1,
                 "BLOCK_D": D}
        consts = {k: "constexpr" for k in (*flags, "BLOCK_ROWS")}
        tail = {**ints, "stride_n": "i32", "stride_h": "i32", "CS": "i32"}
        specs.append((f"norm_rows@{bucket}", f"norm_rows_fwd[bf16]+{tag}", nr.norm_rows_fwd_kernel,
                      {"x_ptr": bf, "w_ptr": bf, "cos_ptr": bf, "sin_ptr": bf, "y_ptr": bf,
                       "r_ptr": f32, **tail, "eps": "fp32", **consts},
                      lambda c, f=flags: {**f, "BLOCK_ROWS": c["BLOCK_ROWS"]}, "num_warps"))
        specs.append((f"norm_rows@{bucket}", f"norm_rows_bwd[bf16]+{tag}", nr.norm_rows_bwd_kernel,
                      {"x_ptr": bf, "w_ptr": bf, "cos_ptr": bf, "sin_ptr": bf, "r_ptr": f32,
                       "dy_ptr": bf, "dx_ptr": bf, "dw_ptr": f32, **tail, **consts,
                       "ROW_TILES": "constexpr"},
                      lambda c, f=flags: {**f, "BLOCK_ROWS": c["BLOCK_ROWS"],
                                          "ROW_TILES": c["ROW_TILES"]}, "num_warps_bwd"))
    flags = {"D": 128, "XR": 1, "ROUND_Y": True, "BLOCK_D": 128}
    consts = {k: "constexpr" for k in (*flags, "BLOCK_ROWS")}
    strides = {f"stride_{n}": "i32" for n in ("xn", "xh", "gn", "gh")}
    specs.append(("norm_rows@d<=256", "norm_rows_gated_fwd[bf16]", nr.gated_norm_fwd_kernel,
                  {"x_ptr": bf, "gate_ptr": bf, "w_ptr": bf, "y_ptr": bf, "r_ptr": f32, **ints,
                   **strides, "eps": "fp32", **consts},
                  lambda c: {**flags, "BLOCK_ROWS": c["BLOCK_ROWS"]}, "num_warps"))
    specs.append(("norm_rows@d<=256", "norm_rows_gated_bwd[bf16]", nr.gated_norm_bwd_kernel,
                  {"x_ptr": bf, "gate_ptr": bf, "w_ptr": bf, "r_ptr": f32, "dy_ptr": bf,
                   "dx_ptr": bf, "dgate_ptr": bf, "dw_ptr": f32, **ints, **strides, **consts,
                   "ROW_TILES": "constexpr"},
                  lambda c: {**flags, "BLOCK_ROWS": c["BLOCK_ROWS"], "ROW_TILES": c["ROW_TILES"]},
                  "num_warps_bwd"))
    return specs


def _causal_conv_specs():
    """The Gated DeltaNet conv as training runs it: bf16 x, w, halo and gradients, int32 reach
    bits of the history, fp32 dw partial sums, Qwen3.5's 4 taps; with neither halo nor history
    (unpacked rows) and with both (packed rows under context parallelism, the superset); y as
    the layer takes it (q, k, v as three outputs, "+split") and as one tensor."""
    from longmoe.ops.kernels import causal_conv as cc
    bf = "*bf16"
    strides = {f"stride_{n}": "i32" for n in ("xb", "xt", "wc", "wk", "hb", "ht", "rb")}
    consts = {k: "constexpr" for k in ("K", "HAS_HALO", "HAS_HISTORY", "SPLIT", "BLOCK_T",
                                       "BLOCK_C", "STAGES")}
    specs = []
    for extra, split in ((False, False), (True, False), (False, True), (True, True)):
        flags = {"K": 4, "HAS_HALO": extra, "HAS_HISTORY": extra, "SPLIT": split}
        tag = ("+halo+history" if extra else "") + ("+split" if split else "")
        specs.append(("causal_conv", f"causal_conv_fwd[bf16]{tag}", cc.causal_conv_fwd_kernel,
                      {"x_ptr": bf, "w_ptr": bf, "h_ptr": bf, "reach_ptr": "*i32", "y_ptr": bf,
                       "y1_ptr": bf, "y2_ptr": bf, "S": "i32", "C": "i32", "C1": "i32",
                       "C2": "i32", **strides, **consts},
                      lambda c, f=flags: {**f, "BLOCK_T": c["BLOCK_T"], "BLOCK_C": c["BLOCK_C"],
                                          "STAGES": c.get("num_stages", 1)},
                      "num_warps"))
        specs.append(("causal_conv", f"causal_conv_bwd[bf16]{tag}", cc.causal_conv_bwd_kernel,
                      {"x_ptr": bf, "w_ptr": bf, "h_ptr": bf, "reach_ptr": "*i32", "dy_ptr": bf,
                       "dy1_ptr": bf, "dy2_ptr": bf, "dx_ptr": bf, "dh_ptr": bf,
                       "dw_ptr": "*fp32", "S": "i32", "C": "i32", "C1": "i32", "C2": "i32",
                       "n_t": "i32", **strides, "stride_dyb": "i32", "stride_dyt": "i32",
                       **consts},
                      lambda c, f=flags: {**f, "BLOCK_T": c["BLOCK_T_BWD"],
                                          "BLOCK_C": c["BLOCK_C_BWD"],
                                          "STAGES": c.get("num_stages_bwd",
                                                          c.get("num_stages", 1))},
                      "num_warps_bwd"))
    return specs


def _kernel_specs():
    """(table key, kernel name, jit fn, signature, constexprs from a config, num_warps key)."""
    from longmoe.ops.kernels import ce_rows
    specs = []
    def stats_sig(zt):
        return {"z_ptr": f"*{zt}", "stride_z": "i32", "labels_ptr": "*i64", "lse_ptr": "*fp32",
                "tgt_ptr": "*fp32", "ent_ptr": "*fp32", "arg_ptr": "*i64", "V": "i32",
                "ignore_index": "i32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr",
                "WITH_ARGMAX": "constexpr"}

    def grad_sig(zt, dt, fix=True):
        return {"z_ptr": f"*{zt}", "stride_z": "i32", "dz_ptr": f"*{dt}", "stride_dz": "i32",
                "labels_ptr": "*i64", "lse_ptr": "*fp32", "ez_ptr": "*fp32",
                "w_lp_ptr": "*fp32", "w_ent_ptr": "*fp32", "w_lse_ptr": "*fp32",
                **({"fix_col_ptr": "*i64", "fix_val_ptr": "*fp32"} if fix else {}), "V": "i32",
                "ignore_index": "i32", "BLOCK_V": "constexpr", "WITH_ENTROPY": "constexpr",
                "WITH_LSE": "constexpr", **({"WITH_FIX": "constexpr"} if fix else {})}

    for key in ("linear_ce_rows", "linear_ce_rows_inplace"):  # both read fp32 logits
        for ent in (False, True):
            specs.append((key, f"ce_row_stats{'+entropy' if ent else ''}",
                          ce_rows.ce_row_stats_kernel, stats_sig("fp32"),
                          lambda c, e=ent: {"BLOCK_V": c["BLOCK_V"], "WITH_ENTROPY": e,
                                            "WITH_ARGMAX": False}, "num_warps"))
    for dt in ("bf16", "fp16", "fp32"):
        specs.append(("linear_ce_rows", f"ce_row_grad[{dt}]+entropy+lse", ce_rows.ce_row_grad_kernel,
                      grad_sig("fp32", dt),
                      lambda c: {"BLOCK_V": c["BLOCK_V_GRAD"], "WITH_ENTROPY": True,
                                 "WITH_LSE": True, "WITH_FIX": False}, "num_warps_grad"))
    for dt in ("bf16", "fp16"):  # the gradient over the fp32 logits' own bytes
        specs.append(("linear_ce_rows_inplace", f"ce_row_grad_narrow[{dt}]+entropy+lse",
                      ce_rows.ce_row_grad_narrow_kernel, grad_sig("fp32", dt, fix=False),
                      lambda c: {"BLOCK_V": c["BLOCK_V_GRAD"], "WITH_ENTROPY": True,
                                 "WITH_LSE": True}, "num_warps_grad"))
    for dt in ("bf16", "fp16"):  # low-precision logits, the gradient in place, exact fix-ups
        specs.append(("linear_ce_rows_lowp", f"ce_row_stats[{dt}]+entropy+argmax",
                      ce_rows.ce_row_stats_kernel, stats_sig(dt),
                      lambda c: {"BLOCK_V": c["BLOCK_V"], "WITH_ENTROPY": True,
                                 "WITH_ARGMAX": True}, "num_warps"))
        specs.append(("linear_ce_rows_lowp", f"ce_row_grad[{dt}]+entropy+lse+fix",
                      ce_rows.ce_row_grad_kernel, grad_sig(dt, dt),
                      lambda c: {"BLOCK_V": c["BLOCK_V_GRAD"], "WITH_ENTROPY": True,
                                 "WITH_LSE": True, "WITH_FIX": True}, "num_warps_grad"))
    from longmoe.ops.kernels import grouped_gemm as gg
    for dt in ("bf16", "fp16"):
        specs.append(("grouped_gemm", f"grouped_mm[{dt}]", gg.grouped_mm_kernel,
                      {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
                       "tile_group_ptr": "*i32", "tile_row_ptr": "*i32", "group_end_ptr": "*i32",
                       "K": "i32", "N": "i32", "stride_xm": "i32", "stride_wg": "i32",
                       "stride_wk": "i32", "stride_wn": "i32", "stride_om": "i32",
                       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                      lambda c: {k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}, "num_warps"))
        specs.append(("grouped_gemm", f"grouped_mm_dw[{dt}]", gg.grouped_mm_dw_kernel,
                      {"x_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "dw_ptr": f"*{dt}",
                       "group_start_ptr": "*i32", "group_end_ptr": "*i32", "K": "i32", "N": "i32",
                       "stride_xm": "i32", "stride_dym": "i32", "stride_dwg": "i32",
                       "stride_dwk": "i32",
                       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                      lambda c: {k: gg.dw_tiles(c)[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")},
                      "num_warps_dw"))
    from longmoe.ops.kernels import moe_rows as mr
    for dt in ("bf16", "fp16", "fp32"):
        for acc in (False, True):
            specs.append(("moe_rows", f"gather_sum[{dt}]{'+acc' if acc else ''}",
                          mr.gather_sum_kernel,
                          {"src_ptr": f"*{dt}", "idx_ptr": "*i64", "w_ptr": "*fp32",
                           "out_ptr": f"*{dt}", "H": "i32", "stride_src": "i32",
                           "stride_out": "i32", "K": "constexpr", "BLOCK_H": "constexpr",
                           "WEIGHTED": "constexpr", "ACCUMULATE": "constexpr"},
                          lambda c, a=acc: {"K": 8, "BLOCK_H": c["BLOCK_H"], "WEIGHTED": True,
                                            "ACCUMULATE": a}, "num_warps"))
        specs.append(("moe_rows", f"gather_sum_parts[{dt}]+acc", mr.gather_sum_parts_kernel,
                      {**{f"p{i}": f"*{dt}" for i in range(4)}, "s1": "i32", "s2": "i32",
                       "s3": "i32", "idx_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": f"*{dt}",
                       "H": "i32", "stride_src": "i32", "stride_out": "i32", "K": "constexpr",
                       "BLOCK_H": "constexpr", "WEIGHTED": "constexpr",
                       "ACCUMULATE": "constexpr"},
                      lambda c: {"K": 8, "BLOCK_H": c["BLOCK_H"], "WEIGHTED": True,
                                 "ACCUMULATE": True}, "num_warps"))
        specs.append(("moe_rows", f"gather_scale[{dt}]+dot", mr.gather_scale_kernel,
                      {"src_ptr": f"*{dt}", "idx_ptr": "*i64", "w_ptr": "*fp32",
                       "out_ptr": f"*{dt}", "y_ptr": f"*{dt}", "dot_ptr": "*fp32", "H": "i32",
                       "stride_src": "i32", "stride_out": "i32", "stride_y": "i32",
                       "BLOCK_H": "constexpr", "WITH_DOT": "constexpr"},
                      lambda c: {"BLOCK_H": c["BLOCK_H_ROW"], "WITH_DOT": True}, "num_warps_row"))
        specs.append(("moe_rows", f"swiglu[{dt}]", mr.swiglu_kernel,
                      {"h_ptr": f"*{dt}", "a_ptr": f"*{dt}", "M": "i32", "F": "i32",
                       "stride_h": "i32", "stride_a": "i32", "BLOCK_M": "constexpr",
                       "BLOCK_F": "constexpr"},
                      lambda c: {"BLOCK_M": c["BLOCK_M"], "BLOCK_F": c["BLOCK_F"]},
                      "num_warps_swiglu"))
        specs.append(("moe_rows", f"swiglu_bwd[{dt}]+dot", mr.swiglu_bwd_kernel,
                      {"h_ptr": f"*{dt}", "ga_ptr": f"*{dt}", "gh_ptr": f"*{dt}",
                       "a_ptr": f"*{dt}", "dot_ptr": "*fp32", "M": "i32", "F": "i32",
                       "stride_h": "i32", "stride_ga": "i32", "stride_gh": "i32",
                       "stride_a": "i32", "BLOCK_M": "constexpr", "BLOCK_F": "constexpr",
                       "WITH_DOT": "constexpr"},
                      lambda c: {"BLOCK_M": c["BLOCK_M"], "BLOCK_F": c["BLOCK_F"],
                                 "WITH_DOT": True}, "num_warps_swiglu"))
    specs += _l2norm_specs() + _norm_specs() + _causal_conv_specs()
    from longmoe.ops.kernels import affine_scan as sc
    for adjoint in (False, True):
        # D = 128: the state rows of Qwen3.5's Gated DeltaNet heads (dk), what runs
        specs.append(("affine_scan", f"affine_scan[{'adjoint' if adjoint else 'forward'}]",
                      sc.affine_scan_kernel,
                      {"m_ptr": "*fp32", "add_ptr": "*fp32", "out_ptr": "*fp32", "n_steps": "i32",
                       "B": "i32", "V": "i32", "D": "constexpr",
                       "BLOCK_K": "constexpr", "BLOCK_V": "constexpr", "ADJOINT": "constexpr",
                       "PRECISION": "constexpr"},
                      lambda c, a=adjoint: {"D": 128, "BLOCK_K": min(c["BLOCK_K"], 128),
                                            "BLOCK_V": c["BLOCK_V"], "ADJOINT": a,
                                            "PRECISION": c.get("fp32_fast", "ieee")},
                      "num_warps"))
    return specs + _gated_delta_specs()


def _gated_delta_specs():
    """The chunked Gated DeltaNet kernels as Qwen3.5's heads run them in training: bf16 q/k/v
    and o (and its gradient), 128 x 128 heads, fp32 gates and states, uint8 sample starts (the variant with starts is the
    superset of the one without). Each entry names the pointers' dtypes in argument order, then
    the integer arguments; G = 2 value heads per key head, as Qwen3.5's 16 key and 32 value
    heads."""
    from longmoe.ops.kernels import gated_delta_bwd as gb
    from longmoe.ops.kernels import gated_delta_fwd as gf
    bf, f32, u8 = "*bf16", "*fp32", "*u8"
    kernels = [  # (name, fn, pointers, ints, extra constexprs, warps key, column block key)
        ("gdn_prep", gf.gdn_prep_kernel,
         dict(k_ptr=bf, v_ptr=bf, g_ptr=f32, beta_ptr=bf, starts_ptr=u8, gam_ptr=f32,
              tinv_ptr=f32, w_ptr=bf, u_ptr=bf), ("T", "Hk", "Hv"), {}, "num_warps_prep", "BV_OUT"),
        ("gdn_states", gf.gdn_states_kernel,
         dict(k_ptr=bf, w_ptr=bf, u_ptr=bf, gam_ptr=f32, starts_ptr=u8, h0_ptr=f32, h_ptr=bf,
              vn_ptr=bf, ht_ptr=f32), ("T", "n", "Hk", "Hv"),
         {"HAS_H0": True, "COUNTED": True},
         "num_warps_scan", "BV"),
        ("gdn_output", gf.gdn_output_kernel,
         dict(q_ptr=bf, k_ptr=bf, gam_ptr=f32, starts_ptr=u8, h_ptr=bf, x_ptr=bf, out_ptr=bf),
         ("T", "n", "Hk"), {"G": 2, "ADJOINT": False}, "num_warps", "BV_OUT"),
        ("gdn_output[adjoint]", gf.gdn_output_kernel,
         dict(q_ptr=bf, k_ptr=bf, gam_ptr=f32, starts_ptr=u8, h_ptr=bf, x_ptr=bf, out_ptr=bf),
         ("T", "n", "Hk"), {"G": 2, "ADJOINT": True}, "num_warps", "BV_OUT"),
        ("gdn_states_bwd", gb.gdn_states_bwd_kernel,
         dict(q_ptr=bf, k_ptr=bf, w_ptr=bf, gam_ptr=f32, starts_ptr=u8, do_ptr=bf, dvi_ptr=bf,
              dht_ptr=f32, dh_ptr=bf, dvn_ptr=bf, dh0_ptr=f32), ("T", "n", "Hk", "Hv"),
         {"HAS_DHT": True, "COUNTED": True}, "num_warps_scan_bwd", "BV"),
        ("gdn_bwd_wy", gb.gdn_bwd_wy_kernel,
         dict(k_ptr=bf, v_ptr=bf, beta_ptr=bf, gam_ptr=f32, starts_ptr=u8, tinv_ptr=f32,
              h_ptr=bf, dvn_ptr=bf, dv_ptr=bf, dk_ptr=f32, dbeta_ptr=f32, dgam_ptr=f32),
         ("T", "n", "Hk", "Hv"), {}, "num_warps_bwd", "BV_BWD"),
        ("gdn_bwd_qk", gb.gdn_bwd_qk_kernel,
         dict(q_ptr=bf, k_ptr=bf, gam_ptr=f32, starts_ptr=u8, h_ptr=bf, dh_ptr=bf, do_ptr=bf,
              vn_ptr=bf, dkw_ptr=f32, dgw_ptr=f32, dq_ptr=bf, dk_ptr=bf, dg_ptr=f32),
         ("T", "n", "Hk"), {"G": 2}, "num_warps_qk", "BV_QK"),
    ]
    specs = []
    for name, fn, ptrs, ints, extra, warps, block in kernels:
        sig = {**ptrs, **{i: "i32" for i in ints}}
        # the prep and q/k-gradient kernels also take a block of key columns
        rows = ("BK",) if "BK" in fn.arg_names else ()
        consts = ("DK", "DV", "C", "BV", *rows, "HAS_STARTS", *extra, "PRECISION")
        sig.update({c: "constexpr" for c in consts})
        specs.append(("gated_delta_chunk", name, fn, sig,
                      lambda c, b=block, e=extra, r=rows,
                      bk="BK_PREP" if name == "gdn_prep" else "BK_BWD": {
                          "DK": 128, "DV": 128, "C": c["CHUNK"], "BV": c[b],
                          **{k: min(c[bk], 128) for k in r}, "HAS_STARTS": True, **e,
                          "PRECISION": c.get("fp32_fast", "ieee")},
                      warps))
    return specs


def _configs_for(table: dict, key: str, target: str) -> list[tuple[str, dict]]:
    """The entries of table key `key` for the target and "any" archs; "KEY@BUCKET" keeps the
    entries of that bucket only."""
    key, _, only = key.partition("@")
    by_arch = table.get(key, {})
    out = []
    for arch in (target, "any"):
        for bucket, cfg in by_arch.get(arch, {}).items():
            if not only or bucket == only:
                out.append((f"{arch}/{bucket}", cfg))
    return out


def compile_all(target: str, table: dict | None = None, only: str | None = None,
                progress: Callable[[int, int, CompileReport], None] | None = None
                ) -> list[CompileReport]:
    """Compile every config of the target vendor's shipped table (or of `table`); `only` keeps
    the kernel variants whose name starts with it. `progress(done, total, report)` is called
    after each compile."""
    from triton.backends.compiler import GPUTarget
    from longmoe.backends.kernels import load_kernel_table
    t = compile_targets()[target]
    if table is None:
        table = load_kernel_table(t.kernel_table)
    gpu = GPUTarget(t.triton_backend, t.arch, t.warp_size)
    jobs = []
    for key, name, fn, sig, constexprs, warps_key in _kernel_specs():
        if only and not name.startswith(only):
            continue
        for where, cfg in _configs_for(table, key, target):
            generic = _pointer_attrs(sig) if key in _ALIGNED_POINTERS else None
            for aligned in (False, True):
                jobs.append((key, name + ("@aligned" if aligned else ""), fn, sig,
                             constexprs(cfg), t.launch_options(cfg, warps_key),
                             _aligned_attrs(sig) if aligned else generic,
                             {"where": where, **cfg}))
    reports = []
    for key, variant, fn, sig, consts, opts, attrs, cfg in jobs:
        rep = CompileReport(key.partition("@")[0], variant, target, cfg, ok=False)
        reports.append(compile_and_check(rep, t, gpu, fn, sig, consts, opts, attrs))
        if progress:
            progress(len(reports), len(jobs), rep)
    return reports


# Integer arguments that the layer's real shapes make multiples of 16 (strides and the model's
# widths; C: the conv's channels, 8192 in Qwen3.5), besides every pointer (fresh torch
# allocations are 16-byte aligned).
_ALIGNED_INTS = ("K", "N", "H", "F", "D", "V", "C", "C1", "C2")


# Kernels whose launcher hands them 16-byte aligned pointers only (it copies a misaligned view:
# ops/kernels/gated_delta_chunk.py), so their generic variant has aligned pointers and
# arbitrary integers (lengths, head counts).
_ALIGNED_POINTERS = ("gated_delta_chunk",)


def _pointer_attrs(sig: dict) -> dict:
    return {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*")}


def _aligned_attrs(sig: dict) -> dict:
    """Triton's run-time specialisation for arguments divisible by 16, which changes the code it
    makes (the grouped GEMM's loads become asynchronous copies only with it on some targets): the
    variant the Qwen-shaped layer runs, compiled beside the generic one."""
    return {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig)
            if sig[k] != "constexpr"
            and (sig[k].startswith("*") or k.startswith("stride") or k in _ALIGNED_INTS)}


def spill_allowance(cfg: dict, variant: str) -> int:
    """Spilled registers a table entry accepts for one kernel (its "max_spills" by kernel name,
    aligned or not): only where the entry's note says the spilling tiles were timed faster than
    the ones that fit; any other spill fails the check."""
    return int((cfg or {}).get("max_spills", {}).get(variant.split("@")[0], 0))


def compile_and_check(rep: CompileReport, t, gpu, fn, sig: dict, constexprs: dict,
                      opts: dict, attrs: dict | None = None) -> CompileReport:
    """Compile one kernel config for target t and fill rep: resources, ok (no spills, within
    the register and shared-memory/LDS budgets) or the error."""
    import triton
    from triton.compiler import ASTSource
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        rep.regs, rep.spills, rep.shared = t.usage(triton.compile(src, target=gpu, options=opts))
        allowed = spill_allowance(rep.config, rep.variant)
        rep.ok = (rep.spills <= allowed and rep.regs <= t.reg_budget
                  and rep.shared <= t.shared_budget)
        if not rep.ok:
            rep.error = (f"over budget (regs {rep.regs}/{t.reg_budget}, spills {rep.spills}"
                         f"{f' > {allowed} allowed' if allowed else ''}, "
                         f"shared {rep.shared}/{t.shared_budget})")
    except Exception as e:  # a config that does not compile is a finding, not a crash
        msg = str(e).strip().splitlines()
        rep.error = f"{type(e).__name__}: {msg[0][:200] if msg else ''}"
    return rep
