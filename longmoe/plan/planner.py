"""The recipe planner: one parallel layout, with a reason per choice, in the seeds' order.

  1. EP from the MoE and the topology: 8 by default, no more than the experts allow and the GPUs
     of one node hold (the all-to-all stays on NVLink/xGMI).
  2. TP = 1 unless forced: with FSDP2 sharding the state, TP only splits GEMMs thin.
  3. CP = 1 when the whole sequence fits on a GPU (the MI300X case); otherwise the CP that puts
     the local sequence in the 16K-32K window (32K first: longer local work hides more overhead).
  4. PP = 2 only when no CP above fits.
  5. Anything else that fits in the 4-D grid, smallest peak first, said as such.
A layout "fits" when its estimated peak is within the budget: usable HBM less the per-rank
context, less `headroom` (the estimator's own error target, 10%). No plan that the estimator
predicts to exceed it is ever returned; when none fits, the error names what would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from longmoe.config import ModelConfig
from longmoe.errors import UserError
from longmoe.plan.hardware import Hardware
from longmoe.plan.memory import (GiB, Assumptions, Layout, MemoryBreakdown, Workload, ep_chunks_for,
                                 estimate, local_tokens)

TP_GRID, PP_GRID, EP_GRID, CP_GRID = (1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8)
LOCAL_WINDOW = (16384, 32768)      # the seeds' target local sequence per GPU
EP_DEFAULT = 8
HEADROOM = 0.10


@dataclass(frozen=True)
class Cell:
    layout: Layout
    verdict: str                    # fits | OOM | invalid
    why: str
    memory: MemoryBreakdown | None = None


@dataclass(frozen=True)
class Plan:
    model: str
    hardware: Hardware
    gpus: int
    workload: Workload
    layout: Layout
    memory: MemoryBreakdown
    budget_bytes: int
    reasons: dict
    ep_chunks: int
    keep_fits: int = 0              # trailing layers that could skip recompute within the budget
    num_layers: int = 0
    cell: Cell | None = None        # the chosen layout judged with the plan's settings

    def explain(self, cells: list[Cell]) -> list[Cell]:
        """`cells` (a `grid` of this plan's request) with the chosen layout's cell replaced by
        the plan's own, which also counts `keep_last`: one number per cell everywhere."""
        return [self.cell if self.cell is not None and c.layout == self.layout else c
                for c in cells]

    @property
    def local_seq(self) -> int:
        return self.workload.seq_len // (self.layout.cp * self.layout.tp)

    def to_dict(self) -> dict:
        lay, w, m = self.layout, self.workload, self.memory
        return {"model": self.model, "hardware": self.hardware.key, "gpus": self.gpus,
                "seq_len": w.seq_len, "micro_batch": w.micro_batch,
                "max_tokens_per_micro_batch": w.tokens_per_micro_batch,
                "grad_sync": w.grad_sync,
                "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp, "dp": lay.dp,
                "recompute": w.recompute, "keep_last": w.keep_last,
                "keep_attention": w.keep_attention,
                "keep_last_fits": self.keep_fits, "sharding": w.sharding,
                "logits": "linear_ce" if w.linear_ce else "naive", "ep_chunks": self.ep_chunks,
                "local_seq": self.local_seq, "tokens_per_rank": m.local_tokens,
                "peak_bytes": m.peak, "peak_gib": round(m.peak / GiB, 2),
                "budget_bytes": self.budget_bytes,
                "usable_bytes": self.hardware.usable_bytes,
                "peak_stage": m.stage, "peak_phase": m.phase,
                "reasons": dict(self.reasons), "memory": m.to_dict()["terms_bytes"]}


def budget_bytes(hw: Hardware, a: Assumptions = Assumptions(), headroom: float = HEADROOM) -> int:
    return int((hw.usable_gib - a.context_gib) * (1 - headroom) * GiB)


def invalid_reason(cfg: ModelConfig, hw: Hardware, w: Workload, lay: Layout) -> str | None:
    """Why a layout cannot run at all (before any memory question), or None."""
    g = lay.gpus
    if g % (lay.tp * lay.pp * lay.cp):
        return f"TP·PP·CP = {lay.tp * lay.pp * lay.cp} does not divide {g} GPUs"
    if lay.tp > hw.gpus_per_node:
        return f"TP={lay.tp} would span nodes ({hw.gpus_per_node} GPUs per node)"
    if cfg.num_kv_heads % lay.tp or cfg.num_heads % lay.tp:
        return f"TP={lay.tp} does not divide the {cfg.num_kv_heads} KV heads"
    if cfg.num_experts % lay.ep:
        return f"EP={lay.ep} does not divide {cfg.num_experts} experts"
    if (g // lay.pp) % lay.ep:
        return f"EP={lay.ep} does not divide the {g // lay.pp} GPUs of a pipeline stage"
    if lay.pp > cfg.num_layers:
        return f"PP={lay.pp} exceeds {cfg.num_layers} layers"
    split = 2 * lay.cp * lay.tp if lay.cp > 1 else lay.tp
    if w.seq_len % split:
        return (f"sequence {w.seq_len} is not divisible by {split} "
                f"(2·CP·TP chunks for load-balanced causal CP)" if lay.cp > 1 else
                f"sequence {w.seq_len} is not divisible by TP={lay.tp} (sequence parallel)")
    return None


def cell_workload(cfg: ModelConfig, lay: Layout, w: Workload) -> Workload:
    """The workload a cell is judged with: the EP chunk count the plan runs there (--ep-chunks,
    else the tuning default for the cell's local tokens), at most one chunk per local expert
    (the trainer chunks by expert range)."""
    chunks = min(ep_chunks_for(w, local_tokens(lay, w)), max(1, cfg.num_experts // lay.ep))
    return replace(w, ep_chunks=chunks)


def judge(cfg: ModelConfig, hw: Hardware, w: Workload, lay: Layout, budget: int,
          a: Assumptions = Assumptions(), keep_attention: str = "off") -> Cell:
    """One cell, one estimate: the one the plan would run on this layout. `keep_attention`
    "on" counts the attention kernels' tensors, "off" does not, "auto" counts them where the
    estimate with them fits (so an OOM cell's number is the least it needs)."""
    why = invalid_reason(cfg, hw, w, lay)
    if why:
        return Cell(lay, "invalid", why)
    w = replace(cell_workload(cfg, lay, w), keep_attention=False)
    m = estimate(cfg, lay, w, a)
    if keep_attention != "off" and w.recompute == "full" and _attention_layers(cfg):
        kept = estimate(cfg, lay, replace(w, keep_attention=True), a)
        if keep_attention == "on" or kept.peak <= budget:
            m = kept
    return cell_of(lay, m, budget)


def cell_of(lay: Layout, m: MemoryBreakdown, budget: int) -> Cell:
    if m.peak > budget:
        return Cell(lay, "OOM", f"needs {m.peak / GiB:.1f} GiB > budget {budget / GiB:.1f} GiB "
                                f"(peak at {m.phase})", m)
    return Cell(lay, "fits", f"{m.peak / GiB:.1f} GiB of {budget / GiB:.1f} GiB", m)


def _attention_layers(cfg: ModelConfig) -> int:
    return sum(cfg.layer_type(i) == "full_attention" for i in range(cfg.num_layers))


def grid(cfg: ModelConfig, hw: Hardware, gpus: int, w: Workload, a: Assumptions = Assumptions(),
         headroom: float = HEADROOM, keep_attention: bool | str = "off") -> list[Cell]:
    """Every (TP, PP, EP, CP) of the seeds' 4-D grid whose product fits the GPU count, each
    judged as the planner judges it (`judge`)."""
    b = budget_bytes(hw, a, headroom)
    mode = _mode(keep_attention)
    return [judge(cfg, hw, w, Layout(gpus, tp, pp, ep, cp), b, a, mode)
            for pp in PP_GRID for ep in EP_GRID for tp in TP_GRID for cp in CP_GRID
            if tp * pp * cp <= gpus and ep * pp <= gpus]


def _mode(keep_attention: bool | str) -> str:
    mode = {True: "on", False: "off"}.get(keep_attention, keep_attention)
    if mode not in ("on", "off", "auto"):
        raise UserError(f"--keep-attention: expected on, off or auto, got {keep_attention!r}")
    return mode


def check_gpus(hw: Hardware, gpus: int):
    if gpus < 1:
        raise UserError(f"--gpus: must be >= 1, got {gpus}")
    n = hw.gpus_per_node
    if gpus > n and gpus % n:
        lo, hi = gpus // n * n, -(-gpus // n) * n
        raise UserError(f"--gpus: {gpus} GPUs span nodes but are not a multiple of the "
                        f"{n} GPUs per {hw.key} node; use {lo} or {hi}")


def keep_last_fits(cfg: ModelConfig, lay: Layout, w: Workload, budget: int,
                   a: Assumptions = Assumptions()) -> int:
    """The most trailing layers that can store their activations instead of recomputing them
    with the estimate still within `budget` (0 without recompute or with pipeline stages)."""
    if w.recompute == "none" or lay.pp > 1:
        return 0
    k = 0
    while k < cfg.num_layers and estimate(cfg, lay, replace(w, keep_last=k + 1), a).peak <= budget:
        k += 1
    return k


def plan(cfg: ModelConfig, hw: Hardware, gpus: int, w: Workload, *, model_name: str = "",
         tp: int | None = None, a: Assumptions = Assumptions(), headroom: float = HEADROOM,
         keep_last: int | str = 0, keep_attention: bool | str = False,
         _suggest: bool = True) -> Plan:
    """`keep_last`: trailing layers stored without recompute (an int), or "auto" for as many as
    the budget allows (chosen after the layout; the layout itself is planned without them).
    `keep_attention`: under full recompute, whether full-attention layers keep their kernel's
    tensors (True/"on", False/"off", or "auto": on where the estimate still fits). Every cell
    is judged with it (`judge`), so a layout is chosen for what it will run; "auto" falls back
    to recomputing attention where the kernels' tensors do not fit, so it picks the layouts
    "off" picks, and spends what is left before `keep_last` does (an attention layer's kernel
    tensors cost ~1/5 of what a layer kept without recompute does)."""
    check_gpus(hw, gpus)
    mode = _mode(keep_attention)
    budget = budget_bytes(hw, a, headroom)
    if budget <= 0:
        raise UserError(f"--hardware: {hw.key} leaves no memory after the "
                        f"{a.context_gib} GiB context")
    reasons: dict[str, str] = {}

    eps = [e for e in EP_GRID[::-1] if e <= min(EP_DEFAULT, hw.gpus_per_node, gpus)
           and cfg.num_experts % e == 0 and gpus % e == 0]
    ep = eps[0] if eps else 1
    why_ep = ("8 is the seeds' default" if ep == EP_DEFAULT else
              f"the largest of 1/2/4/8 dividing {cfg.num_experts} experts and {gpus} GPU(s)")
    reasons["ep"] = (f"EP={ep}: {cfg.num_experts // ep} of {cfg.num_experts} experts per GPU; the "
                     f"all-to-all stays inside one {hw.gpus_per_node}-GPU node "
                     f"({hw.intra_node_fabric}); {why_ep}")
    if tp is None:
        tp = 1
        reasons["tp"] = ("TP=1: FSDP2 already shards the state; TP would split GEMMs thin and "
                         "add collectives")
    else:
        reasons["tp"] = f"TP={tp}: forced by --tp"
    reasons["recompute"] = {
        "full": ("full recompute: each layer keeps only its input, +~1/3 FLOPs buys a long "
                 "local sequence"),
        "selective": "selective recompute: attention kept, the MoE recomputed",
        "none": "no recompute: every activation stored"}[w.recompute]
    reasons["cp"] = ""      # said once the plan's own estimate is known (below)

    def try_(pp: int, cp: int) -> Cell:
        return judge(cfg, hw, w, Layout(gpus, tp, pp, ep, cp), budget, a, mode)

    window = [cp for cp in CP_GRID if cp > 1
              and LOCAL_WINDOW[0] <= w.seq_len // (cp * tp) <= LOCAL_WINDOW[1]]
    tried: list[Cell] = []

    def first_fit(pp: int, cps: list[int]) -> Cell | None:
        for cp in cps:
            tried.append(try_(pp, cp))
            if tried[-1].verdict == "fits":
                return tried[-1]
        return None

    # why_cp(the chosen cell's why): the chosen layout's reason, told with the plan's estimate
    chosen = first_fit(1, [1])
    if chosen is not None:
        def why_cp(why):
            return (f"CP=1: the whole {w.seq_len:,}-token sequence fits on one GPU ({why}); "
                    "no CP, one fewer collective")
    else:
        chosen = first_fit(1, window)
        if chosen is not None:
            def why_cp(why, cp=chosen.layout.cp, one=tried[0].why):
                return (f"CP={cp}: CP=1 {one}; CP={cp} puts {w.seq_len // (cp * tp):,} tokens "
                        f"on each GPU, inside the 16K-32K window ({why})")
    if chosen is None:
        pp1 = [c for c in tried if c.memory is not None]
        chosen = first_fit(2, [1] + window)
        if chosen is not None:
            def why_cp(why, cp=chosen.layout.cp):
                return f"CP={cp}: with PP=2, {why}"
            closest = min(pp1, key=lambda c: c.memory.peak) if pp1 else None
            reasons["pp"] = ("PP=2: no CP of the 16K-32K window fits at PP=1"
                             + (f" (best {closest.layout.label} {closest.why})" if closest else ""))
    if chosen is None:
        fits = [c for c in grid(cfg, hw, gpus, w, a, headroom, mode)
                if c.verdict == "fits" and c.layout.tp == tp]
        if fits:
            chosen = min(fits, key=lambda c: (round(c.memory.peak / GiB, 1), c.layout.ep != ep,
                                              c.layout.pp, c.layout.cp))
            lay = chosen.layout

            def why_cp(why, cp=lay.cp):
                return (f"CP={cp}: nothing in the seeds' order fits; this is the "
                        f"smallest-peak layout of the grid ({why})")
            if lay.pp > 1:
                reasons["pp"] = f"PP={lay.pp}: part of that fallback layout"
            if lay.ep != ep:
                reasons["ep"] = f"EP={lay.ep}: part of that fallback layout"
    if chosen is None:
        raise UserError(_no_fit_message(cfg, hw, gpus, w, tried, model_name, tp, a, headroom,
                                        mode, _suggest))
    lay = chosen.layout
    reasons.setdefault("pp", "PP=1: the estimate fits without pipeline stages (no bubble)")
    share = lay.cp * lay.tp
    reasons["budget"] = (f"{w.tokens_per_micro_batch:,} tokens per micro-batch "
                         f"(data.max_tokens_per_micro_batch): {w.tokens_per_micro_batch // share:,}"
                         f" on each of the {share} GPU(s) sharing a row; the estimate depends on "
                         f"the tokens, not on how samples fill them")
    tokens = local_tokens(lay, w)
    chunks, asked = cell_workload(cfg, lay, w).ep_chunks, ep_chunks_for(w, tokens)
    reasons["ep_chunks"] = (f"{chunks} EP chunk(s): " + (
        "set by --ep-chunks" if w.ep_chunks else
        f"longmoe.tuning default for {tokens:,} local tokens (one chunk's all-to-all "
        "hides under another's expert GEMMs)"))
    if chunks < asked:  # the trainer chunks by expert range: at most one chunk per local expert
        reasons["ep_chunks"] += f"; capped at the {chunks} local expert(s) per rank"
    w = replace(w, ep_chunks=chunks)
    w = _keep_attention(cfg, lay, w, budget, a, mode, reasons)
    fits = keep_last_fits(cfg, lay, w, budget, a)
    keep = fits if keep_last == "auto" else int(keep_last)
    if keep:
        if keep > fits:
            need = estimate(cfg, lay, replace(w, keep_last=keep), a).peak
            raise UserError(f"--keep-last: {keep} layers without recompute need "
                            f"{need / GiB:.1f} GiB on {lay.label}, over the "
                            f"{budget / GiB:.1f} GiB budget; at most {fits} fit")
        w = replace(w, keep_last=keep)
        reasons["recompute"] = (f"{w.recompute} recompute on layers 0-{cfg.num_layers - keep - 1}; "
                                f"the last {keep} keep their activations (their backward runs "
                                f"first, freeing them before any recompute), saving their "
                                f"recomputed forward: {keep} of {cfg.num_layers} layers")
    reasons["grad_sync"] = _grad_sync_reason(cfg, lay, w, budget, a)
    cell = cell_of(lay, estimate(cfg, lay, w, a), budget)
    reasons["cp"] = why_cp(cell.why)
    return Plan(model_name, hw, gpus, w, lay, cell.memory, budget, reasons, chunks, fits,
                cfg.num_layers, cell)


def _keep_attention(cfg: ModelConfig, lay: Layout, w: Workload, budget: int, a: Assumptions,
                    want: bool | str, reasons: dict) -> Workload:
    want = _mode(want)
    n_attn = _attention_layers(cfg)
    if want == "off" or w.recompute != "full" or not n_attn:
        if want == "on":
            raise UserError(f"--keep-attention: needs full recompute and full-attention layers "
                            f"(recompute {w.recompute}, {n_attn} attention layers)")
        return replace(w, keep_attention=False)
    base = estimate(cfg, lay, replace(w, keep_attention=False), a).peak
    need = estimate(cfg, lay, replace(w, keep_attention=True), a).peak
    more = (f"+{(need - base) / GiB:.1f} GiB at the estimated peak, {need / GiB:.1f} of "
            f"{budget / GiB:.1f}")
    if need > budget:
        if want == "on":
            raise UserError(f"--keep-attention: the {n_attn} attention layers' kernel tensors "
                            f"need {need / GiB:.1f} GiB on {lay.label}, over the "
                            f"{budget / GiB:.1f} GiB budget")
        reasons["keep_attn"] = (f"attention recomputed: keeping its kernel's tensors would "
                                f"need {more} GiB")
        return replace(w, keep_attention=False)
    how = "set by --keep-attention" if want == "on" else "it fits"
    reasons["keep_attn"] = (f"the {n_attn} attention layers keep their kernel's tensors "
                            f"(parallel.keep_attention; {how}: {more} GiB): the attention "
                            f"forward is not run again in backward")
    return replace(w, keep_attention=True)


def _grad_sync_reason(cfg: ModelConfig, lay: Layout, w: Workload, budget: int,
                      a: Assumptions) -> str:
    if lay.dp_cp * lay.pp == 1 or w.sharding != "fsdp2":
        return f"grad_sync={w.grad_sync}: one rank, no reduction to defer"
    other = "step" if w.grad_sync == "micro_batch" else "micro_batch"
    alt = estimate(cfg, lay, replace(w, grad_sync=other), a).peak
    if w.grad_sync == "micro_batch":
        return (f"grad_sync=micro_batch: gradients reduce-scatter after every micro-batch and "
                f"stay sharded; once per step (grad_sync=step) keeps them unsharded: "
                f"{alt / GiB:.1f} GiB, " + ("within" if alt <= budget else "over")
                + f" the {budget / GiB:.1f} GiB budget")
    return (f"grad_sync=step: one reduction per step, unsharded fp32 gradients held across "
            f"micro-batches (per micro-batch: {alt / GiB:.1f} GiB)")


def _no_fit_message(cfg, hw, gpus, w, tried, model_name, tp, a, headroom, mode, suggest) -> str:
    judged = [c for c in tried if c.memory is not None]
    best = min(judged, key=lambda c: c.memory.peak) if judged else None
    what = f"{model_name or 'the model'} at {w.seq_len:,} tokens" + (
        " with the attention kernels' tensors kept (--keep-attention on)" if mode == "on" else "")
    msg = f"{what} does not fit on {gpus} x {hw.key} at any layout"
    if best is not None:
        msg += (f" (closest: {best.layout.label} needs {best.memory.peak / GiB:.1f} GiB of a "
                f"{budget_bytes(hw, a, headroom) / GiB:.1f} GiB budget)")
    elif tried:
        msg += f" ({tried[0].why})"
    split = [c for c in tried if c.verdict == "invalid" and "sequence" in c.why]
    if split:
        near = max(64, w.seq_len // 64 * 64)
        msg += f"; {split[0].why}: use a --seq-len divisible by 2·CP·TP (e.g. {near})"
    if suggest:
        n = hw.gpus_per_node
        for more in sorted({n * k for k in (1, 2, 4, 8, 16, 32, 64)} | {2 * gpus, 4 * gpus}):
            if more <= gpus:
                continue
            try:
                p = plan(cfg, hw, more, w, model_name=model_name, tp=tp, a=a,
                         headroom=headroom, keep_attention=mode, _suggest=False)
            except UserError:
                continue
            return msg + (f"; {more} GPUs fit ({p.layout.label}, "
                          f"{p.memory.peak / GiB:.1f} GiB per GPU)")
        msg += "; no GPU count up to 64 nodes fits: shorten --seq-len or use a larger-memory part"
    return msg
