"""Distributed paired cases on real process groups (gloo on CPU):

  ep    one MoE layer with experts split over N ranks (chunked dispatch) against the same layer
        with all experts in one process, on the concatenated tokens: outputs, input gradients,
        router, expert and shared-expert gradients, the balance loss.
  step  one training step of the model with a candidate layout (EP, FSDP2, recompute, linear CE,
        chunks) on N ranks against world size 1 with every primitive off, on the same global
        batch: loss and every parameter gradient.

Legend: T tokens per rank, H hidden, W world size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longmoe.config import ModelConfig, from_dict as model_from_dict, get_preset
from longmoe.model.moe import GroupedExperts, MoE
from longmoe.model.transformer import init_params
from longmoe.paired.harness import TOLERANCE, PairedResult
from longmoe.paired.spawn import run_ranks
from longmoe.parallel.expert_parallel import ExpertDispatcher

# ---- ep: one MoE layer ---------------------------------------------------------------------


def _layer_inputs(cfg: ModelConfig, seed: int, rank: int, T: int, skew: bool):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(1, T, cfg.hidden_size, generator=g)
    c = torch.randn(1, T, cfg.hidden_size, generator=g)
    if skew:  # every token shares a direction the first top_k experts' router rows point along
        u = torch.Generator().manual_seed(seed)
        x = x + 4.0 * torch.randn(cfg.hidden_size, generator=u)
    return x, c


def _skew_router(moe: MoE, cfg: ModelConfig, seed: int):
    u = torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        moe.router.weight[: cfg.top_k] += 2.0 * u / u.norm()


def _run_layer(moe: MoE, x, c):
    x = x.clone().requires_grad_()
    y, aux = moe(x)
    ((y * c).sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    return {"y": y.detach(), "dx": x.grad, "aux": aux.detach(), "grads": grads}


def _ep_rank(rank, world, backend, cfg_dict, seed, T, chunks, skew, transport, chunk_by,
             rows_impl="auto", wgrad="auto"):
    cfg = model_from_dict(cfg_dict)
    moe = MoE(cfg, ep_rank=rank, ep_size=world)
    init_params(moe, cfg, seed)
    if skew:
        _skew_router(moe, cfg, seed)
    dev = backend.device(rank)
    moe.to(dev)
    moe.dispatcher = ExpertDispatcher(cfg.num_experts, dist.group.WORLD, chunks,
                                      transport=backend.a2a(transport, dev),
                                      streams=backend.streams(), pipeline=True,
                                      chunk_by=chunk_by)
    moe.dispatcher.rows_impl = moe.experts.rows_impl = rows_impl
    moe.dispatcher.wgrad = wgrad
    moe.batch_group = dist.group.WORLD
    x, c = _layer_inputs(cfg, seed, rank, T, skew)
    out = _run_layer(moe, x.to(dev), c.to(dev))
    return {k: ({n: g.cpu() for n, g in v.items()} if isinstance(v, dict) else v.cpu())
            for k, v in out.items()}


def ep_case(nproc=2, seed=0, T=37, chunks=3, top_k=2, skew=False, num_experts=8,
            device="cpu", transport="auto", chunk_by="experts", rows_impl="auto",
            wgrad="auto") -> PairedResult:
    """`device` names the backend the ranks run on ("cpu", "cuda", "rocm"); the reference is
    always one CPU process in fp32 with the reference row ops and grouped GEMM. The ranks
    always run the chunk pipeline (with nproc=1 too, where its all-to-alls are local)."""
    cfg = get_preset("tiny").replace(top_k=top_k, num_experts=num_experts, router_aux_loss_coef=1e-2)
    ranks = run_ranks(_ep_rank, nproc, dataclasses.asdict(cfg), seed, T, chunks, skew, transport,
                      chunk_by, rows_impl, wgrad, device=device)
    ref_moe = MoE(cfg)
    init_params(ref_moe, cfg, seed)
    ref_moe.dispatcher.rows_impl = ref_moe.experts.rows_impl = "reference"
    ref_moe.experts.impl = "reference"
    if skew:
        _skew_router(ref_moe, cfg, seed)
    inputs = [_layer_inputs(cfg, seed, r, T, skew) for r in range(nproc)]
    ref = _run_layer(ref_moe, torch.cat([x for x, _ in inputs], 1), torch.cat([c for _, c in inputs], 1))
    res = PairedResult("ep", f"ep{nproc}-chunks{chunks}-{device}-{transport}-rows:{rows_impl}"
                       f"-wgrad:{wgrad}",
                       "one-process",
                       TOLERANCE[torch.float32],
                       info={"T_per_rank": T, "top_k": top_k, "skew": skew, "experts": num_experts})
    res.add("output", torch.cat([r["y"] for r in ranks], 1), ref["y"])
    res.add("dX", torch.cat([r["dx"] for r in ranks], 1), ref["dx"])
    res.add("aux_loss", sum(r["aux"] for r in ranks), ref["aux"])
    for name, g_ref in ref["grads"].items():
        if ".experts." in name or name.startswith("experts."):
            cand = torch.cat([r["grads"][name] for r in ranks])
        else:
            cand = sum(r["grads"][name] for r in ranks)
        res.add(f"grad:{name}", cand, g_ref)
    res.info["tokens_per_expert"] = ref_moe.router.last_load.tolist()
    return res


# ---- step: the whole model, one training step ---------------------------------------------


def _grads_by_name(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name.replace("block.", "")] = g.detach().cpu().clone()
    return out


def _step(run, layout, device, seed):
    from longmoe.data.rows import full_rows
    from longmoe.data.rule import RuleSource
    from longmoe.train.setup import build_model
    from longmoe.train.step import forward_backward, global_token_count, local_micro_batch
    model = build_model(run, layout, device)
    d = run.data
    source = RuleSource(run.model.vocab_size, seed, d.prompt_len, None, d.group_size,
                        full_rows=(d.seq_len, d.batch_size))
    # data.batch_size is global: world 1 (the reference) sees the whole batch at once
    n = d.per_rank(layout.data_world)
    batch = full_rows(source, range(layout.data_rank * n, (layout.data_rank + 1) * n), d.seq_len)
    batch, positions, _ = local_micro_batch(batch, layout, device)
    loss, aux, _ = forward_backward(model, batch, run, layout, global_token_count(batch, layout),
                                    positions)
    # The GRPO surrogate sums advantage-weighted ratios whose advantages cancel within each
    # group, so the loss itself sits near 0; its terms' size is the mean |advantage|.
    adv = batch.advantages[batch.labels != -100] if (batch.labels != -100).any() else batch.advantages
    return {"loss": float(loss), "aux": float(aux), "grads": _grads_by_name(model),
            "loss_scale": float(adv.abs().mean()) if adv.numel() else 1.0,
            "expert_names": [n.replace("block.", "") + "." + pn
                             for n, m in model.named_modules() if isinstance(m, GroupedExperts)
                             for pn, _ in m.named_parameters()]}


def _step_rank(rank, world, backend, run_dict, seed):
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    out = _step(run, layout, backend.device(rank), seed)
    out["ep_rank"], out["ep"] = layout.ep_rank, layout.ep
    return out


def candidate_run(ep=2, chunks=2, recompute="full", fsdp=True, linear_ce="chunked",
                  num_layers=2, seq_len=48, batch_size=4, cp=1, cpu_offload=False,
                  preset="tiny", gated_delta="auto", loss: dict | None = None) -> dict:
    """batch_size: the global batch (data.batch_size)."""
    return {"model": {"preset": preset, "num_layers": num_layers, "router_aux_loss_coef": 1e-2},
            "loss": dict(loss or {}),
            "parallel": {"ep": ep, "chunks": chunks, "recompute": recompute, "fsdp": fsdp,
                         "cp": cp, "cpu_offload": cpu_offload},
            "impl": {"linear_ce": linear_ce, "ce_chunk_tokens": 40 if linear_ce == "chunked" else 0,
                     "gated_delta": gated_delta},
            "data": {"batch_size": batch_size, "seq_len": seq_len, "prompt_len": 12, "group_size": 2}}


def reference_run(cand: dict) -> dict:
    ref = {k: dict(v) for k, v in cand.items()}
    ref["parallel"] = {"ep": 1, "chunks": 1, "recompute": "none", "fsdp": False}
    ref["impl"] = {"linear_ce": "reference", "grouped_mm": "reference", "policy_loss": "unfused",
                   "gated_delta": "reference"}
    return ref


def step_case(nproc=2, seed=0, device="cpu", **cand_kw) -> PairedResult:
    """`device` names a backend: "cpu" runs gloo ranks, a GPU backend one rank per GPU.
    batch_size (the global batch) defaults to 4 sequences per data rank."""
    from longmoe.backends import get_backend
    from longmoe.parallel.mesh import Layout
    from longmoe.train.config import from_dict
    cand_kw.setdefault("batch_size", 4 * (nproc // cand_kw.get("cp", 1)))
    cand = candidate_run(**cand_kw)
    ranks = run_ranks(_step_rank, nproc, cand, seed, device=device)
    ref = _step(from_dict(reference_run(cand)), Layout(1, 0, 1, None, None, None),
                get_backend(device).device(0), seed)
    p = cand["parallel"]
    res = PairedResult("step", f"w{nproc} cp{p['cp']} ep{p['ep']} fsdp={p['fsdp']} recompute={p['recompute']} "
                       f"chunks={p['chunks']} ce={cand['impl']['linear_ce']}",
                       "w1, every primitive off", TOLERANCE[torch.float32], info={"seed": seed})
    res.add("loss", torch.tensor(sum(r["loss"] for r in ranks)), torch.tensor(ref["loss"]),
            scale=max(abs(ref["loss"]), ref["loss_scale"]))
    res.add("aux_loss", torch.tensor(sum(r["aux"] for r in ranks)), torch.tensor(ref["aux"]))
    experts = set(ranks[0]["expert_names"])
    ep = ranks[0]["ep"]
    for name, g_ref in ref["grads"].items():
        if name in experts and ep > 1:
            cand_g = torch.cat([ranks[r]["grads"][name] for r in range(ep)])  # ranks 0..ep-1
        else:
            cand_g = ranks[0]["grads"][name]
        res.add(f"grad:{name}", cand_g, g_ref)
    res.info["loss"] = ref["loss"]
    return res


# ---- vocab-parallel linear CE -----------------------------------------------------------------


def _vocab_split(V: int, world: int) -> list[tuple[int, int]]:
    base, extra = divmod(V, world)
    out, s = [], 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append((s, n))
        s += n
    return out


def _vp_inputs(seed, T, H, V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=torch.float64) * 0.5
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (T,), generator=g)
    y[::5] = -100
    c = torch.randn(2, T, generator=g, dtype=torch.float64)
    return h, w, y, c


def _vp_rank(rank, world, backend, seed, T, H, V, chunk):
    from longmoe.ops.linear_ce_vocab_parallel import vocab_parallel_logprobs
    h, w, y, c = _vp_inputs(seed, T, H, V)
    start, n = _vocab_split(V, world)[rank]
    h = h.clone().requires_grad_()
    w_r = w[start:start + n].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(h, w_r, y, dist.group.WORLD, start, chunk_tokens=chunk)
    ((lp * c[0]).sum() + (ent * c[1]).sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": w_r.grad}


def vocab_parallel_case(nproc=2, seed=0, T=47, H=31, V=123, chunk=8) -> PairedResult:
    """Vocab split over `nproc` gloo ranks (uneven when nproc does not divide V) against the
    single-rank reference, fp64."""
    from longmoe.ops.linear_ce import linear_logprobs
    ranks = run_ranks(_vp_rank, nproc, seed, T, H, V, chunk)
    h, w, y, c = _vp_inputs(seed, T, H, V)
    h, w = h.requires_grad_(), w.requires_grad_()
    lp, ent = linear_logprobs(h, w, y, with_entropy=True, impl="reference")
    dh, dw = torch.autograd.grad((lp * c[0]).sum() + (ent * c[1]).sum(), [h, w])
    res = PairedResult("linear_ce_vocab_parallel", f"tp{nproc}", "reference", TOLERANCE[torch.float64] * 1e3,
                       info={"T": T, "H": H, "V": V, "seed": seed})
    for r in ranks:
        res.add(f"logprobs@{len(res.errors)}", r["lp"], lp)
        res.add(f"entropy@{len(res.errors)}", r["ent"], ent)
        res.add(f"dH@{len(res.errors)}", r["dh"], dh)
    res.add("dW", torch.cat([r["dw"] for r in ranks]), dw)
    return res
