"""Single-process paired cases: linear cross-entropy, grouped GEMM, recompute.

Each case draws fresh random inputs (never zeros) from `seed`, runs the candidate and the
reference on the same inputs, and records relative errors of outputs and gradients, peak tensor
memory and median time. Legend: T tokens, H hidden, V vocab, G groups, K/N GEMM dims.
"""

from __future__ import annotations

import dataclasses

import torch

from longmoe.backends import active_backend
from longmoe.config import get_preset
from longmoe.ops.grouped_mm import GROUPED_MM, grouped_mm
from longmoe.ops.linear_ce import LINEAR_CE, linear_cross_entropy, linear_logprobs
from longmoe.ops.linear_ce_fused import POLICY_LOSS, linear_policy_loss
from longmoe.rl.objective import (Objective, TokenInputs, counts_to_int, local_counts,
                                  sample_token_counts)
from longmoe.ops.recompute import apply_recompute
from longmoe.paired.harness import TOLERANCE, PairedResult
from longmoe.paired.memtrack import measure


def _ref_dtype(dtype):
    # fp32 candidates are checked against fp64; low precision against fp32 of the same inputs.
    return torch.float64 if dtype == torch.float32 else torch.float32


def _head_inputs(g, T, H, V, device, ignored_every: int):
    """Fresh hidden states, LM-head weight and labels with some ignored tokens."""
    h = (torch.randn(T, H, generator=g) * 0.5).to(device)
    w = (torch.randn(V, H, generator=g) * 0.5).to(device)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.randperm(T, generator=g)[: max(1, T // ignored_every)]] = -100
    return h, w, y.to(device)


def linear_ce_case(impl="auto", seed=0, T=47, H=31, V=123, dtype=torch.float32, chunk_tokens=8,
                   device=None) -> PairedResult:
    backend = active_backend()
    device = device or backend.device(0)
    g = torch.Generator().manual_seed(seed)
    h, w, y = _head_inputs(g, T, H, V, device, ignored_every=7)
    c_lp = torch.randn(T, generator=g).to(device)
    c_ent = torch.randn(T, generator=g).to(device)
    name = LINEAR_CE.select(impl, h, w, y).name

    def run(which, dt):
        # Both sides see the candidate-dtype inputs; the reference only computes in higher precision.
        hh = h.to(dtype).to(dt).requires_grad_()
        ww = w.to(dtype).to(dt).requires_grad_()
        lp, ent = linear_logprobs(hh, ww, y, with_entropy=True, impl=which, chunk_tokens=chunk_tokens)
        ce = linear_cross_entropy(hh, ww, y, impl=which, chunk_tokens=chunk_tokens)
        obj = (lp * c_lp.to(lp.dtype)).sum() + (ent * c_ent.to(ent.dtype)).sum() + ce
        dh, dw = torch.autograd.grad(obj, [hh, ww])
        return lp, ent, ce, dh, dw

    res = PairedResult("linear_ce", name, "reference", TOLERANCE[dtype],
                       info={"T": T, "H": H, "V": V, "dtype": str(dtype), "seed": seed})
    cand = run(name, dtype)
    ref = run("reference", _ref_dtype(dtype))
    for k, a, b in zip(("logprobs", "entropy", "ce_loss", "dH", "dW"), cand, ref):
        res.add(k, a, b)
    # Memory and time at the candidate dtype for both: the reference holds [T, V] logits.
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name, dtype), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference", dtype), backend, 3)
    res.info["logits_bytes"] = T * V * 4
    return res


# Every term of the objective on, over packed rows: what `longmoe paired policy_loss` checks.
ALL_TERMS = Objective(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3", tis_cap=2.0,
                      entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean")


def _packed_sample_ids(g, T: int, pad_every: int = 9) -> torch.Tensor:
    """Sample ids of T tokens laid end to end as packed rows are, samples of 1-12 tokens, with
    a padding token (-1) after about every `pad_every`-th sample."""
    ids, k = [], 0
    while len(ids) < T:
        n = int(torch.randint(1, 13, (1,), generator=g))
        ids += [k] * n
        if int(torch.randint(0, pad_every, (1,), generator=g)) == 0:
            ids.append(-1)
        k += 1
    return torch.tensor(ids[:T])


def policy_inputs(g, lp0, mask, objective: Objective, sample_ids) -> TokenInputs:
    """Fresh per-token inputs around the policy's log-probs lp0 (fp64) that put tokens in every
    regime: ratios both sides of the clip range and beyond the dual-clip bound, on-policy
    tokens (NaN old), TIS weights above the cap, a reference policy away from the current."""
    T = lp0.numel()
    dev = lp0.device
    trained = mask.nonzero()[:, 0].cpu()
    trained = trained[torch.randperm(trained.numel(), generator=g)].to(dev)
    n_far = max(4, trained.numel() // 8)
    far, on_policy = trained[:n_far], trained[n_far:n_far + trained.numel() // 5]
    old = lp0 + 0.4 * torch.randn(T, generator=g, dtype=torch.float64).to(dev)
    # Ratios e^1.5-e^2.5 on `far` tokens: beyond the clip bound for A > 0, past the dual-clip
    # bound for A < 0 (half of them each).
    old[far] = lp0[far] - 1.5 - torch.rand(n_far, generator=g, dtype=torch.float64).to(dev)
    roll = (old + 0.6 * torch.randn(T, generator=g, dtype=torch.float64).to(dev)).clamp(max=0)
    old[on_policy] = float("nan")
    ref = (lp0 + 0.5 * torch.randn(T, generator=g, dtype=torch.float64).to(dev)).clamp(max=0)
    adv = torch.randn(T, generator=g).to(dev)
    adv[far[0::2]], adv[far[1::2]] = -adv[far[0::2]].abs(), adv[far[1::2]].abs()
    sample_tokens = sample_token_counts(mask, sample_ids.to(dev))
    n_tokens, n_samples = counts_to_int(local_counts(mask, sample_tokens))
    weights = objective.token_weights(mask, n_tokens, n_samples, sample_tokens)
    return TokenInputs(adv, weights, old.float(), ref.float(), roll.float())


def policy_loss_case(impl="auto", seed=0, T=53, H=29, V=131, dtype=torch.float32, chunk_tokens=8,
                     objective: Objective | None = None, device=None) -> PairedResult:
    """The fused policy loss (gradients computed in the forward, the objective's closed-form
    per-token derivatives) against the plain log-softmax reference with autograd through the
    objective's per-token loss, on packed rows (several samples per row, by sample id)."""
    backend = active_backend()
    device = device or backend.device(0)
    objective = objective or ALL_TERMS
    g = torch.Generator().manual_seed(seed)
    h, w, y = _head_inputs(g, T, H, V, device, ignored_every=6)
    sid = _packed_sample_ids(g, T)
    y = torch.where(sid.to(device) < 0, -100, y)  # padding trains nothing
    mask = y != -100
    with torch.no_grad():
        lp0, ent0 = linear_logprobs(h.double(), w.double(), y, impl="reference", with_entropy=True)
    x = policy_inputs(g, lp0, mask, objective, sid)
    name = POLICY_LOSS.select(impl, h, w, y).name

    def run(which, dt):
        hh, ww = h.to(dtype).to(dt).requires_grad_(), w.to(dtype).to(dt).requires_grad_()
        # Advantages and rollout log-probs stay fp32 (as the trainer passes them): a bf16
        # log-prob near -8 would be off by up to 0.03, i.e. 3% in the importance ratio.
        acc = torch.promote_types(dt, torch.float32)
        loss, lp, ent = linear_policy_loss(hh, ww, y, objective, x.map(lambda t: t.to(acc)),
                                           impl=which, chunk_tokens=chunk_tokens)
        dh, dw = torch.autograd.grad(loss * 1.3, [hh, ww])
        return loss.detach(), lp, ent, dh, dw

    stats = objective.stats(lp0, ent0, x.map(lambda t: t.double()), mask)
    res = PairedResult("policy_loss", name, "reference", TOLERANCE[dtype],
                       info={"T": T, "H": H, "V": V, "dtype": str(dtype), "seed": seed,
                             "objective": dataclasses.asdict(objective),
                             "tokens": {k: int(v) for k, v in stats.items() if k.endswith("frac")}})
    # The loss sums weighted per-token terms that nearly cancel (advantages of both signs), so
    # it can sit near 0: its error is measured against the size of its terms, sum |w * loss|.
    per_token = objective.token_loss(lp0, ent0, x.map(lambda t: t.double()), mask)
    scales = {"loss": float(per_token.abs().sum())}
    cand = run(name, dtype)
    for k, a, b in zip(("loss", "logprobs", "entropy", "dH", "dW"), cand,
                       run("reference", _ref_dtype(dtype))):
        res.add(k, a, b, scales.get(k))
    res.info["loss"] = float(cand[0])
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name, dtype), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference", dtype), backend, 3)
    return res


def grouped_mm_case(impl="auto", seed=0, sizes=(5, 0, 17, 1, 9), K=32, N=48,
                    dtype=torch.float32, device=None) -> PairedResult:
    backend = active_backend()
    device = device or backend.device(0)
    g = torch.Generator().manual_seed(seed)
    M, G = sum(sizes), len(sizes)
    x = torch.randn(M, K, generator=g).to(device)
    w = (torch.randn(G, K, N, generator=g) / K ** 0.5).to(device)
    c = torch.randn(M, N, generator=g).to(device)
    name = GROUPED_MM.select(impl, x.to(dtype), w.to(dtype), list(sizes)).name

    def run(which, dt):
        xx, ww = x.to(dtype).to(dt).requires_grad_(), w.to(dtype).to(dt).requires_grad_()
        out = grouped_mm(xx, ww, list(sizes), impl=which)
        dx, dw = torch.autograd.grad((out * c.to(dt)).sum(), [xx, ww])
        return out, dx, dw

    res = PairedResult("grouped_mm", name, "reference", TOLERANCE[dtype],
                       info={"sizes": list(sizes), "K": K, "N": N, "dtype": str(dtype)})
    for k, a, b in zip(("out", "dX", "dW"), run(name, dtype), run("reference", _ref_dtype(dtype))):
        res.add(k, a, b)
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name, dtype), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference", dtype), backend, 3)
    return res


def gated_delta_case(impl="auto", seed=0, B=2, T=77, Hk=2, Hv=4, dk=16, dv=12, decay=20.0,
                     device=None) -> PairedResult:
    """Gated delta rule against its token recurrence: output, final state and the gradients of
    q, k, v, g, beta and the initial state (strong decay, T not a multiple of the chunk)."""
    from longmoe.ops.gated_delta import GATED_DELTA, gated_delta_rule
    backend = active_backend()
    device = device or backend.device(0)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    inputs = [r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv),
              (-torch.rand(B, T, Hv, generator=g) * decay).to(device),
              torch.rand(B, T, Hv, generator=g).to(device), r(B, Hv, dk, dv)]
    co, cs = r(B, T, Hv, dv), r(B, Hv, dk, dv)
    name = GATED_DELTA.select(impl, *inputs[:5], inputs[5]).name

    def run(which):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o, S = gated_delta_rule(*leaves[:5], initial_state=leaves[5], impl=which)
        grads = torch.autograd.grad((o * co).sum() + (S * cs).sum(), leaves)
        return (o, S) + grads

    res = PairedResult("gated_delta", name, "reference", TOLERANCE[torch.float32],
                       info={"B": B, "T": T, "Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv,
                             "decay": decay})
    names = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dS0")
    for k, a, b in zip(names, run(name), run("reference")):
        res.add(k, a, b)
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference"), backend, 3)
    return res


def recompute_case(impl="auto", seed=0, batch=2, seq=96, device=None, policy="full",
                   keep_attention=False, preset="tiny") -> PairedResult:
    """A stack of tiny-preset blocks, recompute (`policy`, `keep_attention`) vs stored
    activations: identical math, so the tolerance is fp32 round-off; the memory column shows
    what recompute frees. `preset`: "tiny" (3 attention blocks) or "tiny-hybrid" (3 Gated
    DeltaNet blocks, then attention)."""
    from longmoe.model.transformer import MoETransformer
    backend = active_backend()
    device = device or backend.device(0)
    cfg = get_preset(preset).replace(router_aux_loss_coef=1e-2)
    if preset == "tiny":
        cfg = cfg.replace(num_layers=3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)

    def build(policy):
        with torch.device(device):
            m = MoETransformer(cfg)
        m.init_weights(seed)
        m.layers = torch.nn.ModuleList(apply_recompute(b, policy, impl, keep_attention)
                                       for b in m.layers)
        return m

    models = {"full": build(policy), "none": build("none")}

    def run(policy):
        m = models[policy]
        m.zero_grad(set_to_none=True)
        lp, _, aux, _ = m(ids, labels)
        loss = -lp.mean() + aux
        loss.backward()
        return loss.detach(), {n.replace("block.", ""): p.grad.clone()
                               for n, p in m.named_parameters()}

    label = policy + (", keep_attention" if keep_attention else "")
    res = PairedResult("recompute", f"{'checkpoint' if impl == 'auto' else impl} ({label})",
                       "reference (stored activations)",
                       TOLERANCE[torch.float32], info={"layers": cfg.num_layers, "tokens": batch * seq})
    (lc, gc), (lr, gr) = run("full"), run("none")
    res.add("loss", lc, lr)
    for n in gr:
        res.add(f"grad:{n}", gc[n], gr[n])
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run("full"), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("none"), backend, 3)
    return res


def megatron_moe_case(seed=0, T=53, num_experts=8, top_k=2, dtype=torch.float64) -> PairedResult:
    """longmoe's MoE layer (one process) against one built from megatron-core's MoE utilities, the
    seeds' baseline: softmax top-k routing (`topk_routing_with_score_function`), token
    permutation by routing map (`permute` / `unpermute`), the switch balance loss
    (`switch_load_balancing_loss_func`), the same expert and shared-expert weights. Outputs, the
    balance loss and every gradient. megatron-core is imported here only."""
    import torch.nn.functional as F
    from megatron.core.transformer.moe import moe_utils as mu

    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    cfg = get_preset("tiny").replace(num_experts=num_experts, top_k=top_k, norm_topk_prob=True,
                                     router_aux_loss_coef=1e-2)
    moe = MoE(cfg)
    init_params(moe, cfg, seed)
    moe.to(dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, cfg.hidden_size, generator=g, dtype=dtype)
    c = torch.randn(1, T, cfg.hidden_size, generator=g, dtype=dtype)

    def ours():
        xx = x.clone().requires_grad_()
        y, aux = moe(xx)
        return xx, y, aux

    def megatron():
        xx = x.clone().requires_grad_()
        h = xx.view(T, -1)
        logits = F.linear(h, moe.router.weight)
        # use_pre_softmax=False: top-k of the logits, softmax over those k = renormalised top-k
        probs, routing_map = mu.topk_routing_with_score_function(logits, top_k, use_pre_softmax=False)
        permuted, _, sorted_idx = mu.permute(h, routing_map)
        per_expert = routing_map.sum(0).tolist()
        outs, s = [], 0
        for e, n in enumerate(per_expert):
            a = permuted[s:s + n] @ moe.experts.w_in[e]
            gate, up = a.chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ moe.experts.w_out[e])
            s += n
        y = mu.unpermute(torch.cat(outs), sorted_idx, h.shape, probs=probs, routing_map=routing_map)
        y = y + moe.shared(h)
        scores = torch.softmax(logits, dim=-1)
        aux = mu.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, top_k, num_experts,
                                                 cfg.router_aux_loss_coef)
        return xx, y.view(1, T, -1), aux

    res = PairedResult("moe_layer", "longmoe MoE", "megatron-core moe_utils", TOLERANCE[torch.float32],
                       info={"T": T, "experts": num_experts, "top_k": top_k, "dtype": str(dtype)})
    grads = {}
    for name, fn in (("ours", ours), ("megatron", megatron)):
        moe.zero_grad(set_to_none=True)
        xx, y, aux = fn()
        ((y * c).sum() + aux).backward()
        grads[name] = {"y": y.detach(), "aux": aux.detach(), "dX": xx.grad,
                       **{n: p.grad.clone() for n, p in moe.named_parameters()
                          if p.grad is not None}}
    for k, ref in grads["megatron"].items():
        res.add(k, grads["ours"][k], ref)
    return res


def router_matmul_case(impl="auto", seed=0, T=53, H=40, E=13, dtype=torch.bfloat16,
                       device=None) -> PairedResult:
    """The router's logits GEMMs (ops/router_matmul.py) against the fp32 reference on fp32 casts
    of the same values: logits, dx and dW. Gradients of the logits are fp32 and small, as a
    softmax's are."""
    from longmoe.ops.router_matmul import ROUTER_MATMUL, router_logits
    backend = active_backend()
    device = device or backend.device(0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(E, H, generator=g) * 0.05).to(dtype).to(device)
    gl = (torch.randn(T, E, generator=g) * 1e-3).to(device)
    name = ROUTER_MATMUL.select(impl, x, w).name

    def run(which, dt):
        xx, ww = x.to(dt).requires_grad_(), w.to(dt).requires_grad_()
        y = router_logits(xx, ww, which)
        return (y, *torch.autograd.grad(y, (xx, ww), gl.to(y.dtype)))

    res = PairedResult("router_matmul", name, "reference", TOLERANCE[dtype],
                       info={"T": T, "H": H, "E": E, "dtype": str(dtype), "seed": seed})
    for k, a, b in zip(("logits", "dX", "dW"), run(name, dtype), run("reference", _ref_dtype(dtype))):
        res.add(k, a, b)
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name, dtype), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference", dtype), backend, 3)
    return res


def moe_rows_case(impl="auto", seed=0, T=13, K=3, H=37, F=11, dtype=torch.float32,
                  device=None) -> PairedResult:
    """The MoE row kernels (ops/moe_rows.py) against the eager reference: the combine and its
    gradients (rows and router weights), the dispatch's gradient, SwiGLU forward and backward
    (with the expert-side router-weight dot), the scaled gather with its dot, and an accumulating
    weighted K-sum. Rows sit in a random order of the T*K assignments (a permutation), as after
    the routing sort."""
    from longmoe.ops.moe_rows import (MOE_ROWS, SwiGLU, gather_scale, gather_sum,
                                      swiglu_backward)
    from longmoe.parallel.expert_parallel import (combine_permuted, dispatch_rows,
                                                  inverse_permutation)
    backend = active_backend()
    device = device or backend.device(0)
    g = torch.Generator().manual_seed(seed)
    A = T * K
    order = torch.randperm(A, generator=g).to(device)
    inv = inverse_permutation(order)
    x = torch.randn(T, H, generator=g).to(device)
    y = torch.randn(A, H, generator=g).to(device)
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(device)  # fp32, like the router's
    h = (2 * torch.randn(A, 2 * F, generator=g)).to(device)
    ga = torch.randn(A, F, generator=g).to(device)
    cy, cx = torch.randn(T, H, generator=g).to(device), torch.randn(A, H, generator=g).to(device)
    ch = torch.randn(A, F, generator=g).to(device)
    base = torch.randn(T, H, generator=g).to(device)
    name = MOE_ROWS.select(impl, y.to(dtype)).name

    def run(which, dt):
        c = lambda t: t.to(dtype).to(dt).clone()  # noqa: E731  candidate-dtype values, ref precision
        yy, ww = c(y).requires_grad_(), w.clone().requires_grad_()
        out = combine_permuted(yy, order, ww, inv, impl=which)
        d_rows, d_w = torch.autograd.grad((out * c(cy)).sum(), [yy, ww])
        xx = c(x).requires_grad_()
        (d_x,) = torch.autograd.grad((dispatch_rows(xx, order, inv, K, which) * c(cx)).sum(), [xx])
        hh = c(h).requires_grad_()
        a = SwiGLU.apply(hh, which)
        (d_h,) = torch.autograd.grad((a * c(ch)).sum(), [hh])
        gh, a2, dot = swiglu_backward(c(h), c(ga), with_dot=True, impl=which)
        rows, dot2 = gather_scale(c(cy), order // K, w.reshape(-1)[order], c(y), impl=which)
        acc = gather_sum(c(y), inv, w.reshape(-1), K, out=c(base).clone(), accumulate=True,
                         impl=which)
        return (out, d_rows, d_w, d_x, a, d_h, gh, a2, dot, rows, dot2, acc)

    res = PairedResult("moe_rows", name, "reference", TOLERANCE[dtype],
                       info={"T": T, "K": K, "H": H, "F": F, "dtype": str(dtype), "seed": seed})
    keys = ("combine", "combine.d_rows", "combine.d_w", "dispatch.dX", "swiglu", "swiglu.dH",
            "swiglu_bwd.dH", "swiglu_bwd.a", "swiglu_bwd.dot", "gather_scale", "gather_scale.dot",
            "gather_sum+=")
    for k, a, b in zip(keys, run(name, dtype), run("reference", _ref_dtype(dtype))):
        res.add(k, a, b)
    _, res.peak_bytes["candidate"], res.time_ms["candidate"] = measure(lambda: run(name, dtype), backend, 3)
    _, res.peak_bytes["reference"], res.time_ms["reference"] = measure(lambda: run("reference", dtype), backend, 3)
    return res
